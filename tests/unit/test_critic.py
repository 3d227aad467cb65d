"""The PPO critic: value alignment, learning its targets, save/load and where it starts; PPO's
advantages from critic values in the trainer."""

import pytest
import torch

from miles.checkpoint.store import CheckpointStore
from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.torch.critic import CRITIC_DIR, Critic, resolve_critic_source
from miles.training.batch import make_train_batch
from miles.training.torch.trainer import Trainer
from miles.types import Prompt, Sample
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def sample(prompt, response, reward=0.0):
    return Sample(prompt=Prompt(index=0, text="", prompt_ids=tuple(prompt)), group=0, response_ids=list(response),
                  rollout_logprobs=[0.0] * len(response), finish_reason="stop", weight_version=0, reward=reward)


SAMPLES = [sample([5, 6], [7, 8, 2], 1.0), sample([9], [4, 2], 0.0), sample([11, 12, 13], [14], 1.0)]


def critic(path, **kw):
    algo = {k: kw.pop(k) for k in list(kw) if k in AlgorithmConfig.__dataclass_fields__}
    return Critic(path, train=TrainConfig(**{"lr": 1e-2, **kw}), algorithm=AlgorithmConfig(**{"loss_agg_mode": "token_mean", "kl_loss_type": "k3", **algo}), device="cpu")


def test_a_fresh_critic_values_every_prefix_at_zero_and_only_on_response_tokens(model_path):
    c = critic(model_path)
    v = c.values(SAMPLES)
    assert v.shape == (3, 5) and (v == 0).all()     # widest row: 2 prompt + 3 response tokens
    c.train(SAMPLES, v, torch.ones(3, 5), rollout_id=0)
    v = c.values(SAMPLES)
    # after a step toward 1, response tokens have values; prompt and padding positions stay 0
    assert (v[0, 2:5] != 0).all() and v[0, :2].eq(0).all() and v[1, 3:].eq(0).all()


def test_the_value_loss_falls_as_the_critic_fits_its_returns(model_path):
    c = critic(model_path, value_clip=0.0)          # no clipping: plain regression
    returns = torch.zeros(3, 5)
    for i, s in enumerate(SAMPLES):                 # return = reward on every response token
        p = len(s.prompt.prompt_ids)
        returns[i, p:p + len(s.response_ids)] = s.reward
    losses = []
    for r in range(6):
        losses.append(c.train(SAMPLES, c.values(SAMPLES), returns, rollout_id=r)["critic/value_loss"])
    # V = 0 at first: loss = 0.5 * mean over the 6 response tokens of R^2 = 0.5 * 4 / 6
    assert losses[0] == pytest.approx(0.5 * 4 / 6, rel=1e-5)
    assert losses[-1] < 0.5 * losses[0], losses


def test_value_clipping_stops_the_gradient_of_tokens_far_from_their_old_value(model_path):
    c = critic(model_path, value_clip=0.2)
    old = c.values(SAMPLES)
    m = c.train(SAMPLES, old + 5.0, torch.zeros(3, 5), rollout_id=0)   # V = 0, old 5, R = 0: clipped side wins
    assert m["critic/value_clip_frac"] == pytest.approx(1.0)


def test_save_load_and_every_form_of_critic_load(model_path, tmp_path):
    c = critic(model_path)
    c.train(SAMPLES, c.values(SAMPLES), torch.ones(3, 5), rollout_id=0)
    c.save(tmp_path / "crit")
    restored = critic(model_path)
    restored.load(tmp_path / "crit")
    assert torch.equal(restored.values(SAMPLES), c.values(SAMPLES)) and restored.num_steps == 1
    # a checkpoint root whose newest checkpoint holds critic/
    store = CheckpointStore(tmp_path / "root")
    tmp = store.begin(3)
    c.save(tmp / CRITIC_DIR)
    store.commit(tmp, 3, {})
    assert resolve_critic_source(str(tmp_path / "root"))[1] == store.latest()[1] / CRITIC_DIR
    assert resolve_critic_source(model_path) == (model_path, None)      # HF folder: new head
    from_root = Critic(model_path, train=TrainConfig(lr=1e-2), algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                       init_from=str(tmp_path / "root"), device="cpu")
    assert torch.equal(from_root.values(SAMPLES), c.values(SAMPLES))
    with pytest.raises(FileNotFoundError, match="--critic-load"):
        resolve_critic_source(str(tmp_path / "nothing"))


def test_ppo_advantages_come_from_the_critic_values(model_path):
    t = Trainer(model_path, train=TrainConfig(lr=1e-2), algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", advantage_estimator="ppo"),
                rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), device="cpu")
    values = torch.zeros(3, 5)
    values[0, 2:5] = torch.tensor([0.5, 0.25, 0.0])
    # gamma = lambda = 1: A_t = (rewards from t on) - V_t, and R_t = A_t + V_t is the return-to-go.
    # row 0 (2 prompt tokens, 3 response tokens, reward 1 on the last): A = [.5, .75, 1], R = [1, 1, 1]
    batch = t.prepare(make_train_batch(SAMPLES, t.pad_id), values)
    assert batch.advantages[0].tolist() == pytest.approx([0, 0, 0.5, 0.75, 1.0])
    returns = t.prepare_rollout(SAMPLES, 0, values)
    assert returns[0].tolist() == pytest.approx([0, 0, 1.0, 1.0, 1.0])
    assert returns[1].tolist() == pytest.approx([0, 0, 0, 0, 0]) and returns[2, 3].item() == pytest.approx(1.0)
    m = t.train(SAMPLES, 0)                       # trains what prepare_rollout prepared
    assert m["num_steps"] == 1 and m["advantage_abs_mean"] > 0
    with pytest.raises(ValueError, match="critic's values"):
        t.train(SAMPLES, 1)                       # PPO without values: a clear error, not a silent zero baseline


def test_optimizer_cpu_offload_trains_the_critic_as_without_it_with_its_state_on_the_host(model_path, tmp_path):
    """--optimizer-cpu-offload reaches PPO's critic too (its TrainConfig is the policy's): the same values
    after each step and after a resume, the moments in the host buffers throughout."""
    from tests.unit.test_trainer import host_held as on_host

    plain, host = critic(model_path), critic(model_path, optimizer_cpu_offload=True)
    for r in range(2):
        for c in (plain, host):
            c.train(SAMPLES, c.values(SAMPLES), torch.ones(3, 5), rollout_id=r)
        assert on_host(host) and torch.equal(host.values(SAMPLES), plain.values(SAMPLES))
    host.save(tmp_path / "crit")
    resumed = critic(model_path, optimizer_cpu_offload=True)
    resumed.load(tmp_path / "crit")
    assert on_host(resumed)
    for c in (plain, resumed):
        c.train(SAMPLES, c.values(SAMPLES), torch.ones(3, 5), rollout_id=2)
    assert torch.equal(resumed.values(SAMPLES), plain.values(SAMPLES))
