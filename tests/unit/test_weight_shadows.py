"""--trainer-weight-shadows: the decoder's Linear weights cast to the compute dtype once a step
(`miles.training.torch.shadows`) give autocast's numbers to the bit, on the policy and the critic, over
several steps; the float32 masters are back in place after every loop, error or not; a compiled
layer does not recompile for each step's new shadows. --gradient-accumulation-fusion: the weight
gradients add up in float32 inside the matmuls, nearer the exact sums than autocast's, through
compiled layers too."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.config.flags import parse_flags
from miles.config.schema import ConfigError
from miles.training.batch import make_train_batch
from miles.training.torch.critic import Critic
from miles.training.torch.forward import compile_decoder_layers
from miles.training.torch.shadows import FusedWgradLinear, accumulate_weight_grad, shadowable, weight_shadows
from miles.training.torch.trainer import Trainer
from tests.unit.test_trainer import sample

QWEN3 = "examples/arithmetic/base_model_qwen3"
BF16 = torch.bfloat16


def samples(n=12, seed=0):
    rng = random.Random(seed)
    return [sample([rng.randrange(4, 24) for _ in range(rng.randrange(2, 12))],
                   [rng.randrange(4, 24) for _ in range(rng.randrange(1, 20))], rng.uniform(-1, 1)) for _ in range(n)]


def policy(shadows: bool, fuse: bool = False, **train) -> Trainer:
    cfg = TrainConfig(**{"lr": 1e-3, "micro_batch_size": 4, "global_batch_size": 6, "weight_shadows": shadows,
                         "grad_accum_fusion": fuse, **train})
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
    assert not parse_flags(base)[0].train.shadows
    with pytest.raises(ConfigError, match="--trainer-weight-shadows: not supported by --train-backend megatron"):
        parse_flags(base + ["--train-backend", "megatron", "--trainer-weight-shadows"])
    fused = parse_flags(base + ["--gradient-accumulation-fusion"])[0].train
    assert fused.grad_accum_fusion and fused.shadows          # the fusion needs the shadows: it implies them
    with pytest.raises(ConfigError, match="--gradient-accumulation-fusion: not supported by --train-backend megatron"):
        parse_flags(base + ["--train-backend", "megatron", "--gradient-accumulation-fusion"])
    with pytest.raises(ConfigError, match="--lora-rank 4 with --gradient-accumulation-fusion"):
        parse_flags(base + ["--lora-rank", "4", "--gradient-accumulation-fusion"])


# ---- --gradient-accumulation-fusion -----------------------------------------------------------------

def test_the_fused_weight_gradient_is_the_float32_sum_nearer_the_exact_one_than_autocasts():
    torch.manual_seed(0)
    lin = nn.Linear(48, 40, bias=True)
    xs = [torch.randn(3, 7, 48) for _ in range(4)]                 # four micro-batches
    exact = torch.zeros(40, 48, dtype=torch.float64)
    for x in xs:       # the loss: sum(out * 0.1 * out's index); its gradient reaches the bf16 output rounded
        g = (torch.arange(40) * 0.1).to(BF16).double().expand(3, 7, 40)
        exact += g.reshape(-1, 40).t() @ x.to(BF16).double().reshape(-1, 48)

    def run(fuse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lin.zero_grad(set_to_none=True)
        inputs = [x.clone().requires_grad_(True) for x in xs]
        with weight_shadows(lin, BF16, fuse=fuse) as count, torch.autocast("cpu", dtype=BF16):
            assert count == 1 and isinstance(lin, FusedWgradLinear) is fuse
            for x in inputs:
                (lin(x).float() * torch.arange(40) * 0.1).sum().backward()
        assert type(lin) is nn.Linear and not hasattr(lin, "main_grad") and lin.weight.dtype == torch.float32
        return lin.weight.grad.clone(), lin.bias.grad.clone(), torch.stack([x.grad for x in inputs])

    def err(g):
        return float((g.double() - exact).abs().max() / exact.abs().max())

    fused_w, fused_b, fused_x = run(True)
    plain_w, plain_b, plain_x = run(False)
    assert fused_w.dtype == torch.float32 and not torch.equal(fused_w, plain_w)
    assert err(fused_w) < 1e-6 < err(plain_w)         # float32 sums against bf16-rounded products
    assert torch.equal(fused_b, plain_b) and torch.equal(fused_x, plain_x)   # the rest is autocast's


def test_a_linear_subclass_keeps_its_forward_and_folds_its_shadows_gradient():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(8, 8), nn.Linear(8, 8))
    x = torch.randn(5, 8)
    want = {}
    for fuse in (False, True):
        model.zero_grad(set_to_none=True)
        with weight_shadows(model, BF16, fuse=fuse), torch.autocast("cpu", dtype=BF16):
            assert type(model[0]) is Scaled and isinstance(model[1], FusedWgradLinear) is fuse
            model(x).float().sum().backward()
        assert [type(m) for m in model] == [Scaled, nn.Linear]
        want[fuse] = [m.weight.grad.clone() for m in model]
    assert torch.equal(want[True][0], want[False][0])          # the subclass: the fold, autocast's numbers
    assert torch.allclose(want[True][1], want[False][1], rtol=1e-2, atol=1e-2)


def test_accumulate_weight_grad_adds_into_the_gradient_in_place():
    g, x = torch.randn(5, 3, dtype=BF16), torch.randn(5, 4, dtype=BF16)
    main = torch.ones(3, 4)
    before = main.data_ptr()
    accumulate_weight_grad(main, g, x)
    assert main.data_ptr() == before
    assert torch.allclose(main, 1 + g.float().t() @ x.float(), atol=1e-6)


@pytest.mark.parametrize("train", [{}, {"recompute_activations": True}], ids=["rows", "recompute"])
def test_a_fused_policy_takes_autocasts_gradients_to_rounding_and_gives_its_modules_back(train):
    grads = {}
    for fuse in (False, True):
        t = policy(False, fuse=fuse, **train)
        linears = shadowable(t.model)
        t.accumulate_gradients(t.prepare(make_train_batch(samples(seed=0), t.pad_id)))
        grads[fuse] = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        assert all(type(m) is nn.Linear and not hasattr(m, "main_grad") for m in linears)
        assert all(p.dtype == torch.float32 for p in t.model.parameters())
        before = masters(t.model)
        metrics = t.train(samples(seed=1), 1)               # whole steps run, and change the weights
        assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert any(not torch.equal(before[n], w) for n, w in masters(t.model).items())
    plain, fused = grads[False], grads[True]
    assert plain.keys() == fused.keys()
    linear_weights = {n for n in plain if n.endswith("proj.weight")}
    assert linear_weights and all(not torch.equal(plain[n], fused[n]) for n in linear_weights)
    for n, g in plain.items():         # the same gradients but for bf16 roundings of the products
        assert float((fused[n] - g).norm() / g.norm().clamp_min(1e-12)) < 2e-2, n


@pytest.mark.extended   # ~27 s of compiling on 2 cores (CI budget); tests/gpu/test_weight_shadows_gpu.py compiles it on CUDA
def test_fused_gradients_through_a_compiled_layer_equal_the_eager_ones_and_compile_once():
    from torch._dynamo.utils import counters

    grads = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        t = policy(False, fuse=True)
        if compiled:
            compile_decoder_layers(t.model, backend="aot_eager")
        graphs = []
        for _ in range(2):               # the same shapes again: a new graph would be the new shadows'
            t._optimizer.zero_grad(set_to_none=True)
            t.accumulate_gradients(t.prepare(make_train_batch(samples(seed=0), t.pad_id)))
            graphs.append(counters["stats"]["unique_graphs"])
        grads[compiled] = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        if compiled:
            assert graphs[0] > 0 and graphs[0] == graphs[1], graphs
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.allclose(grads[True][n], g, rtol=1e-4, atol=1e-6) for n, g in grads[False].items())
    torch._dynamo.reset()
