"""Take out of Ray's wheel in `.whl/` the libraries a miles run never imports (rllib, serve, tune,
train, llm, data) and the dashboard's web client, so that the checkout plus `.whl/` fit in what one
call to the GPU machine carries (64 MiB). `ray.init` and actors need none of them; the RECORD file
loses their lines too. Its three big binaries (gcs_server, raylet, _raylet.so) are stored LZMA-compressed
instead of deflated (38 -> 28 MiB): pip installs from Python's zipfile, which reads both, and the file
bytes and modes are unchanged.

    python3 scripts/slim_ray_wheel.py [.whl]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

BIG = 8 * 2 ** 20          # files over this many bytes are stored with LZMA
DROP = ("ray/rllib/", "ray/serve/", "ray/tune/", "ray/train/", "ray/llm/", "ray/data/", "ray/dashboard/client/build/")


def slim(wheel: Path) -> tuple[int, int]:
    """Rewrite `wheel` without DROP; returns its sizes before and after, in bytes."""
    before = wheel.stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / wheel.name
        with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename.startswith(DROP):
                    continue
                data = zin.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):
                    kept = [line for line in data.decode().splitlines() if not line.startswith(DROP)]
                    data = ("\n".join(kept) + "\n").encode()
                kind = zipfile.ZIP_LZMA if info.file_size > BIG else zipfile.ZIP_DEFLATED
                zout.writestr(info, data, compress_type=kind)
        shutil.move(out, wheel)
    return before, wheel.stat().st_size


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".whl")
    wheels = sorted(folder.glob("ray-*.whl"))
    if not wheels:
        raise SystemExit(f"no ray-*.whl in {folder}: build it first (the GPU README's wheelhouse.sh)")
    for w in wheels:
        before, after = slim(w)
        print(f"{w.name}: {before / 2 ** 20:.1f} MiB -> {after / 2 ** 20:.1f} MiB")
