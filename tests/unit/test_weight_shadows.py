"""--trainer-weight-shadows: the decoder's Linear weights cast to the compute dtype once a step
(`miles.training.shadows`) give autocast's numbers to the bit, on the policy and the critic, over
several steps; the float32 masters are back in place after every loop, error or not; a compiled
layer does not recompile for each step's new shadows."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.config.flags import parse_flags
from miles.config.schema import ConfigError
from miles.training.critic import Critic
from miles.training.forward import compile_decoder_layers
from miles.training.shadows import shadowable, weight_shadows
from miles.training.trainer import Trainer
from tests.unit.test_trainer import sample

QWEN3 = "examples/arithmetic/base_model_qwen3"
BF16 = torch.bfloat16


def samples(n=12, seed=0):
    rng = random.Random(seed)
    return [sample([rng.randrange(4, 24) for _ in range(rng.randrange(2, 12))],
                   [rng.randrange(4, 24) for _ in range(rng.randrange(1, 20))], rng.uniform(-1, 1)) for _ in range(n)]


def policy(shadows: bool, **train) -> Trainer:
    cfg = TrainConfig(**{"lr": 1e-3, "micro_batch_size": 4, "global_batch_size": 6, "weight_shadows": shadows, **train})
    algorithm = AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", use_kl_loss=True, kl_loss_coef=0.01,
                                entropy_coef=0.001)
    return Trainer(QWEN3, train=cfg, algorithm=algorithm, rollout=RolloutConfig(n_samples_per_prompt=4, batch_size=3),
                   device="cpu", dtype="bfloat16", hidden_forward=True)


def masters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("train", [{}, {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 96},
                                   {"recompute_activations": True}], ids=["rows", "packed", "recompute"])
def test_a_shadowed_policy_trains_bit_for_bit_like_autocast(train):
    plain, shadowed = policy(False, **train), policy(True, **train)
    assert shadowed._packed is bool(train.get("use_dynamic_batch_size"))
    seen = []      # the weight dtype a shadowed Linear computes with, at each call
    shadowable(shadowed.model)[0].register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    for rollout in range(3):        # two optimizer steps a rollout; a KL reference's no-grad pass
        batch = samples(seed=rollout)
        m_plain, m_shadowed = plain.train(batch, rollout), shadowed.train(batch, rollout)
        assert m_plain["loss"] == m_shadowed["loss"] and m_plain["grad_norm"] == m_shadowed["grad_norm"]
    assert seen and set(seen) == {BF16}        # every forward of the policy (the no-grad pass too) ran on a shadow
    a, b = masters(plain.model), masters(shadowed.model)
    assert all(torch.equal(a[n], b[n]) for n in a)
    # the weights changed, and every parameter the optimizer holds is the float32 master again
    assert any(not torch.equal(a[n], w) for n, w in masters(policy(False).model).items())
    params = {id(p) for g in shadowed._optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in shadowed.model.parameters()} == params
    assert all(p.dtype == torch.float32 for p in shadowed.model.parameters())


def test_a_shadowed_critic_trains_bit_for_bit_like_autocast():
    def critic(shadows):
        return Critic(QWEN3, train=TrainConfig(lr=1e-3, micro_batch_size=4, weight_shadows=shadows),
                      algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"), device="cpu",
                      dtype="bfloat16")
    plain, shadowed = critic(False), critic(True)
    batch = samples()
    for c in (plain, shadowed):
        values = c.values(batch)
        c.train(batch, values, values + 1.0, rollout_id=0)
    assert torch.equal(plain.values(batch), shadowed.values(batch))
    a, b = masters(plain._model), masters(shadowed._model)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_the_masters_come_back_on_an_error_and_frozen_weights_get_no_shadow():
    t = policy(True)
    model = t.model
    before = {id(p) for p in model.parameters()}
    linears = shadowable(model)
    assert linears and all(m.weight.dtype == torch.float32 for m in linears)
    linears[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="boom"):
        with weight_shadows(model, BF16) as count:
            assert count == len(linears) - 1            # the frozen one keeps its master
            assert linears[0].weight.dtype == torch.float32
            assert all(m.weight.dtype == BF16 for m in linears[1:])
            raise RuntimeError("boom")
    assert {id(p) for p in model.parameters()} == before
    with weight_shadows(model, BF16, grads=False) as count:   # no-grad passes shadow frozen weights too
        assert count == len(linears) and all(not m.weight.requires_grad for m in linears)
    with weight_shadows(model, torch.float32) as count:       # nothing to save at float32
        assert count == 0
    # the embeddings and the (tied) LM head are never shadowed
    assert model.get_output_embeddings() not in linears


@pytest.mark.extended   # out of the default run (CI budget): the CUDA case in tests/gpu/test_weight_shadows_gpu.py
def test_new_shadows_every_step_do_not_recompile_a_compiled_layer():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    t = policy(True)
    compile_decoder_layers(t.model, backend="aot_eager")
    t.train(samples(seed=0), 0)
    graphs = counters["stats"]["unique_graphs"]
    for rollout in (1, 2):
        t.train(samples(seed=0), rollout)          # the same shapes: anything new would be the shadows'
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_the_flag(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", QWEN3, "--prompt-data", str(data), "--rollout-batch-size", "1", "--num-rollout", "1",
            "--n-samples-per-prompt", "8"]
    assert parse_flags(base + ["--trainer-weight-shadows"])[0].train.weight_shadows is True
    assert parse_flags(base)[0].train.weight_shadows is False
    with pytest.raises(ConfigError, match="--trainer-weight-shadows: not supported by --train-backend megatron"):
        parse_flags(base + ["--train-backend", "megatron", "--trainer-weight-shadows"])
