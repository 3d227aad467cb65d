"""--fp16 on the torch trainer, PPO's critic and the FSDP2 ranks (CPU autocast in float16), and the
engines in float16: the loss scale's steps, the skipped overflow steps, the scaler's state in the
checkpoint, and the weights the engines hold."""

from __future__ import annotations

import json
import math

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import make_train_batch
from miles.training.torch.critic import Critic
from miles.training.torch.trainer import STATE_FILE, Trainer
from miles.weights.hf import model_weights
from tests.tiny_model import make_tiny_model
from tests.unit.test_trainer import SAMPLES


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def trainer(path, dtype: str, **train) -> Trainer:
    return Trainer(path, train=TrainConfig(**{"lr": 1e-2, **train}), device="cpu", dtype=dtype,
                   algorithm=AlgorithmConfig(loss_agg_mode="token_mean", eps_clip=0.2),
                   rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=8))


def weights(t) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in model_weights(t.model).items()}


def seq_logprobs(t: Trainer) -> torch.Tensor:
    batch = t.prepare(make_train_batch(SAMPLES, t.pad_id))
    return (batch.old_logprobs * batch.loss_mask).sum(dim=1)


def test_an_fp16_step_moves_the_policy_as_the_fp32_step_does(model_path):
    # the default start, 2^16: float16's range already, so no step overflows (Megatron-LM's 2^32 skips the first ~18)
    fp32, fp16 = trainer(model_path, "float32"), trainer(model_path, "float16")
    assert fp16.compute_dtype == torch.float16 and next(fp16.model.parameters()).dtype == torch.float32
    before, start = seq_logprobs(fp32), weights(fp32)
    m32, m16 = fp32.train(SAMPLES, rollout_id=0), fp16.train(SAMPLES, rollout_id=0)
    assert "loss_scale" not in m32 and "skipped_steps" not in m32          # bf16/fp32 metrics as they were
    assert (m16["loss_scale"], m16["skipped_steps"], fp16.num_steps) == (2.0 ** 16, 0.0, 1)
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=2e-2)   # unscaled before it is measured
    moved32, moved16 = seq_logprobs(fp32) - before, seq_logprobs(fp16) - before
    torch.testing.assert_close(moved16, moved32, rtol=0.1, atol=5e-3)
    assert moved16[0] > 0 and moved16[1] < 0           # the advantages' way (positive, then negative)
    w32, w16 = weights(fp32), weights(fp16)
    assert all(w.dtype == torch.float32 for w in w16.values())      # float32 master weights
    # AdamW's first step is about lr x sign(g): where a gradient is noise (k_proj's bias has none in exact
    # arithmetic) its sign differs between the dtypes, so the updates are compared by direction, whole
    d32, d16 = (torch.cat([(w[n] - start[n]).flatten() for n in start]) for w in (w32, w16))
    assert torch.cosine_similarity(d16, d32, dim=0) > 0.95


def test_an_overflow_skips_the_step_and_halves_the_scale(model_path):
    # 2^40 overflows float16's backward; hysteresis 1 cuts the scale at the first overflow
    t = trainer(model_path, "float16", initial_loss_scale=2.0 ** 40, hysteresis=1, clip_grad=1.0)
    start = weights(t)
    metrics = t.train(SAMPLES, rollout_id=0)
    assert (metrics["skipped_steps"], metrics["loss_scale"], t.num_steps) == (1.0, 2.0 ** 39, 0)
    assert math.isnan(metrics["grad_norm"])     # no step applied: no norm to report
    assert all(torch.equal(w, start[n]) for n, w in weights(t).items())
    assert not t._optimizer.state and all(p.grad is None for p in t.model.parameters())   # AdamW never stepped
    # the schedule did not advance either: the next clean step is step 0's
    t._scaler.scale = 2.0 ** 12
    assert t.train(SAMPLES, rollout_id=1)["skipped_steps"] == 0.0 and t.num_steps == 1


def test_bf16_and_fp32_still_stop_on_a_non_finite_gradient(model_path):
    t = trainer(model_path, "float32")
    t.model.get_input_embeddings().weight.data[7, 0] = math.inf
    with pytest.raises(FloatingPointError, match="gradient norm is"):
        t.train(SAMPLES, rollout_id=0)


def test_an_overflow_at_the_minimum_scale_stops_the_step(model_path):
    # a nan weight makes every gradient nan whatever the scale: skipped until the scale is at its floor, then an error
    t = trainer(model_path, "float16", initial_loss_scale=4.0, min_loss_scale=2.0, hysteresis=1,
                num_steps_per_rollout=4)
    t.model.get_input_embeddings().weight.data[7, 0] = math.nan
    with pytest.raises(FloatingPointError, match="at optimizer step 0 with the loss scale at --min-loss-scale 2.0"):
        t.train(SAMPLES, rollout_id=0)      # step 1 skipped at 4 (halved to 2), step 2 at the floor: stop


def test_the_scaler_state_round_trips_through_a_checkpoint(model_path, tmp_path):
    t = trainer(model_path, "float16", initial_loss_scale=2.0 ** 17, loss_scale_window=1, hysteresis=3)
    t.train(SAMPLES, rollout_id=0)
    t._scaler.hysteresis_tracker = 2          # as after an overflow: the load must bring it back too
    saved = t._scaler.state_dict()
    t.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / STATE_FILE).read_text())["loss_scaler"] == saved
    fresh = trainer(model_path, "float16", loss_scale_window=1, hysteresis=3)
    fresh.load(tmp_path / "ckpt")
    assert fresh._scaler.state_dict() == saved and fresh._scaler.scale == 2.0 ** 18
    no_optim = trainer(model_path, "float16")
    no_optim.load(tmp_path / "ckpt", optimizer=False)     # --no-load-optim: the scale starts over, as AdamW
    assert no_optim._scaler.scale == 2.0 ** 16


def test_the_critic_scales_its_value_loss(model_path, tmp_path):
    critic = Critic(model_path, train=TrainConfig(lr=1e-2, initial_loss_scale=2.0 ** 40, hysteresis=1),
                    algorithm=AlgorithmConfig(advantage_estimator="ppo"), device="cpu", dtype="float16")
    batch = make_train_batch(SAMPLES, critic.pad_id)
    values, returns = torch.zeros(batch.tokens.shape), batch.loss_mask.float()
    first = critic.train(SAMPLES, values, returns, rollout_id=0)       # 2^40 overflows: skipped
    assert (first["critic/skipped_steps"], first["critic/loss_scale"], critic.num_steps) == (1.0, 2.0 ** 39, 0)
    critic._scaler.scale = 2.0 ** 10
    second = critic.train(SAMPLES, values, returns, rollout_id=1)
    assert second["critic/skipped_steps"] == 0.0 and critic.num_steps == 1
    assert critic.values(SAMPLES)[batch.loss_mask].mean() > 0      # toward the returns of 1
    critic.save(tmp_path / "critic")
    restored = Critic(model_path, train=TrainConfig(lr=1e-2), algorithm=AlgorithmConfig(advantage_estimator="ppo"),
                      init_from=str(tmp_path / "critic"), device="cpu", dtype="float16")
    assert restored._scaler.state_dict() == critic._scaler.state_dict()


def test_an_fsdp_rank_skips_overflows_and_checkpoints_its_scaler(model_path, tmp_path):
    """One FSDP2 rank over gloo (the group made here, as several ranks in one process use it): float16
    units from FSDP's mixed-precision policy, the same scaler. On N ranks the overflow decision is the
    all-reduced gradient norm's, the same on every rank."""
    import torch.distributed as dist

    from miles.training.torch.fsdp.rank import FSDPRank
    from tests.unit.test_fsdp_ranks import free_port

    def rank(**train) -> FSDPRank:
        r = FSDPRank(model_path, train=TrainConfig(lr=1e-2, **train), algorithm=AlgorithmConfig(loss_agg_mode="token_mean"),
                     rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=8), rank=0, world_size=1, device="cpu",
                     dtype="float16")
        r.setup("127.0.0.1", 0)
        return r

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        r = rank(initial_loss_scale=2.0 ** 40, hysteresis=1)
        start = r.weights_checksum()
        first = r.train(SAMPLES, rollout_id=0)
        assert (first["skipped_steps"], first["loss_scale"], r.num_steps) == (1.0, 2.0 ** 39, 0)
        assert r.weights_checksum() == start
        r._scaler.scale = 2.0 ** 12
        assert r.train(SAMPLES, rollout_id=1)["skipped_steps"] == 0.0 and r.weights_checksum() != start
        r.save(tmp_path / "sharded")
        resumed = rank()
        resumed.load(tmp_path / "sharded")
        assert resumed._scaler.state_dict() == r._scaler.state_dict() and resumed.num_steps == 1
        for x in (r, resumed):
            x.dispose()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("engine_kind", ["embedded", "fast"])
def test_engines_hold_float16_and_take_the_trainers_weights_cast(model_path, engine_kind):
    """--fp16's engines: the weights in float16 (what `weights_dtype` tells the IPC buckets and the
    checksum), a sync casts the trainer's float32 master weights, and what they sample scores about as
    the float16 trainer scores it (the mismatch fp16 is for)."""
    from miles.rollout.engines.embedded.engine import EmbeddedEngine
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.types import Prompt, Sample, SamplingParams

    t = trainer(model_path, "float16", initial_loss_scale=2.0 ** 16)
    engine = {"embedded": EmbeddedEngine, "fast": FastEngine}[engine_kind](model_path, device="cpu", dtype="float16")
    assert engine.weights_dtype() == torch.float16
    t.train(SAMPLES, rollout_id=0)
    engine.update_weights(t.weights(), version=1)
    assert engine.weights_checksum() == t.weights_checksum(dtype=torch.float16) != t.weights_checksum()
    (gen,) = engine.generate([[5, 6, 14, 11, 18]], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    sampled = Sample(prompt=Prompt(index=0, text="", prompt_ids=(5, 6, 14, 11, 18)), group=0,
                     response_ids=list(gen.response_ids), rollout_logprobs=list(gen.logprobs), finish_reason="length",
                     weight_version=1, advantage=0.0)
    batch = t.prepare(make_train_batch([sampled], t.pad_id))
    trained = batch.old_logprobs[batch.loss_mask]
    torch.testing.assert_close(trained, torch.tensor(gen.logprobs), rtol=0.0, atol=2e-2)


def test_two_fsdp_ranks_skip_the_same_overflow_steps_then_step_together(model_path, tmp_path):
    """2 spawned gloo ranks in float16 at Megatron-LM's start of 2^32: both of rollout 0's steps
    overflow on both ranks (the decision is the all-reduced norm's), the first spends --hysteresis 2's
    first overflow, the second halves the scale, and no weight moves. At 2^12 rollout 1's steps apply,
    the ranks' weights stay equal, and the gradient norm is about the one-process float32 trainer's
    (8.10 against 8.06 when written; the one-process trainer under float16 autocast: 7.91, bf16 7.77)."""
    from tests.unit.test_fsdp_ranks import ROLLOUT, RANKS_TRAIN, configs, run_ranks

    one = Trainer(model_path, **configs(**RANKS_TRAIN))
    initial = weights(one)
    expected = one.train(ROLLOUT, 1)["grad_norm"]
    megatrons = {"loss_scaler": {"scale": 2.0 ** 32, "growth_tracker": 0, "hysteresis_tracker": 2}}
    in_range = {"loss_scaler": {"scale": 2.0 ** 12, "growth_tracker": 0, "hysteresis_tracker": 2}}
    ranks = run_ranks(2, model_path, tmp_path, [("_load_scaler_state", megatrons), ("train", 0),
                                                ("_load_scaler_state", in_range), ("train", 1)], dtype="float16")
    for (skipped, after_skip), (stepped, after_step) in ranks:
        assert (skipped["num_steps"], skipped["skipped_steps"], skipped["loss_scale"]) == (2, 2.0, 2.0 ** 31)
        assert all(torch.equal(after_skip[n], w) for n, w in initial.items())
        assert (stepped["skipped_steps"], stepped["loss_scale"]) == (0.0, 2.0 ** 12)
        assert stepped["grad_norm"] == pytest.approx(expected, rel=2e-2)
        assert not all(torch.equal(after_step[n], w) for n, w in initial.items())     # the step applied
    assert all(torch.equal(ranks[0][1][1][n], ranks[1][1][1][n]) for n in initial)
