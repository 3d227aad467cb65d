"""--rollout-engine sglang's flags: miles' own, and --sglang-<flag> passed through to SGLang's server."""

from __future__ import annotations

import pytest

from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.config.validate import validate
from miles.runtime import load_machine


@pytest.fixture
def base(tmp_path):
    from tests.tiny_model import make_tiny_model

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "1+1=", "label": "2"}\n' * 4)
    model = make_tiny_model(tmp_path / "m")
    return ["--hf-checkpoint", model, "--prompt-data", str(prompts), "--rollout-batch-size", "2", "--num-rollout", "1",
            "--n-samples-per-prompt", "8"]


def test_sglang_flags_pass_through_as_sglang_spells_them(base):
    cfg, _ = parse_flags([*base, "--rollout-engine", "sglang", "--rollout-num-gpus-per-engine", "2",
                          "--sglang-mem-fraction-static", "0.5", "--sglang-disable-radix-cache",
                          "--sglang-cuda-graph-bs", "1", "2", "--sglang-chunked-prefill-size=4096",
                          "--sglang-router-policy", "round_robin", "--offload-rollout"])
    assert cfg.sglang.server_args == ("--mem-fraction-static", "0.5", "--disable-radix-cache", "--cuda-graph-bs",
                                      "1", "2", "--chunked-prefill-size", "4096")
    assert cfg.sglang.router_policy == "round_robin"        # miles' own --sglang-* flags are not passed through
    assert cfg.cluster.rollout_num_gpus_per_engine == 2 and cfg.cluster.offload_rollout   # one field for every engine


def test_a_config_file_passes_sglang_flags_and_the_command_line_overrides_them(base, tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout-engine: sglang\nsglang-mem-fraction-static: 0.4\nsglang-enable-metrics: true\n"
                 "sglang-log-requests: false\n")
    cfg, _ = parse_flags([*base, "--config", str(f), "--sglang-mem-fraction-static", "0.6"])
    assert cfg.sglang.server_args == ("--mem-fraction-static", "0.6", "--enable-metrics")


@pytest.mark.parametrize("flags, message", [
    (["--sglang-port", "1"], "--sglang-port is set by miles itself"),
    (["--sglang-tp-size", "2"], "--sglang-tp-size is set by miles itself"),
    (["--sglang-router-policy", "fastest"], "invalid choice"),
])
def test_flags_miles_sets_itself_are_refused(base, flags, message, capsys):
    with pytest.raises((ConfigError, SystemExit)) as info:
        parse_flags([*base, "--rollout-engine", "sglang", *flags])
    assert message in (str(info.value) + capsys.readouterr().err)


def test_sglang_flags_without_the_sglang_engine_are_named(base):
    with pytest.raises(ConfigError) as info:
        parse_flags([*base, "--sglang-mem-fraction-static", "0.5", "--rollout-num-gpus-per-engine", "2",
                     "--offload-rollout"])
    assert info.value.problems == [
        "--sglang-<flag> pass-through (--mem-fraction-static 0.5): only the SGLang engine reads it; add "
        "--rollout-engine sglang or drop it",
        "--rollout-num-gpus-per-engine 2: the embedded and fast engines run on one GPU each (no tensor parallelism); "
        "use 1 and more engines, or --rollout-engine sglang"]       # --offload-rollout is every engine's


def test_a_health_probe_timeout_no_sglang_server_can_meet_is_refused(base):
    sglang = [*base, "--rollout-engine", "sglang", "--rollout-health-check-timeout", "1.5"]
    with pytest.raises(ConfigError) as info:
        parse_flags(sglang)
    assert info.value.problems == [
        "--rollout-health-check-timeout 1.5: an SGLang server answers /health_generate a second after it is asked "
        "at the earliest; give the probe at least 2 s (default 30), or --rollout-health-check-interval 0"]
    parse_flags([*sglang, "--rollout-health-check-interval", "0"])           # no probe: nothing to meet
    parse_flags([*base, "--rollout-health-check-timeout", "1.5"])            # the embedded engine answers at once


def test_an_unknown_flag_is_still_an_error(base, capsys):
    with pytest.raises(SystemExit) as info:
        parse_flags([*base, "--rollout-engine", "sglang", "--sglang-mem-fraction-static", "0.5", "--bogus", "1"])
    assert info.value.code == 2 and "unrecognized arguments: --bogus, 1" in capsys.readouterr().err


def test_offload_rollout_is_refused_by_the_async_machine(base):
    cfg, _ = parse_flags([*base, "--rollout-engine", "sglang", "--offload-rollout", "--use-tis"])
    with pytest.raises(ConfigError, match="--offload-rollout cannot be used with the async machine"):
        validate(cfg, machine=load_machine("async"))
    validate(cfg, machine=load_machine("sync"))


def test_tensor_parallel_engines_get_their_gpus_in_one_bundle_and_too_many_is_an_error(base):
    # the run's placement (init.py `_place`) checks the plan against the cluster before any engine starts
    from miles.cluster.placement import Placement, check_cluster, placement_request, plan_placement

    cfg, _ = parse_flags([*base, "--rollout-engine", "sglang", "--rollout-num-engines", "3",
                          "--rollout-num-gpus-per-engine", "2", "--device", "cuda"])
    plan = plan_placement(placement_request(cfg, use_gpus=True))
    assert plan.bundle_gpus == (1, 2, 2, 2) and plan.engines[0] == Placement(1, 2.0)   # a TP=2 server sees 2 GPUs
    with pytest.raises(ConfigError, match=r"the run needs 7 GPU\(s\).*has 4"):
        check_cluster(plan, 4.0)
