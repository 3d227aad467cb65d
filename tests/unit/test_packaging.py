"""An installed (non-editable) wheel finds its machine definitions from any working directory."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_ships_machines_and_loads_them_from_elsewhere(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    wheel = next(tmp_path.glob("miles-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "miles/machines/sync.yaml" in names and "miles/machines/eval_only.yaml" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import miles.runtime as r, miles.machines as m; "
            "assert m.__file__.startswith(%r), m.__file__; "
            "print(sorted(r.builtin_machines())); print(r.load_machine('sync').name)" % str(site))
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "'sync'" in out.stdout and out.stdout.strip().endswith("sync")


def test_source_checkout_runs_the_cli_with_only_pythonpath(tmp_path):
    # -S: no site processing, so the editable install's .pth finder (which maps miles.machines) is off;
    # the venv's site-packages comes back through PYTHONPATH for yaml and transitions only
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), site])}
    probe = subprocess.run([sys.executable, "-S", "-c", "import miles.machines"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0, "miles.machines is importable: the test would not exercise the fallback"
    out = subprocess.run([sys.executable, "-S", "-m", "miles.cli", "machine", "show", "sync"], cwd=tmp_path,
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "stateDiagram-v2" in out.stdout and "weight_sync" in out.stdout
    listed = subprocess.run([sys.executable, "-S", "-m", "miles.cli", "machine", "list"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert listed.returncode == 0 and "async" in listed.stdout and "sync" in listed.stdout, listed.stderr
