"""The base install (no extra) loads the CLI, every phase a built-in machine names, and every module the
config checks import: the README's first command (`bash scripts/run-demo.sh`, which installs no extra)
cannot fail on a module only an extra brings. `.ci/run` also runs that command in a base-only venv.

The second test shows the check bites: a copy of the package whose `miles/rollout/opd_teacher.py` (loaded by
`init` through the rollout executor) imports aiohttp at its top again, as it did before issue 53, is
reported with the chain of files that leads there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from miles.config.checks import CONTRIBUTORS
from miles.runtime import builtin_machines, load_machine

ROOT = Path(__file__).resolve().parents[2]
WALKER = ROOT / "tests" / "base_imports.py"


def modules_a_run_loads() -> list[str]:
    phases = {s.phase.partition(":")[0] for name in builtin_machines()
              for s in load_machine(name).states.values() if s.phase}
    return sorted({"miles.cli", "miles.cli.train", *CONTRIBUTORS, *phases})


def walk(root: Path, modules: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WALKER), *modules], cwd=root, capture_output=True, text=True,
                          timeout=300)


def test_the_cli_and_every_phase_load_on_the_base_install():
    modules = modules_a_run_loads()
    assert "miles.phases.init" in modules and "miles.cli.train" in modules
    out = walk(ROOT, modules)
    assert out.returncode == 0, f"the base install cannot load:\n{out.stdout}{out.stderr}"


def test_a_top_level_import_of_an_extras_package_is_caught_with_its_chain(tmp_path):
    shutil.copytree(ROOT / "miles", tmp_path / "miles", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "machines", tmp_path / "machines")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(WALKER, tmp_path)
    teacher = tmp_path / "miles" / "rollout" / "opd_teacher.py"
    teacher.write_text(teacher.read_text().replace("import asyncio\n", "import asyncio\n\nimport aiohttp\n", 1))
    out = subprocess.run([sys.executable, "base_imports.py", "miles.phases.init"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "miles.phases.init: No module named 'aiohttp'" in out.stdout
    assert "miles/rollout/executor.py" in out.stdout and "miles/rollout/opd_teacher.py" in out.stdout
