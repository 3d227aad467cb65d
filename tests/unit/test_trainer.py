import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.config.flags import parse_flags
from miles.config.schema import ConfigError
from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.training.batch import make_train_batch, split
from miles.training.torch.shards import local
from miles.training.torch.trainer import Trainer
from miles.types import Prompt, Sample, SamplingParams
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def sample(prompt: list[int], response: list[int], advantage: float = 0.0, logprobs: list[float] | None = None,
           version: int = 0) -> Sample:
    return Sample(prompt=Prompt(index=0, text="", prompt_ids=tuple(prompt)), group=0, response_ids=list(response),
                  rollout_logprobs=logprobs if logprobs is not None else [0.0] * len(response),
                  finish_reason="length", weight_version=version, advantage=advantage)


# responses of different lengths, so micro-batches hold different numbers of tokens
SAMPLES = [sample([5, 6, 14], [7, 8, 9, 10, 2], 1.0), sample([7], [21, 22], -1.0),
           sample([9, 4, 4, 4], [25, 26, 27, 28, 29, 30, 2], 0.5), sample([11, 12], [13], -0.5)]


def trainer(path, **kw) -> Trainer:
    rollout = {k: kw.pop(k) for k in ("temperature", "max_response_len") if k in kw}   # how the samples were drawn
    algo = {k: kw.pop(k) for k in list(kw) if k in AlgorithmConfig.__dataclass_fields__}
    return Trainer(path, train=TrainConfig(**{"lr": 1e-2, **kw}), algorithm=AlgorithmConfig(**{"loss_agg_mode": "token_mean", "kl_loss_type": "k3", **algo}),
                   rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=8, **rollout), device="cpu")


def test_make_train_batch_layout():
    a = sample([5, 6], [7, 8, 2], 0.5, [-1.0, -2.0, -3.0], version=3)
    b = sample([9], [4], -1.0, [-0.5], version=2)
    batch = make_train_batch([a, b], pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 2], [9, 4, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[False, False, True, True, True], [False, True, False, False, False]]
    assert batch.advantages.tolist() == [[0, 0, 0.5, 0.5, 0.5], [0, -1, 0, 0, 0]]
    assert batch.rollout_logprobs.tolist() == [[0, 0, -1, -2, -3], [0, -0.5, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.weight_version == 2 and batch.num_tokens == 4
    first, second = split(batch, 1)
    assert first.tokens.shape == (1, 5) and second.tokens.tolist() == [[9, 4]]  # padding columns dropped
    with pytest.raises(ValueError, match="3 response ids but 2 rollout logprobs"):
        make_train_batch([sample([5], [6, 7, 8], logprobs=[0.0, 0.0])], pad_id=0)


def seq_logprobs(t: Trainer, samples: list[Sample]) -> torch.Tensor:
    batch = t.prepare(make_train_batch(samples, t.pad_id))
    return (batch.old_logprobs * batch.loss_mask).sum(dim=1)


def test_advantages_move_logprobs_their_way(model_path):
    t = trainer(model_path, eps_clip=0.2)
    before = seq_logprobs(t, SAMPLES)
    for r in range(3):
        t.train(SAMPLES, rollout_id=r)
    change = (seq_logprobs(t, SAMPLES) - before).tolist()
    assert change[0] > 0 and change[2] > 0      # positive advantage: more likely
    assert change[1] < 0 and change[3] < 0      # negative advantage: less likely


def test_micro_batched_gradient_equals_the_full_batch_gradient(model_path):
    t = trainer(model_path, use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k3", entropy_coef=0.05)
    t.train(SAMPLES, rollout_id=0)  # move off the reference, so the KL term has a gradient
    batch = t.prepare(make_train_batch(SAMPLES, t.pad_id))
    assert len({mb.num_tokens for mb in split(batch, 1)}) > 1  # unequal micro-batches: a mean of means would differ
    grads = {}
    for size in (4, 1, 3):
        t.model.zero_grad(set_to_none=True)
        metrics = t.accumulate_gradients(batch, micro_batch_size=size)
        grads[size] = ([p.grad.clone() for p in t.model.parameters()], metrics)
    full, full_metrics = grads[4]
    for size in (1, 3):
        g, m = grads[size]
        for a, b in zip(full, g):  # float32 sums in another order: ~1e-7 apart; a wrong normalizer: ~10%
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
        assert m == pytest.approx(full_metrics, rel=1e-5, abs=1e-7)
    assert full_metrics["kl"] > 0 and full_metrics["entropy"] > 0


def test_first_step_is_on_policy_and_matches_the_engine(model_path):
    engine = EmbeddedEngine(model_path, device="cpu")
    prompts = [list(s.prompt.prompt_ids) for s in SAMPLES]
    gens = engine.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=8, seed=0))
    samples = [sample(p, g.response_ids, adv, g.logprobs) for p, g, adv in zip(prompts, gens, (1, -1, 1, -1))]
    t = trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1, temperature=0.8)
    m = t.train(samples, rollout_id=0)
    # one step from the weights that sampled: ratio 1 (nothing clipped), policy == reference (KL 0)
    assert m["num_steps"] == 1 and m["clip_frac"] == 0 and m["kl"] == 0
    assert m["logprob_diff_rollout"] < 1e-5  # engine and trainer agree on the logprobs
    assert m["train_tokens"] == sum(len(g.response_ids) for g in gens)
    assert set(m) >= {"loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm", "lr", "num_steps",
                      "train_tokens", "logprob_diff_rollout", "step_time_s", "optimizer_step_s"}
    assert 0 < m["optimizer_step_s"] < m["step_time_s"]     # the update's share of the step


def test_global_batch_size_sets_the_number_of_steps(model_path):
    t = trainer(model_path, global_batch_size=3, micro_batch_size=2)
    assert t.train(SAMPLES, rollout_id=0)["num_steps"] == 2  # 4 samples: steps of 3 and 1
    assert t.num_steps == 2


def test_log_probs_max_tokens_per_gpu_budgets_the_forwards_without_a_backward(model_path):
    # training micro-batches of at most 12 tokens, the no-grad logprob pass in one: the same logprobs
    batch = make_train_batch(SAMPLES, 0)
    small = trainer(model_path, use_dynamic_batch_size=True, max_tokens_per_gpu=12)
    big = trainer(model_path, use_dynamic_batch_size=True, max_tokens_per_gpu=12, log_probs_max_tokens_per_gpu=1000)
    assert len(small._micro_batches(batch)) == len(big._micro_batches(batch)) > 1          # training: alike
    assert len(big._micro_batches(batch, forward_only=True)) == 1
    assert len(small._micro_batches(batch, forward_only=True)) == len(small._micro_batches(batch))
    a, b = small._logprobs(small.model, batch), big._logprobs(big.model, batch)
    assert torch.allclose(a, b, atol=1e-5)


def test_adam_eps_reaches_the_optimizer(model_path):
    # AdamW's first step moves each weight by about lr * g / (|g| + eps): a large eps makes it small
    moved = {}
    for eps in (1e-8, 10.0):
        t = trainer(model_path, adam_eps=eps)
        before = [p.detach().clone() for p in t.model.parameters()]
        t.train(SAMPLES, rollout_id=0)
        moved[eps] = sum(float((p.detach() - b).abs().sum()) for p, b in zip(t.model.parameters(), before))
    assert 0 < moved[10.0] < moved[1e-8] / 10


def test_sft_loss_decreases(model_path):
    t = trainer(model_path, loss_type="sft_loss", lr=3e-2)
    losses = [t.train(SAMPLES, rollout_id=r)["loss"] for r in range(5)]
    assert losses[-1] < losses[0] - 0.5, losses


def test_save_then_load_continues_bit_identically(model_path, tmp_path):
    cfg = dict(global_batch_size=2, micro_batch_size=1, use_kl_loss=True, kl_loss_coef=0.1, weight_decay=0.1)
    straight = trainer(model_path, **cfg)
    straight.train(SAMPLES, 0)
    straight.save(tmp_path / "ckpt")
    straight.train(SAMPLES, 1)
    after_straight = (straight.weights_checksum(), torch.rand(2), random.random())

    resumed = trainer(model_path, **cfg)  # fresh weights, fresh optimizer, reseeded RNGs
    assert resumed.weights_checksum() != straight.weights_checksum()
    resumed.load(tmp_path / "ckpt")
    assert resumed.num_steps == 2
    resumed.train(SAMPLES, 1)
    after_resumed = (resumed.weights_checksum(), torch.rand(2), random.random())
    assert after_resumed[0] == after_straight[0]  # Adam moments restored: same update bit for bit
    assert torch.equal(after_resumed[1], after_straight[1]) and after_resumed[2] == after_straight[2]


def test_an_offloaded_trainer_resumes_with_its_optimizer_state_in_the_host_buffers(model_path, tmp_path):
    """--offload-train resumes (miles.phases.init offloads before it loads): the saved moments go
    straight into the host buffers, and the next (streamed) step is the straight run's, bit for bit."""
    cfg = dict(global_batch_size=2, micro_batch_size=1, weight_decay=0.1)
    straight = trainer(model_path, **cfg)
    straight.train(SAMPLES, 0)
    straight.save(tmp_path / "ckpt")
    straight.train(SAMPLES, 1)

    resumed = trainer(model_path, **cfg)
    assert resumed.offload() == 0               # a fresh optimizer: nothing to move yet
    resumed.load(tmp_path / "ckpt")
    host = resumed._host._host
    state = resumed._optimizer.state
    params = list(resumed._live().parameters())
    assert len(state) == len(params) and {name for _, name in host} == {"exp_avg", "exp_avg_sq"}
    for p in params:
        for name in ("exp_avg", "exp_avg_sq"):
            assert state[p][name].data_ptr() == host[(id(p), name)].data_ptr()
    assert resumed._optimizer.param_groups[0]["weight_decay"] == 0.1
    resumed.train(SAMPLES, 1)
    assert resumed.weights_checksum() == straight.weights_checksum()



def sharded_checkpoint(t: Trainer, ck):
    """What FSDPRank.save writes, written by one process: the DCP shards, the state file and rank 0's RNG."""
    import json
    import warnings

    from miles.training.torch.fsdp.checkpoint import rng_file, save_sharded
    from miles.training.rng import rng_state
    from miles.training.torch.trainer import STATE_FILE

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        save_sharded(t._live(), t._optimizer, ck)
    (ck / STATE_FILE).write_text(json.dumps({"num_steps": t.num_steps, "optimizer": True, "world_size": 1}))
    rng_file(ck, 0).parent.mkdir()
    torch.save(rng_state(), rng_file(ck, 0))
    return ck

def test_an_offloaded_trainer_resumes_a_sharded_checkpoint_with_its_optimizer_state_in_the_host_buffers(
        model_path, tmp_path):
    """The same from a sharded checkpoint (the torch trainer's ranks wrote it; DCP loads it onto the
    device): the loaded moments end in the host buffers before the first rollout, nothing of them
    left on the device, and the streamed step is the straight run's, bit for bit."""
    cfg = dict(global_batch_size=2, micro_batch_size=1, weight_decay=0.1)
    straight = trainer(model_path, **cfg)
    straight.train(SAMPLES, 0)
    ck = sharded_checkpoint(straight, tmp_path / "ck")
    straight.train(SAMPLES, 1)

    resumed = trainer(model_path, **cfg)
    assert resumed.offload() == 0
    resumed.load(ck)
    host = {k: v.data_ptr() for k, v in resumed._host._host.items()}
    state = resumed._optimizer.state
    params = list(resumed._live().parameters())
    assert len(state) == len(params) and resumed.num_steps == 2
    for p in params:
        for name, value in state[p].items():
            assert name == "step" or value.data_ptr() == host[(id(p), name)], name
    assert resumed.offload() == 0               # offloaded already: nothing left to move
    resumed.train(SAMPLES, 1)
    assert resumed.weights_checksum() == straight.weights_checksum()


def host_held(t) -> bool:
    """Every moment of the optimizer state of `t` (a trainer, critic or FSDP rank) is, as the local
    shard, its own host buffer of `t`'s HostOffload (and every parameter has state)."""
    host = {k: v.data_ptr() for k, v in t._host._host.items()}
    params = list(t._live().parameters())
    return len(t._optimizer.state) == len(params) and all(
        local(value).data_ptr() == host[(id(p), name)] for p in params
        for name, value in t._optimizer.state[p].items() if name != "step")


def test_optimizer_cpu_offload_keeps_the_state_on_the_host_from_the_first_step_and_resumes_there(model_path, tmp_path):
    """--optimizer-cpu-offload: no offload call needed; after every step the moments are the host
    buffers, the weights are the plain trainer's bit for bit, and a resume loads straight into the
    buffers and goes on as the straight run."""
    cfg = dict(global_batch_size=2, micro_batch_size=1, weight_decay=0.1)
    plain, host = trainer(model_path, **cfg), trainer(model_path, optimizer_cpu_offload=True, **cfg)
    assert plain._host is None and host._host is not None and not host._host.offloaded
    for r in (0, 1):
        plain.train(SAMPLES, r)
        host.train(SAMPLES, r)
        assert host_held(host)
        assert host.weights_checksum() == plain.weights_checksum()
    host.save(tmp_path / "ckpt")
    plain.train(SAMPLES, 2)

    resumed = trainer(model_path, optimizer_cpu_offload=True, **cfg)
    resumed.load(tmp_path / "ckpt")
    assert host_held(resumed) and resumed.num_steps == host.num_steps == 4   # into the buffers, not the device first
    resumed.train(SAMPLES, 2)
    assert host_held(resumed) and resumed.weights_checksum() == plain.weights_checksum()
    # with --offload-train as well: the offload reports the moments it holds (there already) and drops the gradients
    assert resumed.offload() == 8 * sum(p.numel() for p in resumed._live().parameters())
    assert host_held(resumed)


@pytest.mark.parametrize("flag", ["--optimizer-cpu-offload", "--offload-optimizer-states"])
def test_the_optimizer_cpu_offload_flags(model_path, tmp_path, flag):
    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", str(model_path), "--prompt-data", str(data), "--rollout-batch-size", "1",
            "--num-rollout", "1", "--n-samples-per-prompt", "8"]
    assert parse_flags(base + [flag])[0].train.optimizer_cpu_offload is True
    assert parse_flags(base)[0].train.optimizer_cpu_offload is False
    # Megatron-LM's companions of the flag take no effect here: accepted
    parse_flags(base + [flag, "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"])
    with pytest.raises(ConfigError, match="--optimizer-cpu-offload: not supported by --train-backend megatron"):
        parse_flags(base + ["--train-backend", "megatron", flag])


def test_train_reports_the_model_flops_it_achieved_and_mfu_against_the_given_peak(model_path, tmp_path):
    """`tflops`: 6 x parameters x real (unpadded) tokens over the optimizer steps' time; `mfu` only with a
    peak (--mfu-peak-tflops; on the CPU there is no default peak)."""
    t = trainer(model_path, global_batch_size=2, micro_batch_size=1)
    m = t.train(SAMPLES, 0)
    params = sum(p.numel() for p in t._live().parameters())
    real = sum(len(s.prompt.prompt_ids) + len(s.response_ids) for s in SAMPLES)
    assert m["tflops"] == pytest.approx(6 * params * real / (m["step_time_s"] * m["num_steps"]) / 1e12, rel=1e-6)
    assert "mfu" not in m
    m = trainer(model_path, mfu_peak_tflops=0.5).train(SAMPLES, 0)
    assert m["mfu"] == pytest.approx(m["tflops"] / 0.5)
    (tmp_path / "p.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    with pytest.raises(ConfigError, match="--mfu-peak-tflops 0.0: must be a positive"):
        parse_flags(["--hf-checkpoint", str(model_path), "--prompt-data", str(tmp_path / "p.jsonl"),
                     "--rollout-batch-size", "1", "--num-rollout", "1", "--n-samples-per-prompt", "2",
                     "--mfu-peak-tflops", "0"])


def test_load_names_missing_files(model_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="optimizer.pt"):
        trainer(model_path).load(tmp_path)


def test_export_hf_loads_with_auto_model(model_path, tmp_path):
    t = trainer(model_path, loss_type="sft_loss")
    t.train(SAMPLES, 0)
    t.export_hf(tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = make_train_batch(SAMPLES, 0).tokens
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, t.model(input_ids=tokens).logits)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_non_finite_gradient_stops_before_the_weights_change(model_path):
    t = trainer(model_path)
    before = t.weights_checksum()
    with pytest.raises(FloatingPointError, match="gradient norm is nan"):
        t.train([sample([5], [6, 7], advantage=float("nan"))], rollout_id=0)
    assert t.weights_checksum() == before


def test_an_unknown_kl_estimator_fails_at_construction(model_path):
    # the config's rules are validate's, before Ray starts (tests/unit/test_check_registry.py)
    with pytest.raises(ValueError, match="k9"):
        trainer(model_path, use_kl_loss=True, kl_loss_type="k9")


def test_dispose_frees_the_model(model_path):
    t = trainer(model_path)
    t.dispose()
    t.dispose()
    with pytest.raises(RuntimeError, match="disposed"):
        t.weights()


# --- --decoupled-lr: the input embedding and output layer on a rate of their own ----------------------
def test_decoupled_groups_hold_the_embedding_and_output_layer_in_parameter_order(model_path, tmp_path):
    from tests.tiny_model import make_tiny_family

    tied = trainer(model_path, decoupled_lr=1e-3)
    embed = tied.model.get_input_embeddings().weight
    assert tied._decoupled_groups == [True, False] and tied._optimizer.param_groups[0]["params"] == [embed]
    untied = trainer(make_tiny_family(tmp_path / "untied", "qwen2", tied=False), decoupled_lr=1e-3)
    m = untied.model
    assert untied._decoupled_groups == [True, False, True]
    groups = untied._optimizer.param_groups
    assert groups[0]["params"] == [m.get_input_embeddings().weight]
    assert groups[2]["params"] == [m.get_output_embeddings().weight]
    # the groups' concatenation is model.parameters(): a state dict's indices are one group's
    assert [p for g in groups for p in g["params"]] == list(m.parameters())


def test_a_decoupled_rate_equal_to_lr_changes_nothing_and_zero_freezes_the_embedding(model_path):
    cfg = dict(global_batch_size=2, micro_batch_size=1, weight_decay=0.1)
    plain, same = trainer(model_path, **cfg), trainer(model_path, decoupled_lr=1e-2, **cfg)
    plain.train(SAMPLES, 0)
    m = same.train(SAMPLES, 0)
    assert same.weights_checksum() == plain.weights_checksum() and m["decoupled_lr"] == m["lr"] == 1e-2
    frozen = trainer(model_path, decoupled_lr=0.0, **cfg)
    before = {n: p.detach().clone() for n, p in frozen.model.named_parameters()}
    m = frozen.train(SAMPLES, 0)
    after = dict(frozen.model.named_parameters())
    # rate 0: no Adam update, and AdamW's decay p * (1 - lr * wd) is p (tied: the head too)
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])
    assert (m["decoupled_lr"], m["lr"]) == (0.0, 1e-2)


@pytest.mark.parametrize("saved_kw, resumed_kw", [({}, {"decoupled_lr": 1e-2}), ({"decoupled_lr": 1e-2}, {})])
def test_a_checkpoint_of_either_group_layout_resumes_bit_identically(model_path, tmp_path, saved_kw, resumed_kw):
    # with --decoupled-lr equal to --lr the two layouts step alike: the resumed run matches the straight one
    cfg = dict(global_batch_size=2, micro_batch_size=1, weight_decay=0.1)
    straight = trainer(model_path, **cfg, **saved_kw)
    straight.train(SAMPLES, 0)
    straight.save(tmp_path / "ckpt")
    straight.train(SAMPLES, 1)
    resumed = trainer(model_path, **cfg, **resumed_kw)
    resumed.load(tmp_path / "ckpt")
    assert len(resumed._optimizer.param_groups) == (2 if resumed_kw else 1)
    resumed.train(SAMPLES, 1)
    assert resumed.weights_checksum() == straight.weights_checksum()


def test_a_checkpoint_of_another_model_is_refused_by_its_parameter_count(model_path, tmp_path):
    t = trainer(model_path, decoupled_lr=1e-3)
    saved = t._optimizer.state_dict()
    saved["param_groups"][1]["params"] = saved["param_groups"][1]["params"][:-1]
    with pytest.raises(ValueError, match="parameters, this trainer's optimizer .*: not this model's"):
        t._fit_groups(saved)


def test_a_sharded_checkpoints_optimizer_state_is_refused_by_decoupled_groups_and_loads_without_it(
        model_path, tmp_path):
    saved = trainer(model_path)
    saved.train(SAMPLES, 0)
    ck = sharded_checkpoint(saved, tmp_path / "ck")
    with pytest.raises(ValueError, match="sharded checkpoint, its optimizer state saved as one AdamW group.*"
                                         "--no-load-optim"):
        trainer(model_path, decoupled_lr=1e-3).load(ck)
    fresh = trainer(model_path, decoupled_lr=1e-3)
    fresh.load(ck, optimizer=False)                 # --no-load-optim: the weights and the step count
    assert fresh.num_steps == 1 and fresh.weights_checksum() == saved.weights_checksum()


def test_the_offload_chunk_size_is_the_streamed_steps_chunk(model_path):
    """--offload-train-disk-chunk-mb sets how many MiB of parameters a streamed step moves at a time."""
    from miles.training.torch.offload import DEFAULT_CHUNK_BYTES

    plain, chunked = trainer(model_path), trainer(model_path, offload_chunk_mb=3)
    plain.offload(), chunked.offload()
    assert (plain._host._chunk_bytes, chunked._host._chunk_bytes) == (DEFAULT_CHUNK_BYTES, 3 << 20)
