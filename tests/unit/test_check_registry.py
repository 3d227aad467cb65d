"""One registry of checks, each rule once, all run by `validate` before Ray starts; config imports
nothing above it; the facts derived from a config are its properties."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

import miles
from miles.cli.train import main
from miles.config import CheckpointConfig, ConfigError, ModelConfig
from miles.config.checks import CHECKS, CONTRIBUTORS, run_checks
from miles.config.flags import BY_DEST, parse_flags
from miles.config.schema import USER_FUNCTION_FLAGS
from tests.tiny_model import make_tiny_model

CONFIG = Path(miles.__file__).parent / "config"
ABOVE_CONFIG = ("miles.rollout", "miles.training", "miles.metrics", "miles.phases", "miles.cluster", "miles.api",
                "miles.cli", "miles.checkpoint", "miles.weights", "miles.data")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    data = tmp / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", make_tiny_model(tmp / "m"), "--prompt-data", str(data), "--label-key", "label",
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1"]


def test_config_imports_nothing_above_it():
    for path in CONFIG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith(ABOVE_CONFIG)], (path.name, names)


def test_every_contributor_registers_its_checks_once(base):
    cfg, _ = parse_flags(base)
    assert run_checks(cfg) == [] and run_checks(cfg) == []        # a second run registers nothing again
    modules = {key.partition(":")[0] for key in CHECKS}
    assert set(CONTRIBUTORS) <= modules | {"miles.rollout.engines.registry"}
    assert "miles.config.validate" in modules


def test_the_trainers_rules_fail_at_parse_time_with_exit_2(base):
    # once refused inside the trainer actor, after Ray was up: now validate's, before it starts
    with pytest.raises(ConfigError) as err:
        parse_flags(base + ["--rollout-temperature", "0", "--clip-grad", "-1"])
    assert err.value.problems == [
        "--rollout-temperature 0.0: must be > 0 to train on the rollouts (greedy ones cannot be; >= 0 with "
        "--debug-rollout-only)",
        "--clip-grad -1.0: must be >= 0 (0 disables clipping)"]
    assert parse_flags(base + ["--rollout-temperature", "0", "--debug-rollout-only"])[0].rollout.temperature == 0
    run_dir = Path(base[base.index("--prompt-data") + 1]).parent / "refused-run"
    assert main(base + ["--rollout-temperature", "0", "--run-dir", str(run_dir)]) == 2
    assert not run_dir.exists()       # refused with the flags: no run dir, so no Ray, no actor


def test_each_rule_is_reported_once(base):
    with pytest.raises(ConfigError) as err:
        parse_flags(base + ["--micro-batch-size", "0", "--loss-type", "custom_loss", "--use-dynamic-batch-size",
                            "--use-tis", "--use-rollout-logprobs", "--device", "cpu"])   # no token budget: CPU only
    problems = err.value.problems
    for needle in ("--micro-batch-size 0", "--custom-loss-function-path", "--max-tokens-per-gpu",
                   "--use-rollout-logprobs"):
        assert sum(needle in p for p in problems) == 1, (needle, problems)


def test_derived_facts_are_config_properties(base):
    cfg, _ = parse_flags(base)
    assert not cfg.algorithm.needs_critic and not cfg.has_critic
    ppo = replace(cfg, algorithm=replace(cfg.algorithm, advantage_estimator="ppo"))
    assert ppo.algorithm.needs_critic and ppo.has_critic and not replace(ppo, debug_rollout_only=True).has_critic
    assert not CheckpointConfig().saves
    assert all(CheckpointConfig(**{f: "x"}).saves for f in ("save", "critic_save", "save_hf_path"))
    assert [ModelConfig(hf_checkpoint="m", device=d).uses_gpus(g) for d, g in (
        ("auto", 0), ("auto", 2), ("cpu", 2), ("cuda", 0), ("cuda:1", 0))] == [False, True, False, True, True]
    # every user-function flag is a flag, read into the field the table names
    paths = {flag: f"pkg.mod:fn_{i}" for i, flag in enumerate(USER_FUNCTION_FLAGS)}
    assert all(flag[2:].replace("-", "_") in BY_DEST for flag in USER_FUNCTION_FLAGS)
    given = replace(cfg, **{s: replace(getattr(cfg, s), **{f: paths[flag] for flag, (s2, f) in USER_FUNCTION_FLAGS.items()
                                                             if s2 == s}) for s in {s for s, _ in USER_FUNCTION_FLAGS.values()}})
    assert given.user_function_paths == paths


def _compared_names(names: set[str], root: Path, allowed: tuple[str, ...]) -> list[str]:
    """file:line of each comparison with an engine's or a backend's name (`x == "fast"`, `x in ("torch", ...)`)
    outside `allowed` (the --opd-type values, which share two of the names, are the OPD flag's own)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel.startswith(allowed):
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Compare):
                continue
            consts = [c.value for e in (node.left, *node.comparators)
                      for c in ast.walk(e) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            if set(consts) & names and "opd_type" not in ast.get_source_segment(text, node):
                found.append(f"{rel}:{node.lineno}")
    return found


def test_no_engine_or_backend_name_is_compared_outside_its_package_and_its_registry():
    from miles.rollout.engines.registry import ENGINES
    from miles.training.protocol import TRAIN_BACKENDS

    owners = ("miles/rollout/engines/", "miles/training/megatron/", "miles/training/protocol.py")
    assert _compared_names(set(ENGINES) | set(TRAIN_BACKENDS), CONFIG.parent, owners) == []


@pytest.mark.parametrize("extra, line", [
    (["--rollout-temperature", "-0.5"], "--rollout-temperature -0.5: must be > 0 to train on the rollouts"),
    (["--rollout-temperature", "-0.5", "--debug-rollout-only"], "--rollout-temperature -0.5: must be >= 0 (0: greedy)"),
    (["--rollout-top-p", "1.5"], "--rollout-top-p 1.5: must be in (0, 1]"),
    (["--eval-top-p", "0"], "--eval-top-p 0.0: must be in (0, 1]"),
    (["--eval-temperature", "-1"], "--eval-temperature -1.0: must be >= 0 (0: greedy)"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"], "--max-tokens-per-gpu 0: must be a positive integer"),
    (["--rollout-mem-fraction", "1.5"], "--rollout-mem-fraction 1.5: must be in (0, 1)"),
    (["--rollout-max-batch-size", "0"], "--rollout-max-batch-size 0: must be a positive integer"),
    (["--rollout-chunked-prefill-size", "0"], "--rollout-chunked-prefill-size 0: must be a positive integer"),
])
def test_a_sampling_engine_or_token_budget_rule_fires_once_with_one_message_naming_the_flag(base, extra, line):
    with pytest.raises(ConfigError) as err:
        parse_flags(base + extra)
    flag = line.split()[0]
    assert [p for p in err.value.problems if flag in p] == [p for p in err.value.problems if p.startswith(line)]
    assert len([p for p in err.value.problems if p.startswith(line)]) == 1, err.value.problems


def test_the_engines_and_trainers_rely_on_the_parsed_config_for_the_rules_stated_once():
    """The math takes any temperature the config let through; the token-budget groupers any budget; the
    pad id is one function; the embedded engine checks a call's params with the one sampling rule."""
    import torch

    from miles.algorithms.entropy import entropy_from_logits
    from miles.training.torch.microbatch import token_budget_groups
    from miles.training.packing import pack_groups
    from miles.types import SamplingParams, sampling_problems
    from miles.weights.hf import pad_id
    from miles.rollout.engines.embedded.engine import _param_problems

    assert entropy_from_logits(torch.zeros(1, 2, 3), 0.5).shape == (1, 2)
    assert token_budget_groups([3, 2], 4) == [[0], [1]] and pack_groups([3, 1], 4) == [[0, 1]]

    class Tok:
        eos_token_id, pad_token_id = 7, None
    assert pad_id(Tok()) == 7
    Tok.pad_token_id = 0
    assert pad_id(Tok()) == 0
    bad = SamplingParams(temperature=-1.0, top_p=2.0)
    assert _param_problems(bad) == sampling_problems(temperature=-1.0, top_p=2.0) == [
        "temperature -1.0: must be >= 0 (0: greedy)", "top_p 2.0: must be in (0, 1]"]


def test_checks_that_wait_for_a_later_fact_run_with_it_and_only_with_it(base):
    """validate_for_machine, check_debug_flags and check_engines are registry checks now: each names the
    fact it waits for (the machine, the engine count) and runs through the one entry point, `validate`."""
    from miles.config.checks import NEEDS
    from miles.config.validate import validate
    from miles.runtime.machine import load_machine

    run_checks(parse_flags(base)[0])            # loads the contributors
    assert {key.rpartition(":")[2]: needs for key, needs in NEEDS.items() if needs} == {
        "_machine": {"machine"}, "_debug_flags": {"machine"}, "_partial_rollout_engines": {"num_engines"}}
    cfg = parse_flags(base + ["--debug-rollout-only"])[0]     # parses: the machine is not known yet
    with pytest.raises(ConfigError) as err:
        validate(cfg, machine=load_machine("sync"))
    assert err.value.problems == ["--debug-rollout-only runs on --machine rollout_only, not 'sync' (miles train "
                                  "picks it when --machine is not given)"]
    validate(cfg, machine=load_machine("rollout_only"))
    validate(cfg, num_engines=1)                # no --partial-rollout


@pytest.mark.parametrize("extra, flag, line", [
    (["--lora-rank", "8", "--train-backend", "megatron"], "--lora-rank",
     "--lora-rank 8 with --train-backend megatron: LoRA trains on the torch trainer here; use --train-backend torch"),
    (["--lora-rank", "8", "--actor-num-gpus-per-node", "2", "--device", "cpu"], "--lora-rank",
     "--lora-rank 8 with --train-backend torch on 2 trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node): "
     "the torch trainer's FSDP ranks do not shard adapters yet; train on one GPU (1 x 1)"),
    (["--skip-actor-forward-only", "--use-rollout-logprobs", "--train-backend", "megatron"], "--skip-actor-forward-only",
     "--skip-actor-forward-only with --train-backend megatron: not supported yet (it always computes the old logprobs); "
     "use --train-backend torch or drop it"),
    (["--megatron-to-hf-mode", "bridge"], "--megatron-to-hf-mode",
     "--megatron-to-hf-mode bridge with --train-backend torch: it converts Megatron weights for the engines; the torch "
     "trainer trains the HF weights as they are: drop it"),
])
def test_a_backend_refusal_on_its_spec_fires_once_with_one_message(base, extra, flag, line):
    """What a backend refuses is on its spec (`TrainBackendSpec.refuses`); the one shared check says it, once."""
    with pytest.raises(ConfigError) as err:
        parse_flags(base + extra)
    assert [p for p in err.value.problems if p.startswith(flag)] == [line], err.value.problems
