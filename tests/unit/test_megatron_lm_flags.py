"""Every flag of Megatron-LM's parser has a fate here, never a bare argparse error.

tests/data/megatron_lm_flags.txt is a snapshot of every option string of Megatron-LM's
megatron/training/arguments.py (the commit is in its header), with Megatron-LM's kind of each:
one value, a switch, several values (nargs) or --NAME/--no-NAME. Each goes through the parser as a
launch script would pass it, followed by another flag with a negative value: the flag is implemented,
checked, accepted or refused with its line, and its values are its own (the next flag still parses).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.config import megatron_lm
from miles.config.flags import FLAGS, build_parser, parse_flags
from miles.config.megatron_flags import ACCEPTED, CHECKED, LM_ACCEPTED, REQUIRED, SETS, megatron_options
from miles.config.miles_flags import MEGATRON_REFUSED, REFUSED, fate
from miles.training.schedule import lr_at
from tests.unit.test_tracking_flags import base

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "megatron_lm_flags.txt"
IMPLEMENTED = {f.name for f in FLAGS}
SENTINEL = ["--rollout-temperature", "-1"]      # parsed after each flag: validation names it, so it was not eaten


def snapshot() -> dict[str, str]:
    rows = [line.split() for line in SNAPSHOT.read_text().splitlines() if line and not line.startswith("#")]
    return {name: kind for name, kind, _group in rows}


def test_the_snapshot_is_megatron_lms_whole_list():
    flags = snapshot()
    assert len(flags) > 550 and {"num-workers", "log-interval", "init-method-std", "tokenizer-type", "eval-iters",
                                 "use-distributed-optimizer", "lr-wsd-decay-iters", "data-path"} <= set(flags)
    assert set(flags.values()) == {"value", "switch", "list", "optional"}


def test_the_table_has_each_flag_of_the_snapshot_with_megatron_lms_kind():
    known, flags = megatron_lm.kinds(), snapshot()
    assert [n for n in flags if n not in known] == []
    assert {n: (k, known[n]) for n, k in flags.items() if known[n] != k} == {}


def test_each_family_of_the_table_is_one_fate():
    groups = [megatron_lm.IMPLEMENTED, megatron_lm.SCRIPTS, megatron_lm.SCRIPTS_REFUSED, megatron_lm.REFUSED_KINDS,
              dict(megatron_lm.ALIASES), *(g.flags for g in megatron_lm.ACCEPTED.values()),
              *(g.flags for g in megatron_lm.FAMILIES.values())]
    seen: dict[str, int] = {}
    for names in groups:
        for name in names:
            seen[name] = seen.get(name, 0) + 1
    assert [n for n, count in seen.items() if count > 1] == []
    # the families kept elsewhere are where the table says
    assert [n for n in megatron_lm.IMPLEMENTED if n not in IMPLEMENTED] == []
    scripts = {**CHECKED, **REQUIRED, **ACCEPTED, **SETS}
    assert [n for n in megatron_lm.SCRIPTS if n not in scripts] == []
    assert [n for n in megatron_lm.SCRIPTS_REFUSED if n not in {**MEGATRON_REFUSED, **REFUSED}] == []
    # the accepted and refused ones are not also implemented here
    # a refused family's prefix takes in no flag of this build's
    prefixes = tuple(p for g in megatron_lm.FAMILIES.values() for p in g.prefixes)
    assert [n for n in IMPLEMENTED | set(megatron_options()) if n.startswith(prefixes)] == []
    taken = set(LM_ACCEPTED) | set(megatron_lm.REFUSED_LINES) | {n for g in megatron_lm.FAMILIES.values() for n in g.flags}
    assert sorted(taken & IMPLEMENTED) == []


ONE_VALUE = {"moe-router-load-balancing-type": "seq_aux_loss", "moe-aux-loss-coeff": "-3", "moe-router-dtype": "fp32"}


def forms(name: str, kind: str) -> list[list[str]]:
    if kind == "switch":
        return [[f"--{name}"]]
    if kind == "optional":
        return [[f"--{name}"], [f"--no-{name}"]]
    if name in ONE_VALUE:     # implemented with one value here (Megatron-LM: a list of one per type; fp32 or fp64)
        return [[f"--{name}", ONE_VALUE[name]]]
    if kind == "list":
        return [[f"--{name}", "a", "-2"]]
    value = {"lr-decay-style": "cosine", "lr-wsd-decay-style": "linear", "weight-decay-incr-style": "linear"}.get(name, "-3")   # a choice, or a negative
    return [[f"--{name}", value]]


def test_every_megatron_lm_flag_parses_to_a_fate_and_keeps_to_its_values(tmp_path):
    argv0 = base(tmp_path)
    wrong = []
    for name, kind in snapshot().items():
        for form in forms(name, kind):
            try:       # a bare argparse error (SystemExit) fails the test
                parse_flags(argv0 + form + SENTINEL)
                problems = []
            except ConfigError as exc:
                problems = exc.problems
            if not any(p.startswith("--rollout-temperature -1") for p in problems):
                wrong.append((form, "the next flag was swallowed", problems))
            given = form[0].partition("=")[0]
            refused = [p for p in problems if p.startswith(given + " ") and "this build does not take" in p]
            should_refuse = name not in IMPLEMENTED and name not in megatron_options()
            if should_refuse != bool(refused) or (should_refuse and fate(given[2:]) is None):
                wrong.append((form, "refused" if refused else "not refused", problems))
    assert wrong == []


def test_a_refused_switch_takes_no_value_and_a_refused_value_flag_takes_its_own(tmp_path):
    with pytest.raises(SystemExit):      # --mock-data is a switch: "stray" is nobody's value
        parse_flags(base(tmp_path) + ["--mock-data", "stray"])
    with pytest.raises(ConfigError) as info:
        parse_flags(base(tmp_path) + ["--retro-attention-gate=-0.5", "--split", "-1", "--mock-data"])
    assert [p.split(" are ")[0].split(" is ")[0] for p in info.value.problems] == [
        "--retro-attention-gate", "--split, --mock-data"]      # one line for a family's flags
    with pytest.raises(ConfigError) as info:
        parse_flags(base(tmp_path) + ["--data-path", "0.5", "a", "-0.5", "b", "--eval-iters", "-7", "--lr", "2e-6"])
    problems = info.value.problems
    assert len(problems) == 2 and problems[0].startswith("--data-path is a miles flag this build does not take: "
                                                         "pretraining data: Megatron-LM's pretraining data; here")
    assert problems[1].startswith("--eval-iters is a miles flag this build does not take: validation loss:")


def test_accepted_flags_take_megatron_lms_values_and_change_nothing(tmp_path):
    plain, _ = parse_flags(base(tmp_path))
    cfg, _ = parse_flags(base(tmp_path) + [
        "--num-workers", "8", "--log-interval", "1", "--init-method-std", "-0.02", "--use-cpu-initialization",
        "--cp-comm-type", "p2p", "a2a", "--hierarchical-context-parallel-sizes", "2", "4", "--num-workers", "-1",
        "--no-one-logger", "--override-opt-param-scheduler", "--ckpt-fully-parallel-load", "--lr", "3e-6"])
    assert cfg.train == dataclasses.replace(plain.train, lr=3e-6)
    assert (cfg.checkpoint, cfg.tracking, cfg.data) == (plain.checkpoint, plain.tracking, plain.data)


def test_megatron_lms_other_names_set_this_builds_flags(tmp_path):
    cfg, _ = parse_flags(base(tmp_path) + ["--save", str(tmp_path / "ckpt"), "--persistent-save-interval", "7",
                                           "--wandb-entity", "team", "--wandb-save-dir", str(tmp_path / "wb")])
    assert (cfg.checkpoint.save_interval, cfg.tracking.wandb_team, cfg.tracking.wandb_dir) == \
        (7, "team", str(tmp_path / "wb"))
    (tmp_path / "run.yaml").write_text("persistent-save-interval: 9\n")
    cfg, _ = parse_flags(base(tmp_path) + ["--save", str(tmp_path / "ckpt"), "--config", str(tmp_path / "run.yaml")])
    assert cfg.checkpoint.save_interval == 9


def test_one_value_flags_and_rope_type_are_checked(tmp_path):
    argv = base(tmp_path)
    parse_flags(argv + ["--tokenizer-type", "HuggingFaceTokenizer", "--weight-decay-incr-style", "constant",
                        "--rope-type", "rope"])
    with pytest.raises(ConfigError) as info:
        parse_flags(argv + ["--tokenizer-type", "GPT2BPETokenizer", "--rope-type", "yarn"])
    problems = "\n".join(info.value.problems)
    assert "--tokenizer-type GPT2BPETokenizer: Megatron-LM's tokenizer kind" in problems
    assert "here only HuggingFaceTokenizer" in problems
    assert "--rope-type yarn differs from --hf-checkpoint's config.json (rope_scaling.rope_type yarn, else rope: rope)" \
        in problems


def test_help_lists_the_accepted_flags_with_their_note():
    text = " ".join(build_parser().format_help().split())
    assert "--num-workers VALUE accepted: tunes Megatron-LM's pretraining data loader" in text
    assert "--cp-comm-type [VALUE ...] accepted: how context-parallel ranks exchange keys and values" in text
    assert "--persistent-save-interval N Megatron-LM's name of --save-interval: the same" in text


# -- --lr-decay-style: Megatron-LM's choices ------------------------------------------------------------

def megatron_scheduler(style: str, **kw):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Opt:      # the scheduler only writes each group's lr
        param_groups = [{}]
    return OptimizerParamScheduler(Opt(), init_lr=kw.get("init", 0.0), max_lr=1e-3, min_lr=1e-5,
                                   lr_warmup_steps=kw.get("warmup", 0), lr_decay_steps=kw["decay"], lr_decay_style=style,
                                   start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
                                   wsd_decay_steps=kw.get("wsd"), lr_wsd_decay_style=kw.get("wsd_style"))


@pytest.mark.parametrize("style,wsd_style", [("WSD", "exponential"), ("WSD", "linear"), ("WSD", "cosine"),
                                             ("WSD", "minus_sqrt"), ("inverse-square-root", None),
                                             ("cosine", None), ("linear", None)])
def test_decay_styles_are_megatron_lms_after_warmup(style, wsd_style):
    pytest.importorskip("megatron.core")        # imported by the suite's megatron tests already
    warmup, decay, wsd = 4, 40, 12
    sched = megatron_scheduler(style, warmup=warmup, decay=decay, wsd=wsd, wsd_style=wsd_style, init=1e-4)
    ours = [lr_at(s, lr=1e-3, min_lr=1e-5, warmup_iters=warmup, decay_iters=decay, style=style, warmup_init=1e-4,
                  wsd_decay_iters=wsd, wsd_style=wsd_style or "exponential") for s in range(decay + 5)]
    theirs = []
    for step in range(decay + 5):
        sched.num_steps = step
        theirs.append(sched.get_lr({}))
    # after warmup step s is Megatron-LM's num_steps s; warmup reaches its end one step earlier (step 0 is not wasted)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=1e-12)
    assert ours[:warmup] == pytest.approx(theirs[1:warmup + 1], rel=1e-12)


def test_wsd_is_flat_then_decays_over_its_last_steps():
    lrs = [lr_at(s, lr=1.0, min_lr=0.0, warmup_iters=2, decay_iters=20, style="WSD", wsd_decay_iters=5,
                 wsd_style="linear") for s in range(23)]
    assert lrs[2:16] == [1.0] * 14 and lrs[16:21] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0]) and lrs[21:] == [0, 0]
    # halfway through the decay phase (r = 1/2), by Megatron-LM's formulas
    half = {style: lr_at(18, lr=1.0, min_lr=0.0, decay_iters=20, style="WSD", wsd_decay_iters=4, wsd_style=style)
            for style in ("exponential", "cosine", "minus_sqrt")}
    assert half == pytest.approx({"exponential": 2 * 0.5 ** 0.5 - 1, "cosine": 0.5, "minus_sqrt": 1 - 0.5 ** 0.5})
    assert math.isclose(lr_at(100, lr=1.0, warmup_iters=4, style="inverse-square-root"), 0.2)
    assert lr_at(101, lr=1.0, min_lr=0.01, warmup_iters=4, decay_iters=100, style="inverse-square-root") == 0.01


def test_decay_iters_default_to_the_runs_steps_and_a_warmup_fraction_sets_the_warmup(tmp_path):
    # miles' SFT script: "--lr-decay-style cosine --min-lr 1e-6 --lr-warmup-fraction 0.1", no --lr-decay-iters
    common = base(tmp_path) + ["--num-rollout", "10", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                               "--lr", "1e-5", "--min-lr", "1e-6", "--lr-decay-style", "cosine"]
    run = common + ["--global-batch-size", "4"]
    cfg, _ = parse_flags(run + ["--lr-warmup-fraction", "0.1"])
    assert (cfg.train.lr_decay_iters, cfg.train.warmup_steps) == (20, 2)      # 10 rollouts x 8 / 4 samples a step
    cfg, _ = parse_flags(common + ["--num-steps-per-rollout", "4", "--lr-warmup-fraction", "0.25"])
    assert (cfg.train.lr_decay_iters, cfg.train.warmup_steps) == (40, 10)
    cfg, _ = parse_flags(common + ["--lr-warmup-fraction", "0.15"])                # one step a rollout
    assert (cfg.train.lr_decay_iters, cfg.train.warmup_steps) == (10, 1)
    cfg, _ = parse_flags(run + ["--lr-decay-iters", "50", "--lr-warmup-fraction", "0.1"])
    assert (cfg.train.lr_decay_iters, cfg.train.warmup_steps) == (50, 5)
    cfg, _ = parse_flags(base(tmp_path))                                          # constant: nothing derived
    assert (cfg.train.lr_decay_iters, cfg.train.warmup_steps) == (None, 0)
    # a config built in code (an embedding program) gets the same warmup: the schedule reads warmup_steps
    from miles.config import TrainConfig
    from miles.training.schedule import lr_schedule
    lr = lr_schedule(TrainConfig(lr=1.0, lr_warmup_fraction=0.5, lr_decay_iters=4, lr_decay_style="linear"))
    assert [lr(s) for s in range(4)] == pytest.approx([0.5, 1.0, 1.0, 0.5])
    for extra, problem in (
            (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"],
             "--lr-warmup-fraction 0.1 and --lr-warmup-iters 3: give one of them"),
            (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction 1.5: must be in [0, 1]")):
        with pytest.raises(ConfigError) as info:
            parse_flags(run + extra)
        assert any(p.startswith(problem) for p in info.value.problems), info.value.problems
    pairs = list(zip(run[::2], run[1::2]))
    by_epoch = [a for flag, value in pairs if flag != "--num-rollout" for a in (flag, value)] + ["--num-epoch", "2"]
    with pytest.raises(ConfigError) as info:
        parse_flags(by_epoch + ["--lr-warmup-fraction", "0.1"])
    assert any("--lr-warmup-fraction 0.1 needs --lr-decay-iters N, or --num-rollout" in p for p in info.value.problems)


def test_wsd_flags_parse_and_are_checked(tmp_path):
    argv = base(tmp_path) + ["--lr-decay-style", "WSD", "--lr-decay-iters", "100", "--lr-warmup-iters", "10"]
    with pytest.raises(ConfigError) as info:
        parse_flags(argv)
    assert info.value.problems == ["--lr-decay-style WSD needs --lr-wsd-decay-iters N: the decay phase's optimizer "
                                   "steps, 1..--lr-decay-iters 100; got None"]
    cfg, _ = parse_flags(argv + ["--lr-wsd-decay-iters", "20", "--lr-wsd-decay-style", "minus_sqrt",
                                 "--lr-warmup-init", "1e-7"])
    assert (cfg.train.lr_decay_style, cfg.train.lr_wsd_decay_iters, cfg.train.lr_wsd_decay_style,
            cfg.train.lr_warmup_init) == ("WSD", 20, "minus_sqrt", 1e-7)
    cfg, _ = parse_flags(base(tmp_path) + ["--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "10"])
    assert cfg.train.lr_decay_style == "inverse-square-root"     # no --lr-decay-iters needed


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_the_weight_decay_schedule_is_megatron_lms(style):
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from miles.training.schedule import wd_at

    class Opt:
        param_groups = [{}]
    start, end = (0.01, 0.1) if style != "constant" else (0.1, 0.1)
    sched = OptimizerParamScheduler(Opt(), init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0,
                                    lr_decay_steps=10, lr_decay_style="constant", start_wd=start, end_wd=end,
                                    wd_incr_steps=20, wd_incr_style=style)
    theirs = []
    for step in range(25):
        sched.num_steps = step
        theirs.append(sched.get_wd())
    ours = [wd_at(s, start=start, end=end, incr_iters=20, style=style) for s in range(25)]
    assert ours == pytest.approx(theirs, rel=1e-12)


def test_the_weight_decay_and_decoupled_rate_flags_parse_and_are_checked(tmp_path):
    # miles' launch scripts pass --weight-decay-incr-style constant; linear/cosine run over the run's steps
    run = base(tmp_path) + ["--num-rollout", "10", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                            "--global-batch-size", "4"]
    cfg, _ = parse_flags(run + ["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.01",
                                "--end-weight-decay", "0.1", "--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-5"])
    t = cfg.train
    assert (t.weight_decay_incr_style, t.start_weight_decay, t.end_weight_decay, t.lr_decay_iters) == \
        ("cosine", 0.01, 0.1, 20)         # 10 rollouts x 8 samples / 4 a step: Megatron-LM's --train-iters
    assert (t.decoupled_lr, t.decoupled_min_lr) == (1e-4, 1e-5)
    for extra, problem in (
            (["--start-weight-decay", "0.1"], "--start-weight-decay need --weight-decay-incr-style linear or cosine"),
            (["--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"],
             "--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"),
            (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.2", "--end-weight-decay", "0.1"],
             "--start-weight-decay 0.2 / --end-weight-decay 0.1: need 0 <= start <= end"),
            (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr 1e-05 has no effect without --decoupled-lr"),
            (["--decoupled-lr", "1e-5", "--min-lr", "1e-4", "--lr", "1e-3"],
             "--decoupled-lr 1e-05 / --decoupled-min-lr 0.0001: need 0 <= decoupled-min-lr <= decoupled-lr"),
            (["--decoupled-lr", "1e-5", "--advantage-estimator", "ppo"], "--decoupled-lr: the critic"),
            (["--decoupled-lr", "1e-5", "--actor-num-gpus-per-node", "2"],
             "--decoupled-lr 1e-05 with --train-backend torch on 2 trainer ranks (--actor-num-nodes x "
             "--actor-num-gpus-per-node): not supported yet on the torch trainer's FSDP ranks")):
        with pytest.raises(ConfigError) as info:
            parse_flags(run + extra)
        assert any(p.startswith(problem) for p in info.value.problems), info.value.problems
    by_epoch = [a for flag, value in zip(run[::2], run[1::2]) if flag != "--num-rollout" for a in (flag, value)]
    with pytest.raises(ConfigError) as info:       # no --num-rollout: the schedule has no length
        parse_flags(by_epoch + ["--num-epoch", "1", "--weight-decay-incr-style", "linear",
                                "--start-weight-decay", "0", "--end-weight-decay", "0.1"])
    assert any("runs over --lr-decay-iters optimizer steps" in p for p in info.value.problems), info.value.problems
