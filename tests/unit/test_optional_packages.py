"""A run that needs a package only an extra brings, in a Python without it, is refused before anything
starts (exit 2) with the flag, the package and the install line; a phase whose module imports a missing
package is a missing package, not a bad machine definition."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles.config.packages import install_line, installed, missing_package
from miles.runtime import MachineDefinitionError, MissingPackageError, parse_machine

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples" / "arithmetic" / "grpo.yaml")

# the CLI in a Python where `aiohttp` cannot be imported (None in sys.modules makes every import of it fail)
WITHOUT_AIOHTTP = ("import sys; sys.modules['aiohttp'] = None; from miles.cli.train import main; "
                   "sys.exit(main(sys.argv[1:]))")


def run_cli_without_aiohttp(tmp_path, *flags):
    return subprocess.run([sys.executable, "-c", WITHOUT_AIOHTTP, "--config", DEMO, "--run-dir", str(tmp_path / "run"),
                           *flags], capture_output=True, text=True, timeout=300)


def test_rm_url_without_the_http_client_exits_2_naming_the_package_and_the_install(tmp_path):
    out = run_cli_without_aiohttp(tmp_path, "--rm-url", "http://127.0.0.1:9/score")
    assert out.returncode == 2, out.stderr
    assert "--rm-url needs the 'aiohttp' package" in out.stderr
    assert "pip install -e '.[remote]'" in out.stderr
    assert "machine definition" not in out.stderr
    assert not (tmp_path / "run" / "trace.jsonl").exists()       # nothing started


def test_the_same_run_without_rm_url_needs_no_http_client():
    # the demo's own flags pass every check (the registry's contributors loaded) in that Python
    code = ("import sys; sys.modules['aiohttp'] = None; from miles.config.flags import parse_flags; "
            "parse_flags(sys.argv[1:]); import miles.phases.init")
    out = subprocess.run([sys.executable, "-c", code, "--config", DEMO], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("flag,extra", [("--opd-type sglang", "remote"), ("--rollout-engine sglang", "sglang")])
def test_each_http_path_names_its_extra(flag, extra):
    line = missing_package(flag, "surely_not_a_module_here", "aiohttp", extra)
    assert line.startswith(f"{flag} needs the 'aiohttp' package (module 'surely_not_a_module_here')")
    assert line.endswith(install_line("aiohttp", extra)) and f"'.[{extra}]'" in line


def test_installed_is_false_for_a_missing_parent_and_true_for_the_base():
    assert installed("yaml") and not installed("surely_not_a_package.core")
    assert missing_package("--x", "yaml", "pyyaml") is None
    assert install_line("mlflow") == "pip install mlflow"


MACHINE = """
name: needs_a_package
initial: init
states:
  init: {phase: "PHASE"}
  draining: {phase: "tests.stub_phases:stub_phase"}
  shutdown: {final: true}
transitions:
  - {trigger: ready, source: init, dest: draining}
  - {trigger: fail, source: "*", dest: draining}
  - {trigger: stop, source: "*", dest: draining}
  - {trigger: finish, source: draining, dest: shutdown}
  - {trigger: fail, source: draining, dest: shutdown}
"""


def test_a_phase_importing_a_missing_package_is_a_missing_package_with_the_importing_line(tmp_path, monkeypatch):
    (tmp_path / "phase_with_extra.py").write_text("import surely_not_installed_pkg\n\n\nasync def init(ctx):\n"
                                                  "    return 'ready'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    definition = parse_machine(MACHINE.replace("PHASE", "phase_with_extra:init"), source="needs_a_package.yaml")
    with pytest.raises(MissingPackageError) as err:
        definition.resolve_phases()
    text = str(err.value)
    assert "imports 'surely_not_installed_pkg'" in text and "phase_with_extra.py:1" in text
    assert "invalid machine definition" not in text and err.value.input_fault


def test_a_phase_path_naming_no_module_stays_a_definition_error():
    definition = parse_machine(MACHINE.replace("PHASE", "no_such_phase_module:init"), source="bad.yaml")
    with pytest.raises(MachineDefinitionError, match="no_such_phase_module"):
        definition.resolve_phases()
