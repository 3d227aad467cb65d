"""What a run sends to a cluster it attaches to (`--ray-address`): miles itself and the user's files,
through Ray's runtime_env, so that an actor on another machine needs none of the driver's files.

- **miles**: the package folder the driver imports, as a `py_modules` entry (first on the actors'
  PYTHONPATH, so a node's own copy, if any, does not shadow the driver's).
- **Functions given by file** (`--custom-rm-path reward.py:fn`, and the other flags of
  `RunConfig.user_function_paths`): each file is copied into the run's shipped folder
  (`<run-dir>/shipped/_miles_user_files/<n>/`), which becomes the actors' working directory (Ray's
  `working_dir`); `miles.user_code` finds the copy through `USER_FILES_ENV`. A file travels alone:
  one that imports modules beside it should be a package given by module path.
- **Functions given by module** (`my_rewards.math:fn`): the top-level module or package is copied into
  the shipped folder (on the actors' sys.path) when the driver imports it from outside the Python
  installation; one imported from site-packages or the standard library is installed software and
  must be installed on every node, like torch.
- `--ray-no-ship-code` ships nothing: miles and the user's files are at the same paths on every node
  (actors then read relative file paths from the driver's working directory, as on a local cluster).

Never shipped: version control, virtual environments, caches, run folders (`EXCLUDED_NAMES`) and
weight files (`EXCLUDED_SUFFIXES`); a shipment over `MAX_SHIPPED_BYTES` is a ConfigError naming its
biggest files. Ray 2.60's own limits, for reference: each package (the working_dir, each py_modules
entry) must stay under 512 MiB (its gRPC message size, `RAY_max_grpc_message_size`); it warns above
half of that and for single files over 10 MiB, and honours `.gitignore`/`.rayignore` files inside a
shipped folder. Packages are content-addressed: a node unpacks the same one once.

Not shipped, by design: models and data. Prompt and eval files are read by the driver and reach the
actors as values; a model folder (`--hf-checkpoint`, `--critic-load`) is read by the actors and must
be at the same path on every node where they run, as in miles; an actor that does not find it there
says so, with its node (`RayCluster.actor`). Checkpoints: `miles.phases.checkpoint_io`.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import sysconfig
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Iterable, Mapping

from miles.config import ConfigError
from miles.user_code import USER_FILES_ENV, split_path

SHIPPED_DIR = "shipped"                    # under the run directory
USER_FILES_DIR = "_miles_user_files"       # inside it: the files given by path
MAX_SHIPPED_BYTES = 100 * 2**20            # far below Ray's 512 MiB; more is a model or data set, not code
EXCLUDED_NAMES = frozenset({".git", ".hg", ".svn", ".venv", "venv", "__pycache__", ".pytest_cache", ".mypy_cache",
                            ".ruff_cache", ".ipynb_checkpoints", "node_modules", "wandb", "runs"})
EXCLUDED_SUFFIXES = frozenset({".pyc", ".pyo", ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx"})
RAY_EXCLUDES = [*sorted(EXCLUDED_NAMES), *(f"*{s}" for s in sorted(EXCLUDED_SUFFIXES))]   # gitignore style


@dataclass(frozen=True)
class Shipment:
    """What the run ships: its folder (the actors' working directory) and the code folders."""

    folder: Path
    files: dict[str, str] = field(default_factory=dict)    # a user file as given → its copy, relative to folder
    modules: tuple[str, ...] = ()                           # top-level user modules copied into folder
    code: tuple[str, ...] = ()                              # py_modules: miles' package folder
    num_bytes: int = 0

    def runtime_env(self) -> dict[str, Any]:
        """The job's runtime_env (`ray.init(runtime_env=...)`): every actor of the run inherits it."""
        return {"working_dir": str(self.folder), "py_modules": list(self.code), "excludes": list(RAY_EXCLUDES),
                "env_vars": {USER_FILES_ENV: json.dumps(self.files)}}

    def describe(self) -> dict[str, Any]:
        """For the trace's `code_shipped` event."""
        return {"folder": str(self.folder), "files": dict(self.files), "modules": list(self.modules),
                "code": list(self.code), "num_bytes": self.num_bytes}


def stage(paths: Mapping[str, str], folder: Path, *, code: Iterable[Path] = (), cwd: Path | None = None) -> Shipment:
    """Copy the user's functions (`paths`: flag → path as given) into `folder` (emptied first) and
    describe the shipment with `code` (package folders for py_modules). ConfigError for a module
    that cannot be shipped or a shipment over MAX_SHIPPED_BYTES."""
    cwd = cwd or Path.cwd()
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    files: dict[str, str] = {}
    modules: dict[str, str] = {}
    for flag, path in paths.items():
        target, _ = split_path(path)
        if target.endswith(".py"):
            if target not in files:
                files[target] = _copy_file(cwd / target, folder, len(files))
        elif (top := target.split(".")[0]) not in modules and top != "miles":
            copied = _copy_module(top, folder, flag, path)
            if copied:
                modules[top] = copied
    code = tuple(str(c) for c in code)
    num_bytes = _size(folder) + sum(_size(Path(c)) for c in code)
    if num_bytes > MAX_SHIPPED_BYTES:
        raise ConfigError(_too_big(folder, code, num_bytes))
    return Shipment(folder, files, tuple(modules), code, num_bytes)


def miles_package() -> Path:
    """The folder of the miles package this process imports (what the actors get)."""
    import miles

    return Path(miles.__file__).parent


def _copy_file(file: Path, folder: Path, index: int) -> str:
    relative = Path(USER_FILES_DIR) / str(index) / file.name
    (folder / relative).parent.mkdir(parents=True)
    shutil.copy2(file, folder / relative)
    return relative.as_posix()


def _copy_module(top: str, folder: Path, flag: str, path: str) -> str | None:
    """Copy the top-level module `top` into `folder` unless it is installed software; the copy's name."""
    spec = find_spec(top)
    if spec is None:                # the import check on the driver fails first; kept for a direct caller
        raise ConfigError(f"{flag} {path}: module {top!r} is not importable on the driver")
    locations = list(spec.submodule_search_locations or [])
    origin = Path(locations[0]) if locations else Path(spec.origin) if spec.origin else None
    if origin is None or not origin.exists() or _installed(origin):
        return None                 # built in, frozen, or installed: every node has (must have) it
    if len(locations) > 1:
        raise ConfigError(f"{flag} {path}: {top!r} is a namespace package spread over {locations}; --ray-address "
                          "ships one folder: make it a package with an __init__.py, or install it on every node "
                          "and pass --ray-no-ship-code")
    if locations:
        shutil.copytree(origin, folder / top, ignore=_ignored)
        return top
    if origin.suffix != ".py":
        raise ConfigError(f"{flag} {path}: {top!r} is a compiled module ({origin}); install it on every node "
                          "and pass --ray-no-ship-code")
    shutil.copy2(origin, folder / origin.name)
    return top


def _installed(origin: Path) -> bool:
    """Under the standard library or a site-packages folder (not merely under the interpreter's prefix:
    in a container that can be `/`)."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {*site.getsitepackages(), site.getusersitepackages()}
    resolved = origin.resolve()
    return any(resolved.is_relative_to(Path(r).resolve()) for r in roots if r)


def _ignored(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in EXCLUDED_NAMES or Path(n).suffix in EXCLUDED_SUFFIXES
            or (Path(directory) / n / "pyvenv.cfg").is_file()}


def _files(root: Path) -> Iterable[Path]:
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_NAMES]
        for name in filenames:
            if Path(name).suffix not in EXCLUDED_SUFFIXES:
                yield Path(directory) / name


def _size(root: Path) -> int:
    return sum(f.stat().st_size for f in _files(root))


def _too_big(folder: Path, code: tuple[str, ...], num_bytes: int) -> str:
    biggest = sorted((f for root in (folder, *map(Path, code)) for f in _files(root)),
                     key=lambda f: f.stat().st_size, reverse=True)[:5]
    listed = ", ".join(f"{f} ({f.stat().st_size / 2**20:.1f} MiB)" for f in biggest)
    return (f"--ray-address ships {num_bytes / 2**20:.0f} MiB of code and user files (at most "
            f"{MAX_SHIPPED_BYTES // 2**20} MiB); the biggest: {listed}. Give the function by a file path "
            "(path/reward.py:fn ships that file alone), move data out of the shipped package, or install it "
            "on every node and pass --ray-no-ship-code")
