"""miles.training.terms.PolicyObjective, the algorithm both training backends share: the skipped
old-logprob pass (prepare without the trainer's logprobs, then the step's own, detached, are the old
ones) is allowed only when nothing but the PPO ratio reads them, and changes neither the loss nor
its gradient."""

from __future__ import annotations

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig
from miles.training.batch import make_train_batch
from miles.training.terms import PolicyObjective, TermSums
from tests.unit.test_trainer import SAMPLES


def objective(**algorithm) -> PolicyObjective:
    return PolicyObjective(AlgorithmConfig(**{"loss_agg_mode": "token_mean", "kl_loss_type": "k3", **algorithm}), RolloutConfig(n_samples_per_prompt=8, batch_size=1))


def current_logprobs(batch) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.where(batch.loss_mask, -torch.rand(batch.tokens.shape) - 0.1, 0.0).requires_grad_()


def test_the_skipped_pass_gives_the_same_loss_and_gradient_as_the_pass():
    obj = objective(entropy_coef=0.01)
    assert obj.may_skip_old_pass
    with_pass, skipped = make_train_batch(SAMPLES, 0), make_train_batch(SAMPLES, 0)
    lp = current_logprobs(with_pass)
    _, m_pass = obj.prepare(with_pass, lp.detach().clone(), None, None)
    _, m_skip = obj.prepare(skipped, None, None, None)
    assert skipped.old_logprobs is None and (m_pass["logprob_passes"], m_skip["logprob_passes"]) == (1.0, 0.0)
    assert "logprob_diff_rollout" in m_pass and "logprob_diff_rollout" in obj.mismatch(lp.detach(), skipped)
    entropy = torch.ones_like(lp)
    results = []
    for batch in (with_pass, skipped):
        lp.grad = None
        normalizer, num_tokens = obj.normalizers(batch)
        loss, terms = obj.loss(lp, entropy, batch, normalizer, num_tokens)
        loss.backward()
        sums = TermSums()
        sums.add(terms)
        results.append((sums.floats(), lp.grad.clone()))
    assert results[0][0] == pytest.approx(results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


@pytest.mark.parametrize("algorithm", [dict(use_tis=True), dict(use_rollout_logprobs=True), dict(kl_coef=0.1),
                                       dict(loss_type="sft_loss")])
def test_the_pass_cannot_be_skipped_when_more_than_the_ratio_reads_it(algorithm):
    obj = objective(**algorithm)
    assert not obj.may_skip_old_pass
    if obj.is_sft:
        return
    with pytest.raises(ValueError, match="old-logprob pass can be skipped only"):
        obj.prepare(make_train_batch(SAMPLES, 0), None, None, None)


def test_term_sums_add_tensors_and_floats_and_read_them_once():
    sums = TermSums()
    x = torch.tensor(2.0, requires_grad=True)
    sums.add({"loss": x * 3, "clip_frac": 0.25})
    sums.add({"loss": torch.tensor(0.5), "clip_frac": torch.tensor(0.25)}, weight=2.0)
    sums.add({"loss": torch.tensor(float("nan")), "clip_frac": 7.0, "micro_batches": 1.0}, weight=0.0)   # padding
    assert sums.floats() == {"loss": 7.0, "clip_frac": 0.75, "micro_batches": 0.0}
    assert all(type(v) is float for v in sums.floats().values())
    assert TermSums().floats() == {}
