"""PPO's critic on N ranks (FSDP2 over gloo, ranks as spawned processes): the same values, value loss,
gradient norm and updated weights as the one-process critic on the same rollouts, and its checkpoint
(the one-process folder, written by rank 0) resumed by the one-process critic, and the one-process
checkpoint resumed on 2 ranks, both at start-up (--critic-load) and by `load`.

6 samples of different lengths, two global batches of 3 rows, micro-batches of 1 row: of each global
batch rank 0 runs rows 0-1 in two micro-batches, rank 1 row 2 and one empty micro-batch (padding, for
the collectives), so gradients accumulate over micro-batches before one reduce-scatter, and a padded
micro-batch must contribute nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from miles.config import AlgorithmConfig, TrainConfig
from miles.training.batch import make_train_batch
from miles.training.torch.critic import HEAD_FILE, Critic
from miles.weights.hf import model_weights
from tests.tiny_model import PAD_ID, make_tiny_family
from tests.unit.test_fsdp_ranks import ROLLOUT, end_rank_process, free_port, model_path  # noqa: F401 (the fixture)

TRAIN = dict(lr=1e-2, micro_batch_size=1, global_batch_size=3, clip_grad=0.5)     # two optimizer steps a rollout
ALGO = dict(loss_agg_mode="token_mean", kl_loss_type="k3", advantage_estimator="ppo", value_clip=0.2)
METRICS = ("value_loss", "value_clip_frac", "grad_norm", "values_mean", "returns_mean")
SHAPE = tuple(make_train_batch(ROLLOUT, PAD_ID).tokens.shape)


def configs(**train) -> dict:
    return dict(train=TrainConfig(**{**TRAIN, **train}), algorithm=AlgorithmConfig(**ALGO), device="cpu")


def returns(rollout_id: int) -> torch.Tensor:
    """Targets that differ by token and by rollout (the critic only reads them on response tokens)."""
    return torch.sin(torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).view(SHAPE) * 0.7 + rollout_id)


def rollout(critic, rollout_id: int, whole) -> tuple[torch.Tensor, dict, dict]:
    """One rollout as the train phase drives the critic: (old values, metrics, whole weights after)."""
    values = critic.values(ROLLOUT)
    metrics = critic.train(ROLLOUT, values, returns(rollout_id), rollout_id)
    return values, metrics, {n: whole(t.detach()).clone() for n, t in model_weights(critic._live()).items()}


def _rank_main(rank: int, world_size: int, port: int, model: str, out: str, init_from: str | None,
               script: list[tuple[str, object]], train: dict):
    """One rank runs `script`: ("train", rollout_id), ("save", folder), ("load", folder); writes what
    each train returned to out/rank_<r>.pt."""
    torch.set_num_threads(1)
    from miles.training.torch.fsdp.critic_rank import FSDPCriticRank
    from miles.training.torch.fsdp.sharding import full_tensor

    c = FSDPCriticRank(model, rank=rank, world_size=world_size, init_from=init_from, **configs(**train))
    c.setup("127.0.0.1", port)
    results = [rollout(c, arg, full_tensor) if action == "train" else getattr(c, action)(arg)
               for action, arg in script]
    torch.save([r for r in results if r is not None], Path(out) / f"rank_{rank}.pt")
    c.dispose()
    end_rank_process()


def run_ranks(world_size: int, model: str, out: Path, script: list[tuple[str, object]],
              init_from: str | None = None, train: dict | None = None) -> list:
    """`train`: TrainConfig fields over TRAIN's."""
    mp.spawn(_rank_main, args=(world_size, free_port(), model, str(out), init_from, script, train or {}),
             nprocs=world_size)
    return [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module")
def one_rank(model_path, tmp_path_factory):
    """The one-process critic on three rollouts; its checkpoint after rollout 0."""
    c = Critic(model_path, **configs())
    ck = tmp_path_factory.mktemp("one") / "ck"
    results = [rollout(c, 0, lambda t: t)]
    c.save(ck)
    results += [rollout(c, r, lambda t: t) for r in (1, 2)]
    return results, ck


@pytest.fixture(scope="module")
def two_ranks(model_path, one_rank, tmp_path_factory):
    """2 ranks: rollout 0 from the initial weights; the one-process checkpoint of rollout 0 loaded,
    rollout 1, saved (the checkpoint the one-process critic resumes)."""
    out = tmp_path_factory.mktemp("two")
    ranks = run_ranks(2, model_path, out, [("train", 0), ("load", str(one_rank[1])), ("train", 1),
                                           ("save", str(out / "ck"))])
    return ranks, out / "ck"


def assert_same(got: list, want: list) -> None:
    for (values, metrics, weights), (want_values, want_metrics, want_weights) in zip(got, want, strict=True):
        torch.testing.assert_close(values, want_values, rtol=1e-4, atol=1e-5)
        for k in METRICS:
            assert metrics[f"critic/{k}"] == pytest.approx(want_metrics[f"critic/{k}"], rel=1e-4, abs=1e-6), k
        assert metrics["critic/num_steps"] == want_metrics["critic/num_steps"] == 2
        assert weights.keys() == want_weights.keys()
        off = {n: float((w - want_weights[n]).abs().max()) for n, w in weights.items()
               if not torch.allclose(w, want_weights[n], rtol=1e-4, atol=1e-5)}
        # a key bias's gradient is 0 in exact arithmetic (see tests/unit/test_fsdp_ranks.py assert_same)
        assert {n for n in off if not n.endswith("k_proj.bias")} == set(), off


def test_two_ranks_take_the_one_process_critic_steps_and_resume_its_checkpoint(one_rank, two_ranks):
    ranks, _ = two_ranks
    assert all(m["critic/micro_batches"] == 3 for _, m, _ in one_rank[0])   # --micro-batch-size 1: a row each
    for got in ranks:   # every rank reports the same values and metrics and holds the same whole weights
        assert_same(got, one_rank[0][:2])       # rollout 1 after loading the one-process checkpoint
    assert ranks[0][0][2]["lm.model.embed_tokens.weight"].shape == (32, 32)   # gathered whole, not a shard
    assert any(m["critic/value_clip_frac"] > 0 for _, m, _ in one_rank[0])    # the clip takes part


def test_a_critic_saved_on_two_ranks_is_the_one_process_folder_and_resumes_on_one(one_rank, two_ranks, model_path):
    _, ck = two_ranks
    from safetensors.torch import load_file

    assert {p.name for p in ck.iterdir()} == {p.name for p in one_rank[1].iterdir()}
    for name in (HEAD_FILE, "model.safetensors"):      # the same tensors under the same names (tied ones once)
        assert load_file(ck / name).keys() == load_file(one_rank[1] / name).keys()
    c = Critic(model_path, **configs())
    c.load(ck)
    assert c.num_steps == 4
    assert_same([rollout(c, 2, lambda t: t)], one_rank[0][2:])
    resumed = Critic(model_path, init_from=str(ck), **configs())     # --critic-load of the folder
    assert_same([rollout(resumed, 2, lambda t: t)], one_rank[0][2:])


def test_two_ranks_start_from_a_critic_folder(one_rank, model_path, tmp_path):
    """--critic-load of the one-process checkpoint of rollout 0: the ranks restore it at start-up."""
    for got in run_ranks(2, model_path, tmp_path, [("train", 1)], init_from=str(one_rank[1])):
        assert_same(got, one_rank[0][1:2])


def test_an_untied_lm_head_is_frozen_and_the_two_rank_checkpoint_resumes_on_one(tmp_path):
    """A Llama with its own LM head: the head, which values never read, has no gradient and so no
    optimizer state; frozen, the sharded load does not ask for its state."""
    path = make_tiny_family(tmp_path / "llama", "llama3", tied=False)
    c = Critic(path, **configs())
    head = c._live().lm.get_output_embeddings().weight
    assert not head.requires_grad and any(p is head for p in c._optimizer.param_groups[0]["params"])
    one = [rollout(c, r, lambda t: t) for r in (0, 1)]
    ranks = run_ranks(2, path, tmp_path, [("train", 0), ("save", str(tmp_path / "ck"))])
    for got in ranks:
        assert_same(got, one[:1])
    resumed = Critic(path, **configs())
    resumed.load(tmp_path / "ck")
    assert_same([rollout(resumed, 1, lambda t: t)], one[1:])


# --use-dynamic-batch-size with a budget of 11 tokens; the rows' real tokens are [8, 3, 11] in the first
# global batch and [3, 5, 5] in the second (SHAPE's 11 columns). Fixed micro-batches of 1 row take 3 a step.
DYNAMIC = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=11)


@pytest.mark.parametrize("packed,per_step", [
    # packed, real tokens <= 11: {11}, {8, 3} and {5, 5}, {3}: 2 micro-batches a step
    (True, 2.0),
    # padded, rows x longest <= 11: {11}, {8}, {3} and {5, 5}, {3}: 3 and 2
    (False, 2.5),
])
def test_a_critic_with_dynamic_batches_takes_the_fixed_micro_batch_steps(one_rank, model_path, packed, per_step):
    c = Critic(model_path, **configs(**DYNAMIC, pack_sequences=packed))
    assert c._packed is packed
    got = [rollout(c, r, lambda t: t) for r in (0, 1)]
    assert_same(got, one_rank[0][:2])         # values, loss terms, gradient norm, updated weights
    for _, metrics, _ in got:
        assert metrics["critic/micro_batches"] == per_step


def test_two_critic_ranks_with_dynamic_batches_take_the_fixed_micro_batch_steps(one_rank, model_path, tmp_path):
    # rank 0 runs rows {8, 3} and {3, 5}, rank 1 {11} and {5}: one packed micro-batch each, 2 a step in all
    for got in run_ranks(2, model_path, tmp_path, [("train", 0), ("train", 1)], train=DYNAMIC):
        assert_same(got, one_rank[0][:2])
        assert [m["critic/micro_batches"] for _, m, _ in got] == [2.0, 2.0]


def test_a_critic_with_dynamic_batches_off_cuda_needs_a_token_budget(model_path):
    with pytest.raises(ValueError, match="--use-dynamic-batch-size needs --max-tokens-per-gpu N off CUDA"):
        Critic(model_path, **configs(use_dynamic_batch_size=True))


@pytest.mark.extended
def test_four_ranks_take_the_one_process_critic_steps(one_rank, model_path, tmp_path):
    for got in run_ranks(4, model_path, tmp_path, [("train", 0), ("train", 1)]):
        assert_same(got, one_rank[0][:2])
