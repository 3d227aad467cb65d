"""miles' training shortcuts: --debug-skip-weight-update (the weight_sync state pushes nothing and says
so), --skip-actor-forward-only (no old-logprob pass), --use-dynamic-global-batch-size (one step per
rollout, whatever its size); each with the start-up refusals of what cannot be right."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from miles.config import AlgorithmConfig, ClusterConfig, TrainConfig
from miles.config.flags import parse_flags
from miles.phases.weights import sync_weights
from tests.unit.test_trainer import SAMPLES
from tests.unit.test_trainer_gpu_paths import model_path, trainer  # noqa: F401  (model_path: a fixture)
from tests.unit.test_validate_algorithms import base, problems  # noqa: F401  (base: a fixture)

ALG = dict(loss_agg_mode="token_mean", kl_loss_type="k3")
DYNAMIC = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"]


# -- --debug-skip-weight-update ------------------------------------------------------------------------

class Untouchable:
    """An engine handle that fails the test if the phase calls anything on it."""

    def __getattr__(self, name):
        raise AssertionError(f"the skipped sync called engine.{name}")


class Tracer:
    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append((event, fields))


def test_the_skipped_sync_pushes_nothing_and_says_why():
    ctx = SimpleNamespace(cfg=SimpleNamespace(debug_skip_weight_update=True, cluster=ClusterConfig()),
                          next_rollout=3, weight_version=0, engines_released=(), tracer=Tracer(),
                          c=SimpleNamespace(placement=None, trainer=Untouchable(), ipc_weights=None,
                                            engines=[SimpleNamespace(handle=Untouchable())]))
    assert asyncio.run(sync_weights(ctx)) == "next"
    assert ctx.tracer.events == [("weights_sync_skipped", {"version": 3, "engines_hold": 0,
                                                            "reason": "--debug-skip-weight-update"})]
    assert ctx.weight_version == 0                       # the engines still hold the initial weights


@pytest.mark.parametrize("flags, message", [
    (["--check-weight-update-equal"], "--check-weight-update-equal compare(s) with the trainer's"),
    (["--ci-test"], "--ci-test compare(s) with the trainer's"),
    (["--rollout-engine", "sglang", "--offload-rollout"], "only a weight sync gives them back"),
])
def test_skip_weight_update_refuses_what_compares_or_drops_engine_weights(base, flags, message):
    assert message in problems(base + ["--debug-skip-weight-update"] + flags)


def test_skip_weight_update_alone_is_taken(base):
    cfg, _ = parse_flags(base + ["--debug-skip-weight-update"])
    assert cfg.debug_skip_weight_update and not cfg.check_weights


# -- --skip-actor-forward-only -----------------------------------------------------------------------------

def weights_after(t) -> tuple[dict, dict[str, torch.Tensor]]:
    metrics = t.train(SAMPLES, rollout_id=0)
    return metrics, {n: p.detach().clone() for n, p in t.model.named_parameters()}


def test_with_the_engines_logprobs_several_steps_train_as_with_the_pass(model_path):
    # 4 samples, global batch 2: two steps, whose old logprobs are the engine's either way
    m_pass, w_pass = weights_after(trainer(model_path, global_batch_size=2,
                                           algorithm=AlgorithmConfig(**ALG, use_rollout_logprobs=True)))
    m_skip, w_skip = weights_after(trainer(model_path, global_batch_size=2, algorithm=AlgorithmConfig(
        **ALG, use_rollout_logprobs=True, skip_actor_forward_only=True)))
    assert (m_pass["logprob_passes"], m_skip["logprob_passes"]) == (1.0, 0.0)
    assert m_skip["num_steps"] == 2
    assert m_skip["pg_loss"] == pytest.approx(m_pass["pg_loss"], abs=1e-6)
    assert "logprob_diff_rollout" in m_skip              # from the steps' own logprobs
    for n in w_pass:
        torch.testing.assert_close(w_skip[n], w_pass[n], atol=1e-6, rtol=1e-5)


def test_without_them_one_step_uses_its_own_and_several_fail(model_path):
    # skip_old_logprobs=False: the trainer would keep the pass; the flag skips it anyway
    m_pass, w_pass = weights_after(trainer(model_path, algorithm=AlgorithmConfig(**ALG)))
    m_skip, w_skip = weights_after(trainer(model_path, algorithm=AlgorithmConfig(**ALG, skip_actor_forward_only=True)))
    assert (m_pass["logprob_passes"], m_skip["logprob_passes"]) == (1.0, 0.0)
    for n in w_pass:
        torch.testing.assert_close(w_skip[n], w_pass[n], atol=1e-6, rtol=1e-5)
    several = trainer(model_path, global_batch_size=2, algorithm=AlgorithmConfig(**ALG, skip_actor_forward_only=True))
    with pytest.raises(ValueError, match="add --use-rollout-logprobs"):
        several.train(SAMPLES, 0)


@pytest.mark.parametrize("flags, message", [
    (["--global-batch-size", "1"], "right only for one optimizer step per rollout, not 2"),
    (["--use-tis"], "--use-tis read(s) the trainer's logprobs before the first step"),
    (["--loss-type", "sft_loss", "--n-samples-per-prompt", "1"], "--loss-type sft_loss has none"),
    (["--train-backend", "megatron"], "not supported by --train-backend megatron"),
])
def test_skip_actor_forward_only_refuses_what_needs_the_pass(base, flags, message):
    assert message in problems(base + ["--skip-actor-forward-only"] + flags)


def test_skip_actor_forward_only_takes_several_steps_with_the_engines_logprobs(base):
    cfg, _ = parse_flags(base + ["--skip-actor-forward-only", "--use-rollout-logprobs", "--global-batch-size", "1"])
    assert cfg.algorithm.skip_actor_forward_only and cfg.train.global_batch(2) == 1


# -- --use-dynamic-global-batch-size -----------------------------------------------------------------------

def test_the_dynamic_global_batch_is_the_whole_rollout_whatever_its_size():
    t = TrainConfig(use_dynamic_global_batch_size=True, global_batch_size=4, use_dynamic_batch_size=True)
    assert [t.global_batch(n) for n in (3, 8, 13)] == [3, 8, 13]
    assert TrainConfig(global_batch_size=4).global_batch(8) == 4


def test_the_trainer_makes_one_step_of_the_rollout(model_path):
    dynamic = trainer(model_path, global_batch_size=2, use_dynamic_global_batch_size=True,
                      use_dynamic_batch_size=True, max_tokens_per_gpu=64)
    assert dynamic.train(SAMPLES, 0)["num_steps"] == 1
    assert trainer(model_path, global_batch_size=2).train(SAMPLES, 0)["num_steps"] == 2


def test_dynamic_global_batch_ignores_a_global_batch_size_that_does_not_divide_the_rollout(base):
    # 1 x 2 samples a rollout: --global-batch-size 3 is refused, and taken (then unused) with the flag
    assert "--global-batch-size 3 does not divide" in problems(base + ["--global-batch-size", "3"])
    cfg, _ = parse_flags(base + ["--global-batch-size", "3", "--use-dynamic-global-batch-size"] + DYNAMIC)
    assert cfg.train.global_batch(2) == 2


@pytest.mark.parametrize("flags, message", [
    ([], "needs --use-dynamic-batch-size"),
    (["--num-steps-per-rollout", "2"] + DYNAMIC, "drop --num-steps-per-rollout 2"),
])
def test_dynamic_global_batch_refusals(base, flags, message):
    assert message in problems(base + ["--use-dynamic-global-batch-size"] + flags)
