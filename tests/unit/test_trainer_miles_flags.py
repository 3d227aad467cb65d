"""The trainer's share of miles' flags: --num-steps-per-rollout, --no-save-optim, --no-load-optim,
--no-load-rng, --finetune (the parts a resume takes), --use-unbiased-kl,
--custom-loss-function-path, --custom-tis-function-path, --save-debug-train-data, and the reference
check --ci-test reads."""

import json
import math

import pytest
import torch

from miles.algorithms import token_mean
from miles.algorithms.kl import kl_k3
from miles.training.batch import make_train_batch
from miles.training.terms import _unbiased_kl_term
from miles.training.torch.trainer import OPTIMIZER_FILE, STATE_FILE
from tests.unit.test_trainer_algorithms import SAMPLES, model_path, trainer, with_rollout_logprobs  # noqa: F401


def test_num_steps_per_rollout_splits_the_rollout_into_that_many_steps(model_path):
    t = trainer(model_path, num_steps_per_rollout=2, micro_batch_size=1)
    assert t.train(SAMPLES, 0)["num_steps"] == 2 and t.num_steps == 2       # 4 samples: 2 steps of 2


def test_no_save_optim_leaves_the_optimizer_out_and_a_resume_starts_a_fresh_one(model_path, tmp_path):
    t = trainer(model_path)
    t.train(SAMPLES, 0)
    t.save(tmp_path / "ckpt", optimizer=False)
    assert not (tmp_path / "ckpt" / OPTIMIZER_FILE).exists()
    assert json.loads((tmp_path / "ckpt" / STATE_FILE).read_text()) == {"num_steps": 1, "optimizer": False}
    resumed = trainer(model_path)
    resumed.load(tmp_path / "ckpt")
    assert resumed.weights_checksum() == t.weights_checksum() and resumed.num_steps == 1
    assert resumed._optimizer.state_dict()["state"] == {}          # no Adam moments: a fresh optimizer
    assert t._optimizer.state_dict()["state"] != {}


@pytest.mark.parametrize("parts", [dict(optimizer=False), dict(rng=False), dict(optimizer=False, rng=False, step=False)],
                         ids=["no-load-optim", "no-load-rng", "finetune"])
def test_a_resume_takes_the_parts_it_is_asked_for(model_path, tmp_path, parts):
    from miles.training.rng import rng_state

    t = trainer(model_path)
    t.train(SAMPLES, 0)
    t.save(tmp_path / "ckpt")
    saved_rng = torch.load(tmp_path / "ckpt" / "rng.pt", weights_only=True)["torch"]
    resumed = trainer(model_path)
    torch.manual_seed(1234)                                         # this process's RNG, not the checkpoint's
    resumed.load(tmp_path / "ckpt", **parts)
    assert resumed.weights_checksum() == t.weights_checksum()      # the weights always
    assert (resumed._optimizer.state_dict()["state"] != {}) == parts.get("optimizer", True)
    assert resumed.num_steps == (1 if parts.get("step", True) else 0)
    assert torch.equal(rng_state()["torch"], saved_rng) == parts.get("rng", True)


def test_unbiased_kl_weights_each_token_by_the_importance_ratio():
    # logp -2 on both tokens, the old policy -2.5 and -2, the reference -1: k3 = e - 2 on each token,
    # ratios e^0.5 and 1, token mean (e - 2)(e^0.5 + 1) / 2
    class MB:
        loss_mask = torch.tensor([[True, True]])
        old_logprobs = torch.tensor([[-2.5, -2.0]])
        ref_logprobs = torch.tensor([[-1.0, -1.0]])
    kl, _ = _unbiased_kl_term(kl_k3, token_mean, torch.tensor([[-2.0, -2.0]]), MB, 2)
    assert float(kl) == pytest.approx((math.e - 2) * (math.exp(0.5) + 1) / 2, rel=1e-6)


def test_unbiased_kl_equals_the_plain_kl_on_the_first_step(model_path):
    plain = trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1, ref_update_interval=None)
    unbiased = trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1, use_unbiased_kl=True)
    for t in (plain, unbiased):
        t.train(SAMPLES, 0)                      # one step: the policy leaves the reference
    a, b = plain.train(SAMPLES, 1), unbiased.train(SAMPLES, 1)   # ratio 1 again at this rollout's first step
    assert a["kl"] > 0 and b["kl"] == pytest.approx(a["kl"], rel=1e-6)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_custom_loss_by_path_trains_like_the_policy_loss_it_spells_out(model_path, tmp_path):
    # the unclipped surrogate -A * ratio: at ratio 1 its value and gradient are PPO's
    fn = write(tmp_path, "my_loss.py", "import torch\n"
               "def surrogate(logprobs, batch, reduce):\n"
               "    ratio = torch.exp(logprobs - batch.old_logprobs)\n"
               "    return reduce(-batch.advantages * ratio, batch.loss_mask), {'seen': 1.0}\n")
    ppo = trainer(model_path)
    custom = trainer(model_path, loss_type="custom_loss", custom_loss_function_path=f"{fn}:surrogate")
    a, b = ppo.train(SAMPLES, 0), custom.train(SAMPLES, 0)
    assert b["pg_loss"] == pytest.approx(a["pg_loss"], abs=1e-7) and b["custom/seen"] == pytest.approx(1.0)
    assert custom.weights_checksum() == ppo.weights_checksum()


def test_a_custom_tis_function_sets_the_weights(model_path, tmp_path):
    fn = write(tmp_path, "my_tis.py", "import torch\n"
               "def half(train_logprobs, rollout_logprobs, mask):\n"
               "    return torch.full_like(train_logprobs, 0.5)\n")
    plain = trainer(model_path).train(SAMPLES, 0)
    t = trainer(model_path, use_tis=True, custom_tis_function_path=f"{fn}:half")
    m = t.train(with_rollout_logprobs(t, SAMPLES, -10.0), 0)
    assert m["pg_loss"] == pytest.approx(0.5 * plain["pg_loss"], rel=1e-5) and m["tis_weight_mean"] == 0.5


def test_save_debug_train_data_writes_the_prepared_batch(model_path, tmp_path):
    t = trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1,
                save_debug_train_data=str(tmp_path / "dump" / "{rollout_id}_{rank}.pt"))
    m = t.train(SAMPLES, 3)
    saved = torch.load(tmp_path / "dump" / "3_0.pt", weights_only=True)
    expected = make_train_batch(SAMPLES, t.pad_id)
    assert saved["rollout_id"] == 3 and torch.equal(saved["tokens"], expected.tokens)
    assert torch.equal(saved["loss_mask"], expected.loss_mask) and saved["ref_logprobs"].shape == expected.tokens.shape
    assert m["ref_logprob_diff_max"] == 0.0            # the reference is the initial policy: --ci-test's check
