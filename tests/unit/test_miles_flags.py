"""Every miles flag is implemented or refused with one line; never both; the docs' table is the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.config.flags import FLAGS, help_text, parse_flags
from miles.config.miles_flags import (MEGATRON_REFUSED, MILES_FLAGS, PASSTHROUGH_PREFIX, REFUSED, REFUSED_PREFIXES,
                                      fate, markdown, refused_in)
from miles.config.megatron_flags import megatron_options
from tests.unit.test_tracking_flags import base

IMPLEMENTED = {f.name for f in FLAGS}
DOC = Path(__file__).resolve().parents[2] / "docs" / "coming-from-miles.md"


def test_every_miles_flag_is_implemented_or_refused():
    # or an SGLang server flag (--sglang-<ServerArgs field>), passed through as miles passes it
    neither = [name for name in MILES_FLAGS if name not in IMPLEMENTED and fate(name) is None
               and name not in megatron_options() and not name.startswith(PASSTHROUGH_PREFIX)]
    assert neither == []


def test_miles_own_sglang_flags_are_refused_and_sglang_server_flags_pass_through(tmp_path):
    argv = base(tmp_path) + ["--rollout-engine", "sglang", "--sglang-mem-fraction-static", "0.5"]
    assert parse_flags(argv)[0].sglang.server_args == ("--mem-fraction-static", "0.5")
    with pytest.raises(ConfigError) as info:
        parse_flags(argv + ["--sglang-router-ip", "10.0.0.1", "--sglang-config", "models.yaml"])
    assert [p.split(" ", 1)[0] for p in info.value.problems] == ["--sglang-router-ip", "--sglang-config"]


def test_no_flag_is_both_implemented_and_refused():
    # when another branch implements a flag refused here as "(issue N)", this fails until its row goes
    both = sorted(IMPLEMENTED & (set(REFUSED) | set(MEGATRON_REFUSED) | set(megatron_options())))
    assert both == [], f"implemented and refused: {both}; drop their rows from miles/config/miles_flags.py"
    stale = [(prefix, name) for prefix, text in REFUSED_PREFIXES.items() if "(issue" in text
             for name in IMPLEMENTED if name.startswith(prefix)]
    assert stale == [], f"a family refused as another issue's now has implemented members: {stale}; reword its row"


def test_the_issue_19_flags_are_implemented():
    asked = ("save-hf no-save-optim keep-last-checkpoints start-rollout-id eval-config log-passrate rollout-stop "
             "rollout-stop-token-ids rollout-max-context-len chat-template-path apply-chat-template-kwargs "
             "num-steps-per-rollout use-unbiased-kl kl-loss-type custom-loss-function-path custom-tis-function-path "
             "use-mlflow debug-train-only save-debug-train-data ci-test").split()
    assert [name for name in asked if name not in IMPLEMENTED] == []


def test_each_fate_is_one_line_saying_what_it_does_and_what_to_use():
    for name, text in {**REFUSED, **MEGATRON_REFUSED, **REFUSED_PREFIXES}.items():
        assert "\n" not in text and (";" in text or ":" in text), (name, text)
        assert len(text) < 200, (name, len(text))


def test_refused_flags_stop_the_run_with_one_line_each(tmp_path):
    argv = base(tmp_path) + ["--offload-train-target", "cpu", "--sglang-router-ip", "10.0.0.1",
                             "--moe-router-enable-expert-bias", "--moe-expert-capacity-factor", "1.0", "--no-true-on-policy-mode",
                             "--critic-num-gpus-per-node=2", "--attention-dropout", "0.1", "--lr", "-1"]
    with pytest.raises(ConfigError) as info:
        parse_flags(argv)
    problems = info.value.problems
    refused = [p for p in problems if "is a miles flag this build does not take" in p]
    assert [p.split(" ", 1)[0] for p in refused] == ["--offload-train-target", "--sglang-router-ip",
                                                     "--no-true-on-policy-mode", "--critic-num-gpus-per-node"]
    assert "offload the trainer to cpu or disk; not supported yet: --offload-train moves it to host memory" in refused[0]
    # a refused Megatron family is one line for all of its flags
    assert [p for p in problems if p.startswith("--moe-router-enable-expert-bias, --moe-expert-capacity-factor are miles "
                                                "flags this build does not take: MoE: Megatron-LM's mixture-of-experts")]
    # a Megatron flag with one possible value here names it
    assert any(p.startswith("--attention-dropout 0.1: attention dropout; dropout is off here") for p in problems)
    assert any(p.startswith("--lr -1") for p in problems)       # reported together with the other problems


def test_an_unknown_flag_is_argparses_error_with_the_closest_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        parse_flags(base(tmp_path) + ["--rollout-batch-sise", "4", "--partial-rollout"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "unrecognized arguments: --rollout-batch-sise (did you mean --rollout-batch-size?)" in err
    with pytest.raises(SystemExit):                              # a stray value is not swallowed
        parse_flags(base(tmp_path) + ["stray"])
    with pytest.raises(SystemExit):                              # no abbreviations: --save-int is not --save-interval
        parse_flags(base(tmp_path) + ["--save-int", "3"])


def test_values_of_refused_flags_are_not_flags():
    assert refused_in(["--true-on-policy-mode", "--sglang-router-port", "1", "-2", "--bogus", "x"]) == (
        ["true-on-policy-mode", "sglang-router-port"], ["--bogus", "x"])
    assert fate("no-true-on-policy-mode") == fate("true-on-policy-mode") and fate("rollout-batch-size") is None


def test_a_refused_key_in_a_config_file_gets_its_fate(tmp_path):
    (tmp_path / "run.yaml").write_text("true-on-policy-mode: true\nrollout-batch-sise: 4\n")
    with pytest.raises(ConfigError) as info:
        parse_flags(base(tmp_path) + ["--config", str(tmp_path / "run.yaml")])
    text = "\n".join(info.value.problems)
    assert "--true-on-policy-mode is a miles flag this build does not take" in text
    assert "unknown key 'rollout-batch-sise'" in text


def test_the_coming_from_miles_doc_is_the_table():
    text = DOC.read_text()
    block = re.search(r"<!-- generated: python -m miles.config.flags -->\n(.*?)<!-- end generated -->",
                      text, re.S)
    assert block is not None, "docs/coming-from-miles.md lost its generated block"
    assert block.group(1) == markdown({f.name: help_text(f) for f in FLAGS}), \
        "regenerate it: python -m miles.config.flags, between the markers"


def test_running_md_names_every_flag_issue_19_implemented():
    from miles.config.flags import MILES_COMPAT_FLAGS

    text = (DOC.parent / "running.md").read_text()
    assert [f.name for f in MILES_COMPAT_FLAGS if f"--{f.name}" not in text] == []
    assert "coming-from-miles.md" in text
