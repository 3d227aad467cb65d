"""The trainer's algorithm options on the tiny model: TIS, rollout logprobs as the old policy, loss
reductions, REINFORCE++ with KL in the reward, the reference model (--ref-load, refresh)."""

import math

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import make_train_batch
from miles.training.torch.trainer import REF_FILE, Trainer
from miles.types import Prompt, Sample
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def sample(prompt, response, advantage=0.0, reward=0.0, logprobs=None):
    return Sample(prompt=Prompt(index=0, text="", prompt_ids=tuple(prompt)), group=0, response_ids=list(response),
                  rollout_logprobs=logprobs if logprobs is not None else [0.0] * len(response),
                  finish_reason="stop", weight_version=0, advantage=advantage, reward=reward)


# response lengths 5, 2, 7, 1
SAMPLES = [sample([5, 6, 14], [7, 8, 9, 10, 2], 1.0), sample([7], [21, 22], -1.0),
           sample([9, 4, 4, 4], [25, 26, 27, 28, 29, 30, 2], 0.5), sample([11, 12], [13], -0.5)]


def trainer(path, **kw) -> Trainer:
    rollout = {k: kw.pop(k) for k in ("temperature", "max_response_len") if k in kw}   # how the samples were drawn
    algo = {k: kw.pop(k) for k in list(kw) if k in AlgorithmConfig.__dataclass_fields__}
    return Trainer(path, train=TrainConfig(**{"lr": 1e-2, **kw}), algorithm=AlgorithmConfig(**{"loss_agg_mode": "token_mean", "kl_loss_type": "k3", **algo}),
                   rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=8, **rollout), device="cpu")


def with_rollout_logprobs(t: Trainer, samples, shift: float):
    """The samples with rollout logprobs = the trainer's own + shift."""
    lp = t.prepare(make_train_batch(samples, t.pad_id)).old_logprobs
    out = []
    for i, s in enumerate(samples):
        p, r = len(s.prompt.prompt_ids), len(s.response_ids)
        out.append(sample(s.prompt.prompt_ids, s.response_ids, s.advantage, s.reward,
                          (lp[i, p:p + r] + shift).tolist()))
    return out


@pytest.mark.parametrize("mode, expected", [
    # first step, ratio 1: pg_loss = -(reduction of A over the response tokens)
    ("token_mean", -(5 * 1 - 2 * 1 + 7 * 0.5 - 1 * 0.5) / 15),          # -6 / 15
    ("seq_mean_token_mean", -(1 - 1 + 0.5 - 0.5) / 4),                   # 0
    ("seq_mean_token_sum_norm", -(5 * 1 - 2 * 1 + 7 * 0.5 - 0.5) / 8 / 4),  # max_len 8: -6 / 32
])
def test_loss_agg_mode_reduces_the_policy_loss(model_path, mode, expected):
    m = trainer(model_path, loss_agg_mode=mode, max_response_len=8, micro_batch_size=3).train(SAMPLES, 0)
    assert m["pg_loss"] == pytest.approx(expected, abs=1e-6)


def test_tis_weights_scale_the_loss_and_are_clipped(model_path):
    plain = trainer(model_path).train(SAMPLES, 0)
    t = trainer(model_path, use_tis=True, tis_clip=2.0)
    # the engine gave every token 10 nats less than the trainer: raw weight e^10, clipped to 2
    m = t.train(with_rollout_logprobs(t, SAMPLES, -10.0), 0)
    assert m["pg_loss"] == pytest.approx(2 * plain["pg_loss"], rel=1e-5)
    assert m["tis_clip_frac"] == 1.0 and m["tis_weight_mean"] == pytest.approx(2.0)
    assert m["logprob_diff_rollout"] == pytest.approx(10.0, rel=1e-5)


def test_rollout_logprobs_as_the_old_policy(model_path):
    negative = [sample(s.prompt.prompt_ids, s.response_ids, -1.0) for s in SAMPLES]
    t = trainer(model_path, use_rollout_logprobs=True, eps_clip=0.2)
    # engine logprobs 0.5 above the trainer's: ratio e^-.5 = .61 < .8, clipped for every negative advantage
    m = t.train(with_rollout_logprobs(t, negative, 0.5), 0)
    assert m["clip_frac"] == pytest.approx(1.0)
    t2 = trainer(model_path, eps_clip=0.2)
    assert t2.train(with_rollout_logprobs(t2, negative, 0.5), 0)["clip_frac"] == 0   # trainer's own: ratio 1


def test_opsm_drops_the_stale_negative_sequences_from_the_policy_loss(model_path):
    # engine logprobs 0.5 above the trainer's, the old policy with --use-rollout-logprobs: every
    # sequence's mean old - new is .5 > delta; the negative ones (lengths 2 and 1 of 15 tokens) are masked
    # and the positive ones train as without OPSM: pg_loss (token_mean, ratio e^-.5) = -(5 + 3.5) e^-.5 / 15
    stale = with_rollout_logprobs(trainer(model_path), SAMPLES, 0.5)     # (with --use-rollout-logprobs prepare reads them)
    t = trainer(model_path, use_rollout_logprobs=True, eps_clip=0.9, use_opsm=True, opsm_delta=0.4)
    m = t.train(stale, 0)
    assert m["opsm_clipfrac"] == pytest.approx(3 / 15)
    assert m["pg_loss"] == pytest.approx(-(5 * 1 + 7 * 0.5) * math.exp(-0.5) / 15, rel=1e-4)
    # a threshold above .5 masks nothing: -(5 - 2 + 3.5 - .5) e^-.5 / 15
    t2 = trainer(model_path, use_rollout_logprobs=True, eps_clip=0.9, use_opsm=True, opsm_delta=0.6)
    m2 = t2.train(stale, 0)
    assert m2["opsm_clipfrac"] == 0 and m2["pg_loss"] == pytest.approx(-6 * math.exp(-0.5) / 15, rel=1e-4)
    assert "opsm_clipfrac" not in trainer(model_path).train(SAMPLES, 0)


def test_reinforce_plus_plus_whitens_the_return_to_go(model_path):
    t = trainer(model_path, advantage_estimator="reinforce_plus_plus", gamma=1.0)
    batch = t.prepare(make_train_batch([sample([5], [6, 7, 2], reward=1.0), sample([5], [8, 2], reward=0.0)], t.pad_id))
    # returns on the 5 response tokens [1, 1, 1, 0, 0]: mean .6, population std sqrt(.24)
    s = math.sqrt(0.24)
    assert batch.advantages[0, 1:4].tolist() == pytest.approx([0.4 / s] * 3, rel=1e-5)
    assert batch.advantages[1, 1:3].tolist() == pytest.approx([-0.6 / s] * 2, rel=1e-5)


def test_kl_in_the_reward_starts_at_zero_then_shapes_the_returns(model_path):
    t = trainer(model_path, advantage_estimator="reinforce_plus_plus", kl_coef=0.5)
    rewarded = [sample(s.prompt.prompt_ids, s.response_ids, reward=float(i % 2)) for i, s in enumerate(SAMPLES)]
    first = t.train(rewarded, 0)
    assert first["reward_kl"] == 0                            # policy == reference before any step
    assert t.train(rewarded, 1)["reward_kl"] != 0


def test_the_reference_refreshes_every_interval_and_survives_a_checkpoint(model_path, tmp_path):
    fixed = trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1)
    fixed.train(SAMPLES, 0)
    assert fixed.train(SAMPLES, 1)["kl"] > 0                 # moved away from the initial policy
    refreshed = trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1, ref_update_interval=1)
    assert refreshed.train(SAMPLES, 0)["ref_updated"] == 1
    assert refreshed.train(SAMPLES, 1)["kl"] == 0             # reference := the policy after rollout 0
    refreshed.save(tmp_path / "ck")
    assert (tmp_path / "ck" / REF_FILE).is_file()
    resumed = trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1, ref_update_interval=1)
    resumed.load(tmp_path / "ck")
    assert resumed.train(SAMPLES, 2)["kl"] == 0


def test_ref_load_takes_another_model_as_the_reference(model_path, tmp_path):
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1, ref_load=other).train(SAMPLES, 0)["kl"] > 0


def test_cosine_schedule_with_warmup_sets_each_steps_rate(model_path):
    from miles.training.schedule import lr_at

    # warmup 2: .5 lr, 1 lr; then cosine over steps 2..6 (decay_iters 6): p = (s - 2) / 4
    # s = 4: p = .5 -> min + (lr - min) * .5 = .1 + .9 * .5 = .55; s = 6 and later: min = .1
    rates = [lr_at(s, lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=6, style="cosine") for s in range(8)]
    assert rates[:3] == pytest.approx([0.5, 1.0, 1.0]) and rates[4] == pytest.approx(0.55)
    assert rates[6:] == pytest.approx([0.1, 0.1])
    assert lr_at(4, lr=1.0, warmup_iters=2, decay_iters=6, style="linear") == pytest.approx(0.5)
    t = trainer(model_path, lr=1e-2, lr_warmup_iters=2, global_batch_size=2, micro_batch_size=2)
    assert t.train(SAMPLES, 0)["lr"] == pytest.approx((0.5e-2 + 1e-2) / 2)   # two steps: .5 lr, then lr
