"""Which of the given modules cannot be imported with the base install's packages alone?

Run as a script in a fresh interpreter (`python tests/base_imports.py MODULE ...`, from a project root):
every module of a distribution that only an extra of pyproject.toml brings (the dev extra's included,
though this venv has them installed) is blocked, then each MODULE is imported. Prints one line per
module that fails, with the chain of the project's files that led to the import, and exits 1; exits 0
when all load. tests/unit/test_base_imports.py runs it on what the CLI and the machines' phases load.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata as md
import re
import sys
import tomllib
import traceback
from pathlib import Path


def _dist(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _closure(requirements: list[str]) -> set[str]:
    """The distributions `requirements` bring, transitively (a requirement under an extra's marker left out)."""
    seen: set[str] = set()
    todo = [_dist(r) for r in requirements if "extra ==" not in r]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [_dist(r) for r in md.requires(name) or [] if "extra ==" not in r]
        except md.PackageNotFoundError:
            pass
    return seen


def extras_only_modules(pyproject: Path) -> set[str]:
    """Top-level modules that an extra brings and the base dependencies do not."""
    project = tomllib.loads(pyproject.read_text())["project"]
    base = _closure(project.get("dependencies", []))
    extras = _closure([r for reqs in project.get("optional-dependencies", {}).values() for r in reqs]) - base

    def norm(dists):
        return {d.lower().replace("_", "-") for d in dists}

    return {module for module, dists in md.packages_distributions().items()
            if norm(dists) & extras and not norm(dists) & base}


class _Block(importlib.abc.MetaPathFinder):
    def __init__(self, blocked: set[str]):
        self.blocked = blocked

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (only an extra of pyproject.toml brings it)",
                                      name=name)
        return None


def failures(modules: list[str], root: Path) -> list[str]:
    """One line per module of `modules` that does not import: the module, the error, the import chain."""
    sys.meta_path.insert(0, _Block(extras_only_modules(root / "pyproject.toml")))
    lines = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            chain = [f"{Path(f.filename).relative_to(root)}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)
                     if Path(f.filename).is_relative_to(root) and Path(f.filename).name != Path(__file__).name]
            lines.append(f"{name}: {exc} (imported via {' -> '.join(chain) or name})")
    return lines


if __name__ == "__main__":
    root = Path.cwd()
    sys.path.insert(0, str(root))
    bad = failures(sys.argv[1:], root)
    print("\n".join(bad) or f"all {len(sys.argv) - 1} modules load on the base install")
    sys.exit(1 if bad else 0)
