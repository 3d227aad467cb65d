"""The CPU trainer's defaults on a small machine: the old-logprob pass is skipped where it equals the
step's own logprobs (one optimizer step per rollout), with the same loss and weights as with the
pass; inside a Ray actor the trainer computes on the cores it may use, not Ray's one thread."""

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.torch.threads import pick_cpu_threads
from miles.training.torch.trainer import Trainer
from tests.unit.test_trainer import SAMPLES

MODEL = "examples/arithmetic/base_model"


def one_rollout(**kwargs):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = Trainer(MODEL, train=TrainConfig(lr=1e-2, micro_batch_size=2),
                    algorithm=AlgorithmConfig(loss_agg_mode="seq_mean_token_mean", kl_loss_type="k3"),
                    rollout=RolloutConfig(n_samples_per_prompt=4, batch_size=1), device="cpu", **kwargs)
        metrics = t.train([s for s in SAMPLES if max(s.tokens) < 24], rollout_id=0)
        return metrics, {n: p.detach().clone() for n, p in t.model.named_parameters()}
    finally:
        torch.set_num_threads(before)


def test_the_cpu_skips_the_old_logprob_pass_by_default_with_the_same_step():
    (m_default, w_default), (m_pass, w_pass) = one_rollout(), one_rollout(skip_old_logprobs=False)
    assert m_default["logprob_passes"] == 0.0 and m_pass["logprob_passes"] == 1.0
    for k in ("loss", "pg_loss", "entropy", "logprob_diff_rollout", "grad_norm"):
        assert m_default[k] == pytest.approx(m_pass[k], abs=1e-6), k
    for n in w_pass:
        torch.testing.assert_close(w_default[n], w_pass[n], atol=1e-6, rtol=1e-5)


def test_trainer_threads_in_a_ray_actor_on_the_cpu():
    assert pick_cpu_threads(on_cpu=True, in_actor=True, cores=2, current=1) == 2     # Ray's OMP_NUM_THREADS=1
    assert pick_cpu_threads(on_cpu=True, in_actor=False, cores=2, current=1) is None  # a test or script: theirs
    assert pick_cpu_threads(on_cpu=False, in_actor=True, cores=2, current=1) is None  # CUDA: not the CPU's work
    assert pick_cpu_threads(on_cpu=True, in_actor=True, cores=8, current=8) is None   # already as many
    # the placement's budget (miles.cluster.placement.cpu_thread_budget) decides, fewer threads too
    assert pick_cpu_threads(on_cpu=True, in_actor=True, cores=2, current=2, budget=1) == 1
    assert pick_cpu_threads(on_cpu=True, in_actor=True, cores=2, current=1, budget=1) is None
    assert pick_cpu_threads(on_cpu=True, in_actor=True, cores=8, current=1, budget=6) == 6
    assert pick_cpu_threads(on_cpu=True, in_actor=False, cores=2, current=2, budget=1) is None


def test_the_placement_budget_reaches_the_trainer_through_its_environment(monkeypatch):
    from miles.runtime.procs import CPU_THREADS_ENV
    from miles.training.torch.threads import placement_budget

    monkeypatch.delenv(CPU_THREADS_ENV, raising=False)
    assert placement_budget() is None
    monkeypatch.setenv(CPU_THREADS_ENV, "3")
    assert placement_budget() == 3
    for bad in ("0", "", "two"):
        monkeypatch.setenv(CPU_THREADS_ENV, bad)
        assert placement_budget() is None
