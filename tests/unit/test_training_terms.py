"""miles.training.terms.PolicyObjective, the algorithm both training backends share: the skipped
old-logprob pass (prepare without the trainer's logprobs, then the step's own, detached, are the old
ones) is allowed only when nothing but the PPO ratio and the built-in (per-token) TIS weights read
them, and changes neither the loss, nor its gradient, nor the TIS and mismatch metrics."""

from __future__ import annotations

import dataclasses

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


# the rollout logprobs of SAMPLES are 0 and `current_logprobs` in (-1.1, -0.1): TIS weights in (0.33, 0.9),
# some under --tis-clip-low 0.5, some above --tis-clip 0.8, some between
TIS = dict(use_tis=True, tis_clip_low=0.5, tis_clip=0.8)


@pytest.mark.parametrize("algorithm", [{}, TIS], ids=["ppo", "tis"])
def test_the_skipped_pass_gives_the_same_loss_and_gradient_as_the_pass(algorithm):
    obj = objective(entropy_coef=0.01, **algorithm)
    assert obj.may_skip_old_pass
    with_pass, skipped = make_train_batch(SAMPLES, 0), make_train_batch(SAMPLES, 0)
    lp = current_logprobs(with_pass)
    _, m_pass = obj.prepare(with_pass, lp.detach().clone(), None, None)
    _, m_skip = obj.prepare(skipped, None, None, None)
    assert skipped.old_logprobs is None and (m_pass["logprob_passes"], m_skip["logprob_passes"]) == (1.0, 0.0)
    assert skipped.is_weights is None and (with_pass.is_weights is not None) == bool(algorithm)
    # the metrics the pass made, reported from the step's logprobs instead: the same names and values
    reported = obj.mismatch(lp.detach(), skipped)
    passed = {k: v for k, v in m_pass.items() if k in reported or k.startswith("tis_")}
    assert "logprob_diff_rollout" in passed and ("tis_clip_frac" in passed) == bool(algorithm)
    assert reported == pytest.approx(passed, abs=1e-7)
    if algorithm:
        assert 0 < passed["tis_clip_frac"] < 1
    entropy = torch.ones_like(lp)
    results = []
    for batch in (with_pass, skipped):
        lp.grad = None
        normalizer, num_tokens = obj.normalizers(batch)
        sums = TermSums()
        for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):     # micro-batches of 1, 2 and 1 rows
            mb = micro(batch, rows)
            loss, terms = obj.loss(lp[rows], entropy[rows], mb, normalizer, num_tokens)
            loss.backward()
            sums.add(terms)
        results.append((sums.floats(), lp.grad.clone()))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-7, rtol=1e-6)
    if algorithm:    # the weights are in the loss: without them it differs
        plain = objective(entropy_coef=0.01)
        plain.prepare(b := make_train_batch(SAMPLES, 0), None, None, None)
        loss, _ = plain.loss(lp.detach(), entropy, b, *plain.normalizers(b))
        assert float(loss) != pytest.approx(results[0][0]["loss"], abs=1e-4)


def micro(batch, rows: slice):
    """Rows `rows` of a prepared batch, as the trainer's micro-batches hold them."""
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name)[rows] for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


@pytest.mark.parametrize("algorithm", ["custom_tis", dict(use_rollout_logprobs=True), dict(kl_coef=0.1),
                                       dict(loss_type="sft_loss")])
def test_the_pass_cannot_be_skipped_when_more_than_the_ratio_reads_it(algorithm, tmp_path):
    if algorithm == "custom_tis":       # it may normalise over the whole batch: no micro-batch can compute it
        (tmp_path / "batch_tis.py").write_text("def normalised(train_lp, rollout_lp, mask):\n"
                                               "    w = (train_lp - rollout_lp).exp() * mask\n"
                                               "    return w / w.sum() * mask.sum()\n")
        algorithm = dict(use_tis=True, custom_tis_function_path=f"{tmp_path / 'batch_tis.py'}:normalised")
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
