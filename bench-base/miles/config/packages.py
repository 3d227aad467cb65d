"""Optional packages: the one way a check says that a flag needs a package this Python lacks.

The base install (pyproject.toml's `[project.dependencies]`) runs every path that names no optional
backend: the demo, the embedded and fast engines, the torch trainer, the built-in rewards. A path that
does name one (a remote reward model or OPD teachers over HTTP, the SGLang engine, megatron, W&B,
TensorBoard, MLflow) imports its package where that path starts, and the owner of that path has a
check that refuses the run before anything starts (exit 2) when the package is missing, with the
flag, the package and the line that installs it, built here. `tests/unit/test_base_imports.py`
keeps the first half true: it fails when a module the CLI or a machine's phases load imports a
package the base install does not provide.
"""

from __future__ import annotations

import importlib.util
import sys


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a missing parent package counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):   # ValueError: a module in sys.modules with no spec
        return module in sys.modules


def install_line(package: str, extra: str | None = None) -> str:
    """The command that installs `package`: miles' extra that brings it (a checkout's editable form and
    the installed one's), else the package itself."""
    if extra is None:
        return f"pip install {package}"
    return f"pip install -e '.[{extra}]' in a miles checkout (pip install 'miles[{extra}]' otherwise)"


def missing_package(flag: str, module: str, package: str, extra: str | None = None) -> str | None:
    """The problem line when `module` (from `package`, in miles' `extra`) is not installed, else None."""
    if installed(module):
        return None
    return (f"{flag} needs the {package!r} package (module {module!r}), which is not installed in this Python "
            f"({sys.prefix}): {install_line(package, extra)}")
