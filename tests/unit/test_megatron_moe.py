"""Qwen3-MoE on the megatron backend (megatron-core's MoE layers; CPU over gloo; skipped without
megatron-core): the HF <-> megatron conversion of the experts is bit-exact whole and in expert-parallel
shards; one rank and EP 2 (two ranks over gloo, megatron's all-to-all token dispatcher) train exactly
like the torch trainer, with the same routing metrics and router losses; with R3 every response token
runs through the experts the rollout gave, in every MoE layer.

The ranks are spawned processes (megatron's parallel state is per process), as in
tests/integration/test_megatron_cpu.py, whose helpers these reuse.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles.training.megatron.checks import installed
from miles.training.megatron.conversion import (EXPERT, hf_to_mcore, mcore_to_hf, merge_ep, model_spec,
                                                per_expert_names, shard_ep)

needs_megatron = pytest.mark.skipif(not installed("megatron.core"), reason="needs megatron-core (pip install miles[megatron])")
RANK_TIMEOUT_S = 300
LAYERS, TOP_K, EXPERTS = 2, 2, 4          # tests.tiny_model's qwen3_moe: layers 1-2 MoE, four experts, top-2


def moe_model(path: Path) -> str:
    from tests.tiny_model import make_tiny_family

    return make_tiny_family(path, "qwen3_moe", seed=1, scale=0.2)


# --- conversion (no megatron-core needed) ------------------------------------------------------------
def test_qwen3_moe_round_trip_is_bit_exact_whole_and_in_ep2_shards(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles.weights.hf import model_weights

    path = moe_model(tmp_path / "m")
    spec = model_spec(json.loads((Path(path) / "config.json").read_text()))
    assert (spec.moe_layers, spec.num_experts, spec.top_k, spec.norm_topk_prob) == ((1, 2), EXPERTS, TOP_K, True)
    live = {n: t.detach().clone() for n, t in model_weights(AutoModelForCausalLM.from_pretrained(path)).items()}
    saved = load_file(str(Path(path) / "model.safetensors"))       # one tensor per expert, as save_pretrained writes
    assert "model.layers.1.mlp.experts.gate_up_proj" in live and "model.layers.1.mlp.experts.3.up_proj.weight" in saved
    mc = hf_to_mcore(live, spec)
    assert all(torch.equal(a, b) for a, b in zip(mc.values(), hf_to_mcore(saved, spec).values()))
    fc1 = mc[f"decoder.layers.2.{EXPERT}3.linear_fc1.weight"]          # expert 3: [gate; up]
    assert torch.equal(fc1, torch.cat([saved["model.layers.2.mlp.experts.3.gate_proj.weight"],
                                       saved["model.layers.2.mlp.experts.3.up_proj.weight"]]))
    assert torch.equal(mc["decoder.layers.1.mlp.router.weight"], live["model.layers.1.mlp.gate.weight"])
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mc and "decoder.layers.0.mlp.router.weight" not in mc
    for got, want in ((mcore_to_hf(mc, spec), live), (per_expert_names(mcore_to_hf(mc, spec), spec), saved)):
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    shards = [shard_ep(mc, spec, 2, r) for r in range(2)]
    # rank 1 holds experts 2 and 3 as its local 0 and 1; attention, router and dense layers on both
    assert torch.equal(shards[1][f"decoder.layers.1.{EXPERT}0.linear_fc2.weight"],
                       mc[f"decoder.layers.1.{EXPERT}2.linear_fc2.weight"])
    assert f"decoder.layers.1.{EXPERT}2.linear_fc2.weight" not in shards[1]
    assert all(torch.equal(s["decoder.layers.1.mlp.router.weight"], mc["decoder.layers.1.mlp.router.weight"])
               for s in shards)
    back = mcore_to_hf(merge_ep(shards, spec), spec)
    assert all(torch.equal(back[n], live[n]) for n in live)


# --- the ranks ----------------------------------------------------------------------------------------
def make_samples(rollout_id: int, n: int = 8, routed: bool = True):
    """Random samples; with `routed`, every response token carries random rollout experts [L][k]."""
    from miles.types import Prompt, Sample

    rng = random.Random(100 + rollout_id)
    out = []
    for i in range(n):
        response = [rng.randrange(4, 30) for _ in range(rng.randrange(1, 6))]
        experts = [[rng.sample(range(EXPERTS), TOP_K) for _ in range(LAYERS)] for _ in response] if routed else None
        out.append(Sample(prompt=Prompt(index=i, text="", prompt_ids=tuple(rng.randrange(4, 30) for _ in range(1 + i % 3))),
                          group=i // 2, response_ids=response, rollout_logprobs=[-2.0] * len(response),
                          finish_reason="stop", weight_version=0, reward=float(i % 2), advantage=rng.uniform(-1, 1),
                          rollout_routed_experts=experts))
    return out


def rank_body(worker, rollouts, checkpoint: str | None = None):
    """Train `rollouts`; the metrics, this rank's stage weights, and per rollout the old pass's routing and
    the batch's rollout experts (to compare). With `checkpoint`: saved there after the first rollout, loaded
    back after the last (`resumed`: the stage weights then)."""
    from miles.training.batch import make_train_batch

    metrics, old, saved = [], [], None
    for r in rollouts:
        samples = make_samples(r)
        worker.prepare_rollout(samples, r)
        batch = worker._prepared[1]
        old.append((None if batch.old_routed_experts is None else batch.old_routed_experts.clone(),
                    make_train_batch(samples, worker.pad_id).routed_experts))
        if r == rollouts[0]:                # the old-logprob pass, per token, before any step
            first_logprobs = (batch.old_logprobs.clone(), batch.loss_mask.clone())
        metrics.append(worker.train(samples, r))
        if checkpoint and r == rollouts[0]:
            worker.save(checkpoint)
            saved = worker.stage_weights()
    out = {"metrics": metrics, "stage": worker.stage_weights(), "old": old, "saved": saved,
           "logprobs": first_logprobs}
    if checkpoint:
        worker.load(checkpoint)
        out["resumed"] = worker.stage_weights()
    return out


def run_rank(rank, world, port, model, cfg, rollouts, out_dir, checkpoint=None):
    from miles.training.megatron.worker import MegatronWorker

    try:
        train, algorithm, rollout = cfg
        worker = MegatronWorker(model, train=train, algorithm=algorithm, rollout=rollout, rank=rank, world_size=world,
                                device_type="cpu")
        worker.setup("127.0.0.1", port)
        result = rank_body(worker, rollouts, checkpoint)
        worker.dispose()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(world: int, model: str, cfg, out_dir: Path, rollouts, checkpoint: str | None = None) -> list[dict]:
    from tests.integration.test_megatron_cpu import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, world, port, model, cfg, rollouts, str(out_dir), checkpoint))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(RANK_TIMEOUT_S)
    errors = [f.read_text() for f in sorted(out_dir.glob("*.err"))]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not errors and all(p.exitcode == 0 for p in procs), "\n".join(errors) or [p.exitcode for p in procs]
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def torch_run(model: str, cfg, rollouts, logprobs: list | None = None) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The torch trainer's metrics and final weights; into `logprobs` its [B, T] logprobs of the first
    rollout's batch before any step (R3 replayed as in its old-logprob pass)."""
    from miles.training.batch import make_train_batch
    from miles.training.torch.trainer import Trainer

    train, algorithm, rollout = cfg
    trainer = Trainer(model, train=train, algorithm=algorithm, rollout=rollout, device="cpu")
    if logprobs is not None:
        samples = make_samples(rollouts[0])
        with torch.no_grad():
            logprobs.append(trainer._logprobs(trainer._model, make_train_batch(samples, trainer.pad_id)))
        trainer._moe.stats = type(trainer._moe.stats)()     # this extra forward is not the rollout's: uncounted
    metrics = [trainer.train(make_samples(r), r) for r in rollouts]
    return metrics, trainer.weights()


def configs(**train_fields):
    from tests.integration.test_megatron_cpu import configs as dense_configs

    train, algorithm, rollout = dense_configs()
    return replace(train, **train_fields), algorithm, rollout


ROUTER_LOSSES = dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
R3 = dict(use_rollout_routing_replay=True, use_routing_replay=True)


@needs_megatron
@pytest.mark.slow
# CI budget: the one-rank router-loss case and PP 2 are extended (the EP 2 router-loss twin, in CI, checks the
# same and more)
@pytest.mark.parametrize("ep,pp,flags", [(1, 1, R3), (2, 1, R3),
                                         pytest.param(1, 1, ROUTER_LOSSES, marks=pytest.mark.extended),
                                         (2, 1, ROUTER_LOSSES), pytest.param(1, 2, R3, marks=pytest.mark.extended)],
                         ids=["r3-one-rank", "r3-ep2", "router-losses-one-rank", "router-losses-ep2", "r3-pp2"])
def test_megatron_moe_trains_like_the_torch_trainer(tmp_path, ep, pp, flags):
    """The logprobs (logprob_diff_rollout), the loss and its gradient (grad_norm), the weights after two
    rollouts, the routing metrics and the router losses: the torch trainer's, on one rank, with the
    experts split over 2 expert-parallel ranks (data-parallel ranks too: each runs half the rows), and over
    2 pipeline stages (layers 0-1 and 2: one MoE layer each; a token's "any layer differs" spans both)."""
    from tests.integration.test_megatron_cpu import assert_same_training, hf_weights

    model = moe_model(tmp_path / "m")
    stages = dict(pipeline_model_parallel_size=2, first_pipeline_stage_layers=2) if pp > 1 else {}
    cfg = configs(expert_model_parallel_size=ep, **stages, **flags)
    torch_logprobs: list = []
    want, want_w = torch_run(model, cfg, [0, 1], torch_logprobs)
    checkpoint = str(tmp_path / "ckpt") if flags is ROUTER_LOSSES else None     # the experts' dist checkpoint shards
    results = run_ranks(ep * pp, model, cfg, tmp_path / "run", [0, 1], checkpoint)
    got = results[0]["metrics"]
    # per token: megatron's old-logprob pass equals the torch trainer's on every response token
    mine, mask = results[0]["logprobs"]
    theirs = torch_logprobs[0][:, :mine.shape[1]]
    assert int(mask.sum()) > 10
    assert torch.allclose(mine[mask], theirs[mask], rtol=0, atol=2e-5), float((mine[mask] - theirs[mask]).abs().max())
    assert_same_training(got, want, hf_weights(results, model), want_w)
    if checkpoint:       # saved after rollout 0, loaded after rollout 1: rollout 0's weights again, every expert
        saved, resumed = results[0]["saved"], results[0]["resumed"]
        assert sorted(saved) == sorted(resumed) and any(EXPERT in n for n in saved)
        assert all(torch.equal(saved[n], resumed[n]) for n in saved)
        assert not torch.equal(saved[f"decoder.layers.2.{EXPERT}3.linear_fc1.weight"],
                               results[0]["stage"][f"decoder.layers.2.{EXPERT}3.linear_fc1.weight"])
    moe_keys = [k for k in want[0] if k.startswith("moe/")]
    expected = {"moe/router_entropy", "moe/routing_mismatch", "moe/routing_replayed", "moe/layer1/tokens_per_expert_max"}
    assert expected | ({"moe/moe_aux_loss", "moe/moe_z_loss"} if flags is ROUTER_LOSSES else set()) <= set(moe_keys)
    for g, w in zip(got, want):
        for k in moe_keys:
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (k, g[k], w[k])
    assert got[0]["moe/routing_replayed"] == (1.0 if flags is R3 else 0.0)
    assert got[0]["moe/routing_mismatch"] > 0          # the samples' experts are random: the router's differ
    if flags is not R3:
        return
    # R3: the old pass ran every response token (and the prompt's last) through the rollout's experts, per layer
    for r in results:
        for old, given in r["old"]:
            has = given[..., 0, 0] >= 0
            assert int(has.sum()) > 10
            for layer in range(LAYERS):
                assert torch.equal(old[has][:, layer].sort(-1).values, given[has][:, layer].sort(-1).values), layer


@needs_megatron
@pytest.mark.slow
@pytest.mark.extended      # CI budget
def test_without_r3_the_old_pass_routes_by_its_own_top_k_and_the_steps_replay_it(tmp_path):
    # --use-routing-replay alone: the old pass routes by the router's own top-k (recorded); the two steps
    # replay it, so half the forwards that see the rollout's tokens run replayed experts, as on the torch trainer
    model = moe_model(tmp_path / "m")
    cfg = configs(use_routing_replay=True)
    want = torch_run(model, cfg, [0])[0][0]
    results = run_ranks(1, model, cfg, tmp_path / "run", [0])
    got = results[0]["metrics"][0]
    for k in ("moe/routing_replayed", "moe/routing_mismatch", "moe/router_entropy", "logprob_diff_rollout", "loss"):
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert got["moe/routing_replayed"] == 0.5
    old, given = results[0]["old"][0]
    has = given[..., 0, 0] >= 0
    assert not torch.equal(old[has].sort(-1).values, given[has].sort(-1).values)     # its own, not the rollout's
