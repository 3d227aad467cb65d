"""The memory plan's per-token bytes against what a CUDA step takes: the slope of the step's peak
allocated memory in its tokens (two micro-batch sizes, the same model: the weights, gradients and the
chunked logprobs' temporaries cancel), for compiled and eager decoder layers of Qwen3's 0.6B-8B layer
shapes (a small vocabulary), on the trainer's CUDA path (bf16 autocast, chunked logprobs from the
hidden states). Models of 2 and 4 layers separate what each layer keeps (the difference of their
slopes) from what does not grow with the depth (the backward's transient buffers, the head): the
first is checked against the plan's per-layer bytes, the sum at a real depth (36 layers) against the
plan's budget with its headroom. Skipped without a GPU; no Ray."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from miles.algorithms.fused_logprobs import DEFAULT_CHUNK_ROWS
from miles.training.batch import TrainBatch
from miles.training.torch.forward import compile_decoder_layers, hidden_forward
from miles.training.torch.memory_plan import HEADROOM, activation_bytes_per_token
from miles.training.torch.microbatch import HostRows, take_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (hidden, intermediate, heads, KV heads, head_dim) of Qwen3-0.6B, 1.7B, 4B, 8B
SHAPES = {"0.6b": (1024, 3072, 16, 8, 128), "1.7b": (2048, 6144, 16, 8, 128), "4b": (2560, 9728, 32, 8, 128),
          "8b": (4096, 12288, 32, 8, 128)}


def one_row(n: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, vocab, (1, n), generator=g)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, :64] = False                      # a 64-token prompt
    zeros = torch.zeros(1, n)
    batch = TrainBatch(tokens=tokens, loss_mask=mask, advantages=zeros + 0.5, token_rewards=zeros,
                       rollout_logprobs=zeros, attention_mask=torch.ones(1, n, dtype=torch.long),
                       weight_version=0).to("cuda")
    return take_rows(batch, [0], host=HostRows.of(batch))


def peak_step_bytes(model, forward, mb) -> int:
    """Peak allocated above what was allocated before the step (gradients already exist)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logprobs, entropy = forward(model, mb, True, False)
    (logprobs * mb.advantages).sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def slope(cfg, compiled: bool) -> float:
    """Bytes per token of a step's peak, for the model of `cfg` (built here, random, float32 weights)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to("cuda")
    if compiled:
        torch._dynamo.reset()   # each shape compiles afresh (one layer class: dynamo's recompile limit is 8)
        compile_decoder_layers(model)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16)

    forward = partial(hidden_forward, 1.0, autocast, torch.bfloat16, DEFAULT_CHUNK_ROWS)
    small, large = one_row(4096, cfg.vocab_size), one_row(8192, cfg.vocab_size)
    for mb in (small, large, small):         # compiles (dynamic shapes), and every gradient exists
        peak_step_bytes(model, forward, mb)
    out = (peak_step_bytes(model, forward, large) - peak_step_bytes(model, forward, small)) / (8192 - 4096)
    del model
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_planned_bytes_per_token_bound_the_step_on_the_gpu(shape, compiled):
    from transformers import Qwen3Config

    h, inter, heads, kv, head_dim = SHAPES[shape]

    def config(layers: int):
        return Qwen3Config(hidden_size=h, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                           head_dim=head_dim, num_hidden_layers=layers, vocab_size=4096, tie_word_embeddings=False)

    two, four = slope(config(2), compiled), slope(config(4), compiled)
    per_layer, rest = (four - two) / 2, two - (four - two)
    plan = {n: activation_bytes_per_token(config(n), compute_bytes=2, recompute=False, logits=False, compiled=compiled)
            for n in (1, 2, 36)}
    planned_layer = plan[2] - plan[1]
    eager_layer = (activation_bytes_per_token(config(2), compute_bytes=2, recompute=False, logits=False)
                   - activation_bytes_per_token(config(1), compute_bytes=2, recompute=False, logits=False))
    at_depth = 36 * per_layer + rest
    print("MEMORY_PLAN " + json.dumps({
        "shape": shape, "compiled": compiled, "per_layer_measured": round(per_layer), "per_layer_planned": planned_layer,
        "per_layer_over_eager_bound": round(per_layer / eager_layer, 3), "rest_measured": round(rest),
        "at_36_layers_measured": round(at_depth), "at_36_layers_planned": plan[36],
        "at_36_layers_over_planned": round(at_depth / plan[36], 3)}))
    assert per_layer <= planned_layer, f"{shape} compiled={compiled}: a layer keeps {per_layer:.0f} B/token, " \
                                       f"{planned_layer} planned"
    assert at_depth <= plan[36] / HEADROOM, f"{shape} compiled={compiled}: {at_depth:.0f} B/token at 36 layers, " \
                                            f"{plan[36]} planned with the headroom {HEADROOM}"
