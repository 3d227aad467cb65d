"""Padding-free packing (--use-dynamic-batch-size): a packed micro-batch gives the padded one's
logprobs, entropies, loss terms under every --loss-agg-mode, and gradients; the planner packs real
tokens up to the budget; the pack's attention stays inside each sample."""

import random

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import make_train_batch
from miles.training.torch.microbatch import plan_micro_batches, take_rows
from miles.training.packing import Pack, enable_packing, pack_groups, packed_attention
from miles.training.torch.trainer import Trainer
from tests.unit.test_trainer import sample

MODELS = ("examples/arithmetic/base_model", "examples/arithmetic/base_model_qwen3",
          "examples/arithmetic/base_model_llama3")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def per_sample_attention(query, key, value, cu_seqlens, scaling):
    """The reference: each sample's span through its own causal SDPA ([1, H, L, D] layout)."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)
    bounds = cu_seqlens.tolist()
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling)
        for s, e in zip(bounds[:-1], bounds[1:])], dim=2)


def samples(n=10, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(4, 24) for _ in range(rng.randrange(1, 7))]
        response = [rng.randrange(4, 24) for _ in range(rng.randrange(1, 12))]
        out.append(sample(prompt, response, rng.uniform(-1, 1), [rng.uniform(-3, -0.1) for _ in response]))
    return out


def test_pack_groups_fill_real_tokens_up_to_the_budget():
    lengths = [9, 3, 7, 2, 8, 1, 12, 5]
    groups = pack_groups(lengths, 12)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 12 for g in groups)
    assert len(groups) == 4 == -(-sum(lengths) // 12)            # first-fit decreasing: no extra micro-batch here
    assert pack_groups([30, 2], 10) == [[0], [1]]                  # a row over the budget goes alone, whole
    assert groups == pack_groups(lengths, 12)                      # deterministic
    # --max-tokens-per-gpu >= 1 is the config's rule, stated once (tests/unit/test_check_registry.py)


def test_pack_positions_restart_and_unpack_restores_the_padded_layout():
    batch = make_train_batch(samples(4), pad_id=0)
    pack = Pack.of(batch.attention_mask)
    lengths = batch.attention_mask.sum(1)
    assert pack.num_tokens == int(lengths.sum()) == pack.position_ids.shape[1] == pack.index.shape[0]
    assert pack.cu_seqlens.tolist() == [0, *lengths.cumsum(0).tolist()]
    starts = pack.cu_seqlens[:-1].long()
    assert (pack.position_ids[0, starts] == 0).all() and pack.max_len == int(lengths.max())
    restored = pack.unpack(pack.pack(batch.tokens.float()))
    assert torch.equal(restored, torch.where(batch.attention_mask.bool(), batch.tokens.float(), 0.0))


def test_packed_attention_sees_only_its_own_sample():
    torch.manual_seed(0)
    lengths = [5, 1, 7]
    q, k, v = torch.randn(1, 4, 13, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    module = torch.nn.Module()
    out, _ = packed_attention(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=7)
    start = 0
    for n in lengths:   # each sample alone, as its own causal attention
        s = slice(start, start + n)
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, s], k[:, :, s].repeat_interleave(2, 1),
                                                               v[:, :, s].repeat_interleave(2, 1), is_causal=True,
                                                               scale=0.3)
        torch.testing.assert_close(out[:, s], ref.transpose(1, 2))
        start += n


def make(path, mode, *, packed, dynamic=True, hidden=False, budget=24, recompute=False):
    algorithm = AlgorithmConfig(loss_agg_mode=mode, kl_loss_type="k3", entropy_coef=0.01, use_kl_loss=True,
                                kl_loss_coef=0.1)
    train = TrainConfig(lr=1e-2, micro_batch_size=3, use_dynamic_batch_size=dynamic,
                        max_tokens_per_gpu=budget if dynamic else None, pack_sequences=packed,
                        recompute_activations=recompute)
    return Trainer(path, train=train, algorithm=algorithm, rollout=RolloutConfig(n_samples_per_prompt=2, batch_size=5,
                                                                                  max_response_len=12),
                   device="cpu", hidden_forward=hidden, skip_old_logprobs=False)


def step(t: Trainer, data):
    batch = t.prepare(make_train_batch(data, t.pad_id))
    t._optimizer.zero_grad(set_to_none=True)
    seen = torch.zeros(batch.tokens.shape)
    terms = t.accumulate_gradients(batch, record=seen)
    return batch, seen, terms, {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("path", MODELS)
def test_a_packed_micro_batch_gives_the_padded_logprobs_loss_and_gradients(path):
    data = samples()
    padded, packed = make(path, "token_mean", packed=False), make(path, "token_mean", packed=True)
    assert packed._packed and not padded._packed
    a, b = step(padded, data), step(packed, data)
    mask = a[0].loss_mask
    plan = plan_micro_batches(a[0].attention_mask.sum(1).tolist(), micro_batch_size=3, max_tokens_per_gpu=24, packed=True)
    assert any(len(g) > 1 for g in plan)                        # packs do hold several samples
    for name in ("old_logprobs", "ref_logprobs"):              # the no-grad passes
        torch.testing.assert_close(getattr(b[0], name)[mask], getattr(a[0], name)[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[1][mask], a[1][mask], atol=1e-5, rtol=1e-5)   # the step's own
    assert b[2].keys() == a[2].keys()
    for k in a[2]:
        assert b[2][k] == pytest.approx(a[2][k], abs=1e-5), k
    for n in a[3]:
        torch.testing.assert_close(b[3][n], a[3][n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_every_loss_reduction_is_the_same_packed(mode):
    data = samples(seed=1)
    a = step(make(MODELS[0], mode, packed=False, dynamic=False), data)    # the fixed micro-batches
    b = step(make(MODELS[0], mode, packed=True), data)
    for k in a[2]:
        assert b[2][k] == pytest.approx(a[2][k], abs=1e-5), k
    for n in a[3]:
        torch.testing.assert_close(b[3][n], a[3][n], atol=1e-5, rtol=1e-4)


def test_the_chunked_hidden_path_packs_too_and_reports_the_padding_it_saved():
    data = samples(seed=2)
    a = step(make(MODELS[1], "token_mean", packed=False, hidden=True), data)
    b = step(make(MODELS[1], "token_mean", packed=True, hidden=True, recompute=True), data)   # the CUDA options
    for k in a[2]:
        assert b[2][k] == pytest.approx(a[2][k], abs=1e-5), k
    for n in a[3]:
        torch.testing.assert_close(b[3][n], a[3][n], atol=1e-5, rtol=1e-4)
    padded_run = make(MODELS[1], "token_mean", packed=False).train(data, 0)
    packed_run = make(MODELS[1], "token_mean", packed=True).train(data, 0)
    assert packed_run["tokens_computed_per_real"] == 1.0 < padded_run["tokens_computed_per_real"]
    assert packed_run["loss"] == pytest.approx(padded_run["loss"], abs=1e-5)


def test_a_model_packing_cannot_serve_is_refused_by_name(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODELS[1])
    model.config.use_sliding_window = True
    assert "sliding" in enable_packing(model)
    assert model.config._attn_implementation != "miles_packed"      # left as it was
    model.config.use_sliding_window = False
    assert enable_packing(model) is None and model.config._attn_implementation == "miles_packed"
    batch = make_train_batch(samples(3), pad_id=0)
    padded = model(input_ids=take_rows(batch, [0]).tokens).logits     # no boundaries: plain causal attention
    assert torch.isfinite(padded).all()


def test_recompute_with_compiled_layers_on_cuda_trains_padded_rows_and_says_why():
    from structlog.testing import capture_logs
    from transformers import AutoModelForCausalLM

    from miles.training.packing import use_packing

    model = AutoModelForCausalLM.from_pretrained(MODELS[1])
    train = TrainConfig(micro_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=256,
                        recompute_activations=True)
    with capture_logs() as logs:
        assert use_packing(train, model, device=torch.device("cuda")) is False
    (reason,) = [e["reason"] for e in logs if e["event"] == "packing_off"]
    assert reason.startswith("--recompute-activations with compiled layers on CUDA") and "--no-trainer-compile" in reason
    # switched all the same: without a pack the function is SDPA's causal attention (and no mask is built)
    assert model.config._attn_implementation == "miles_packed"
    assert use_packing(train, model, device=torch.device("cpu")) is True          # the CPU packs under recompute
    # eager layers pack under recompute on CUDA too (tests/gpu/test_packing_gpu.py checks them against padded)
    eager = TrainConfig(micro_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=256,
                        recompute_activations=True, compile_layers=False)
    assert use_packing(eager, model, device=torch.device("cuda")) is True


@pytest.mark.parametrize("packed", [False, True])
def test_compiled_layers_compile_in_the_first_rollout_only(packed):
    # dynamo's guards do not depend on the backend: a counting one shows them on the CPU. Each rollout
    # has other rows, lengths and packs; every variant the trainer needs (grad and no-grad passes, with
    # and without a padding mask) compiles in the first rollout, and later rollouts reuse them (before:
    # each new kind of shape change recompiled, past dynamo's recompile limit on the packed path)
    from torch._dynamo.testing import CompileCounter

    from miles.training.torch.forward import compile_decoder_layers

    torch._dynamo.reset()
    try:
        trainer = make(MODELS[1], "token_mean", packed=packed, dynamic=packed)
        counter = CompileCounter()
        assert compile_decoder_layers(trainer.model, backend=counter) == trainer.model.config.num_hidden_layers
        trainer.train(samples(n=10, seed=0), 0)
        first = counter.frame_count
        assert 1 <= first <= 4
        with torch._dynamo.config.patch(error_on_recompile=True):
            for r in range(1, 5):
                trainer.train(samples(n=10 - r, seed=r), r)
        assert counter.frame_count == first
    finally:
        torch._dynamo.reset()        # the compiled code goes, whatever the outcome: later tests start clean



@pytest.mark.parametrize("packed", [False, True])
def test_a_rollout_whose_micro_batch_is_of_a_new_kind_compiles_it_and_says_so(packed):
    # A first rollout of varied lengths (micro-batches of several rows, or packs of several samples), then
    # one whose only micro-batch is one row: dynamo specialises a batch of one row (and a packing trainer
    # runs a lone row as its row, no padding to remove), so that rollout compiles a variant of its own
    # (grad and no-grad), mid-run; on a GPU, seconds. Its train_done says how many graphs it compiled.
    from structlog.testing import capture_logs
    from torch._dynamo.testing import CompileCounter

    from miles.training.torch.forward import compile_decoder_layers

    rng = random.Random(1)
    lone = sample([rng.randrange(4, 24) for _ in range(6)], [rng.randrange(4, 24) for _ in range(11)], 0.5, [-1.0] * 11)
    torch._dynamo.reset()
    try:
        trainer = make(MODELS[1], "token_mean", packed=packed, budget=200)
        counter = CompileCounter()
        compile_decoder_layers(trainer.model, backend=counter)
        with capture_logs() as logs:
            first = trainer.train(samples(n=10, seed=0), 0)["layer_compiles"]
            again = trainer.train(samples(n=9, seed=5), 1)["layer_compiles"]
            alone = trainer.train([lone], 2)["layer_compiles"]
        assert (first, again, alone) == (counter.frame_count - 2, 0, 2)
        assert first >= 1
        assert [e["layer_compiles"] for e in logs if e["event"] == "train_done"] == [first, 0, 2]
    finally:
        torch._dynamo.reset()

@pytest.mark.parametrize("gqa,has_scale,causal", [(True, True, {"window_size": (-1, 0)}),
                                                   (False, False, {"is_causal": True})])
def test_the_varlen_adapter_hands_torch_its_layout(gqa, has_scale, causal):
    """CUDA's path, on the CPU: `_varlen_attention` passes [L, H, D] tensors, the boundaries and the
    causal / GQA / scale options the way each torch version's varlen_attn takes them; a stand-in
    with varlen_attn's contract (each span attended alone) must give the per-sample result."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 13, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    seen = {}

    def varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, **options):
        seen.update(options, shapes=(query.shape, key.shape), max=(max_q, max_k))
        if options.get("enable_gqa"):
            key, value = (x.repeat_interleave(query.shape[1] // x.shape[1], 1) for x in (key, value))
        bounds = cu_q.tolist()
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(x[s:e].transpose(0, 1) for x in (query, key, value)), is_causal=True,
            scale=options.get("scale")).transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])])

    scale = 8 ** -0.5
    from miles.training.packing import _varlen_attention

    out = _varlen_attention(varlen_attn, causal, gqa, has_scale, q, k, v, cu, 7, scale)
    torch.testing.assert_close(out, per_sample_attention(q, k, v, cu, scale))
    assert seen["shapes"] == ((13, 4, 8), (13, 2 if gqa else 4, 8)) and seen["max"] == (7, 7)
    assert ("scale" in seen) == has_scale and all(seen[key] == value for key, value in causal.items())


def test_a_pack_of_even_samples_takes_the_padded_rows_and_a_ragged_one_the_varlen_kernel():
    """`attention_path`: rows (SDPA: cuDNN's kernels on CUDA) while the rows add at most a quarter of
    padding, the variable-length kernel beyond it, and rows whenever that kernel cannot run."""
    from miles.training.packing import attention_path

    assert attention_path(4, 4 * 4160, 4160, True) == "rows"                    # 24 x 4k answers, one a pack
    assert attention_path(4, 1000, 250, True) == "rows"
    assert attention_path(4, 800, 250, True) == "rows"                          # 1000 positions: exactly 1.25
    assert attention_path(4, 799, 250, True) == "varlen"
    assert attention_path(5, 407, 300, True) == "varlen"                        # 37, 1, 300, 64, 5
    assert attention_path(5, 407, 300, False) == "rows"                         # CPU, float32, older torch
