"""The run flags miles' launch scripts pass, with miles' meaning: --eval-top-p / --eval-top-k, --dump-details,
--use-fault-tolerance, --attn-implementation, --disable-compute-advantages-and-returns, --wandb-key and
--megatron-to-hf-mode (what each does, and the combinations refused with a line naming the fix). Their
runs end to end: tests/integration/test_launch_script_flags_e2e.py."""

from __future__ import annotations

import os
import sys
import types

import pytest

from miles.config import ConfigError, EvalConfig, EvalDataset, RolloutConfig, as_dict
from miles.config.flags import parse_flags
from miles.phases.init import trainer_options
from miles.rollout.executor import eval_sampling_params
from miles.metrics.sinks import WandbSink
from tests.unit.test_tracking_flags import base

KEY = "0123456789abcdef0123456789abcdef01234567"


def cfg_of(tmp_path, *flags: str):
    return parse_flags(base(tmp_path) + list(flags))[0]


def problems_of(tmp_path, *flags: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_flags(base(tmp_path) + list(flags))
    return info.value.problems


# -- --eval-top-p / --eval-top-k ---------------------------------------------------------------------

def test_eval_top_p_and_top_k_are_the_eval_datasets_defaults_a_datasets_own_value_wins():
    rollout = RolloutConfig(batch_size=1, temperature=0.9, top_p=0.8, top_k=40)
    flags = EvalConfig(temperature=0.7, top_p=0.5, top_k=3)
    plain, own = EvalDataset(name="a", path="a"), EvalDataset(name="b", path="b", top_p=0.25, top_k=7)
    p = eval_sampling_params(rollout, flags, plain, seed=1)
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.7, 0.5, 3, 1)
    p = eval_sampling_params(rollout, flags, own, seed=1)
    assert (p.top_p, p.top_k) == (0.25, 7)
    # not given: the rollout's (miles: --eval-top-p, else --rollout-top-p); a greedy eval's are off
    p = eval_sampling_params(rollout, EvalConfig(), plain, seed=1)
    assert (p.temperature, p.top_p, p.top_k) == (0.9, 0.8, 40)
    p = eval_sampling_params(rollout, EvalConfig(temperature=0.0), plain, seed=1)
    assert (p.top_p, p.top_k) == (1.0, -1)


def test_eval_top_p_and_top_k_flags_land_in_the_eval_config(tmp_path):
    cfg = cfg_of(tmp_path, "--eval-top-p", "0.7", "--eval-top-k", "20")
    assert (cfg.eval.top_p, cfg.eval.top_k) == (0.7, 20)
    assert (cfg_of(tmp_path).eval.top_p, cfg_of(tmp_path).eval.top_k) == (None, None)


def test_eval_top_p_and_top_k_out_of_range_are_named(tmp_path):
    assert problems_of(tmp_path, "--eval-top-p", "0", "--eval-top-k", "0") == [
        "--eval-top-p 0.0: must be in (0, 1]", "--eval-top-k 0: must be -1 (off) or >= 1"]
    (tmp_path / "p.jsonl").write_text('{"input": "1+1="}\n')
    (tmp_path / "evals.yaml").write_text(f"eval:\n  datasets:\n    - name: a\n      path: {tmp_path / 'p.jsonl'}\n"
                                         "      top_p: 1.5\n")
    assert problems_of(tmp_path, "--eval-config", str(tmp_path / "evals.yaml")) == [
        "--eval-config dataset 'a': top_p 1.5: must be in (0, 1]"]


# -- --dump-details -------------------------------------------------------------------------------------

def test_dump_details_sets_both_dumps_as_miles_and_an_explicit_flag_wins_for_its_kind(tmp_path):
    cfg = cfg_of(tmp_path, "--dump-details", "dd")
    assert (cfg.debug_rollout_data_path, cfg.debug_train_data_path) == \
        ("dd/rollout_data/{rollout_id}.pt", "dd/train_data/{rollout_id}_{rank}.pt")
    # the trainer gets the path in its own slice, absolute (it writes from its own working directory)
    assert trainer_options(cfg)["train"].save_debug_train_data == os.path.abspath("dd/train_data/{rollout_id}_{rank}.pt")
    cfg = cfg_of(tmp_path, "--dump-details", "dd", "--save-debug-rollout-data", "r/{rollout_id}.pt")
    assert (cfg.debug_rollout_data_path, cfg.debug_train_data_path) == \
        ("r/{rollout_id}.pt", "dd/train_data/{rollout_id}_{rank}.pt")
    cfg = cfg_of(tmp_path, "--dump-details", "dd", "--save-debug-train-data", "t")
    assert (cfg.debug_rollout_data_path, cfg.debug_train_data_path) == ("dd/rollout_data/{rollout_id}.pt", "t")
    none = cfg_of(tmp_path)
    assert (none.debug_rollout_data_path, none.debug_train_data_path) == (None, None)
    assert trainer_options(none)["train"].save_debug_train_data is None


def test_dump_details_is_refused_where_its_rollouts_are_not_saved_yet(tmp_path):
    from miles.config.validate import validate
    from miles.runtime.machine import load_machine

    with pytest.raises(ConfigError, match=r"--dump-details is not supported by --machine async yet; use sync"):
        validate(cfg_of(tmp_path, "--dump-details", "dd"), machine=load_machine("async"))
    validate(cfg_of(tmp_path, "--dump-details", "dd"), machine=load_machine("sync"))


# -- --use-fault-tolerance ----------------------------------------------------------------------------

def test_use_fault_tolerance_is_this_builds_default_and_refuses_what_turns_it_off(tmp_path):
    cfg = cfg_of(tmp_path, "--use-fault-tolerance")
    assert cfg.rollout.use_fault_tolerance
    # what it asks for is on without it: restarts of dead engines and health probes
    assert cfg.rollout.engine_max_restarts > 0 and cfg.rollout.health_check_interval_s > 0
    assert cfg_of(tmp_path, "--engine-max-restarts", "0").rollout.engine_max_restarts == 0   # alone: fine
    assert problems_of(tmp_path, "--use-fault-tolerance", "--engine-max-restarts", "0",
                       "--rollout-health-check-interval", "0") == [
        "--use-fault-tolerance asks for engine health checks and restarts of dead engines, which "
        "--engine-max-restarts 0 and --rollout-health-check-interval 0 turn off: drop one side (both are on by "
        "default here)"]


# -- --attn-implementation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention"])
def test_attn_implementation_takes_miles_values_as_a_kernel_switch(tmp_path, name):
    assert cfg_of(tmp_path, "--attn-implementation", name).train.attn_implementation == name


def test_an_unknown_attn_implementation_is_an_error_naming_the_values(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        parse_flags(base(tmp_path) + ["--attn-implementation", "flash"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--attn-implementation: invalid choice: 'flash'" in err and "flash_attention_3" in err
    (tmp_path / "run.yaml").write_text("attn-implementation: flash\n")         # a config file skips argparse
    assert problems_of(tmp_path, "--config", str(tmp_path / "run.yaml")) == [
        "--attn-implementation flash: not an attention implementation miles' FSDP backend takes; use one of "
        "flash_attention_2, flash_attention_3, sdpa, eager, flex_attention (or drop it: no effect here)"]


def test_attn_implementations_help_says_what_attention_runs_here():
    from miles.config.flags import FLAGS, help_line
    text = help_line(next(f for f in FLAGS if f.name == "attn-implementation"))
    assert "no effect" in text and "SDPA" in text and "varlen" in text


# -- --disable-compute-advantages-and-returns ---------------------------------------------------------

def test_disable_compute_advantages_is_sfts_way_and_refused_with_a_loss_that_reads_them(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"input": "1+1=", "response": "2"}\n')
    cfg = cfg_of(tmp_path, "--loss-type", "sft_loss", "--disable-compute-advantages-and-returns",
                 "--n-samples-per-prompt", "1")
    assert cfg.algorithm.compute_advantages_and_returns is False
    assert cfg_of(tmp_path).algorithm.compute_advantages_and_returns is True
    assert problems_of(tmp_path, "--disable-compute-advantages-and-returns") == [
        "--disable-compute-advantages-and-returns with --loss-type policy_loss: that loss reads the advantages; "
        "miles' SFT recipe passes it, and here --loss-type sft_loss computes none already: drop the flag, or "
        "train with --loss-type sft_loss"]


# -- --wandb-key ------------------------------------------------------------------------------------------

def test_wandb_key_is_kept_out_of_every_written_config(tmp_path):
    cfg = cfg_of(tmp_path, "--wandb-key", KEY)
    assert cfg.tracking.wandb_key == KEY
    assert as_dict(cfg)["tracking"]["wandb_key"] == "<redacted>"
    assert KEY not in repr(cfg) and KEY not in str(as_dict(cfg))
    assert as_dict(cfg_of(tmp_path))["tracking"]["wandb_key"] is None


def test_wandb_sink_gives_the_key_to_this_wandb_run_only(tmp_path, monkeypatch):
    inits, logins = [], []
    fake = types.SimpleNamespace(Settings=lambda **kw: kw, login=lambda **kw: logins.append(kw),
                                 init=lambda **kw: inits.append(kw) or types.SimpleNamespace(
                                     define_metric=lambda *a, **k: None, finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = cfg_of(tmp_path, "--wandb-key", KEY)
    # as init opens it: the run config is as_dict's
    WandbSink(cfg.tracking, run_dir=tmp_path, run_id="r", run_config=as_dict(cfg)).dispose()
    WandbSink(cfg_of(tmp_path).tracking, run_dir=tmp_path, run_id="r2", run_config={}).dispose()
    assert inits[0]["settings"]["api_key"] == KEY and "api_key" not in inits[1]["settings"]
    assert KEY not in str(inits[0]["config"]) and logins == []     # no wandb.login: nothing lands in ~/.netrc


# -- --megatron-to-hf-mode ----------------------------------------------------------------------------------

def test_megatron_to_hf_mode_is_a_megatron_backend_note(tmp_path):
    for mode in ("raw", "bridge"):
        problems = [p for p in _problems_or_none(tmp_path, "--train-backend", "megatron", "--megatron-to-hf-mode", mode)
                    if "--megatron-to-hf-mode" in p]
        assert problems == []
    assert problems_of(tmp_path, "--megatron-to-hf-mode", "raw") == [
        "--megatron-to-hf-mode raw with --train-backend torch: it converts Megatron weights for the engines; the torch "
        "trainer trains the HF weights as they are: drop it"]
    (tmp_path / "run.yaml").write_text("megatron-to-hf-mode: mbridge\n")
    problems = problems_of(tmp_path, "--config", str(tmp_path / "run.yaml"))
    assert "--megatron-to-hf-mode mbridge: use raw or bridge" in problems


def _problems_or_none(tmp_path, *flags: str) -> list[str]:
    """The problems of a command line (a megatron run here may lack megatron-core or GPUs: those are others)."""
    try:
        parse_flags(base(tmp_path) + list(flags))
    except ConfigError as exc:
        return exc.problems
    return []
