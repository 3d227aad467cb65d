"""Qwen3-MoE on the embedded engine and the torch trainer (CPU; the fast engine's own tests: test_fast_engine_moe.py): the engine's parity with transformers and
its routing record, rollout routing replay (R3) and the old pass's replay, the router losses against
numbers derived by hand, the routing metrics, weight sync / checkpoint / HF export, two FSDP2 ranks
against one process, and the start-up refusals of what is not built (miles/training/moe.py,
miles/training/moe_checks.py, docs/moe.md)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.config import AlgorithmConfig, ConfigError, RolloutConfig, TrainConfig
from miles.config.flags import parse_flags
from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.training.batch import make_train_batch
from miles.training.moe import load_balancing_loss, z_loss
from miles.training.torch.trainer import Trainer
from miles.types import Prompt, Sample, SamplingParams
from tests.tiny_model import make_tiny_family
from tests.unit.test_fast_engine import EOS_ID, PROMPTS, forward_logprobs, reference_greedy

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
MOE_LAYERS = [1, 2]          # tiny_config("qwen3_moe"): layer 0 is dense (mlp_only_layers)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_family(tmp_path_factory.mktemp("moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def hf(moe_path):
    return AutoModelForCausalLM.from_pretrained(moe_path).eval()


def hf_topk(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), L, k] the plain transformers forward's top-k experts per position and MoE layer."""
    out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([torch.topk(torch.softmax(r.float(), -1), k, -1).indices for r in out.router_logits], dim=1)


def trainer(path, **train) -> Trainer:
    algo = {k: train.pop(k) for k in list(train) if k in AlgorithmConfig.__dataclass_fields__}
    return Trainer(path, train=TrainConfig(**{"lr": 1e-2, **train}),
                   algorithm=AlgorithmConfig(**{"loss_agg_mode": "token_mean", **algo}),
                   rollout=RolloutConfig(batch_size=2, n_samples_per_prompt=2), device="cpu")


def samples_of(prompts, gens, reward=lambda i: float(i % 2)) -> list[Sample]:
    out = []
    for i, (p, g) in enumerate(zip(prompts, gens)):
        out.append(Sample(prompt=Prompt(index=i, text="", prompt_ids=tuple(p)), group=i // 2,
                          response_ids=list(g.response_ids), rollout_logprobs=list(g.logprobs), finish_reason="stop",
                          weight_version=0, reward=reward(i), advantage=1.0 if i % 2 else -1.0,
                          rollout_routed_experts=g.routed_experts))
    return out


def test_engine_greedy_tokens_logprobs_and_routing_equal_a_transformers_forward(moe_path, hf):
    engine = EmbeddedEngine(moe_path, device="cpu", max_batch_size=3)
    gens = engine.generate(PROMPTS, GREEDY)
    assert any(len(g.response_ids) > 4 for g in gens)
    for prompt, g in zip(PROMPTS, gens):
        ids, lps = reference_greedy(hf, prompt, GREEDY.max_new_tokens)
        assert g.response_ids == ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, lps)) < 1e-5
        # each sampled token's experts are those of the position that produced its logits, per MoE layer
        want = hf_topk(hf, prompt + ids)[len(prompt) - 1:len(prompt) - 1 + len(ids)]
        got = torch.tensor(g.routed_experts)
        assert got.shape == (len(ids), len(MOE_LAYERS), 2)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_engine_sampled_logprobs_equal_a_full_forward(moe_path, hf):
    gens = EmbeddedEngine(moe_path, device="cpu", seed=1).generate(
        PROMPTS, SamplingParams(temperature=0.9, max_new_tokens=10, seed=4))
    for prompt, g in zip(PROMPTS, gens):
        ref = forward_logprobs(hf, prompt, g.response_ids, 0.9)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < 1e-4


def test_the_train_batch_puts_each_tokens_routing_at_the_position_that_produced_it():
    p = Prompt(index=0, text="", prompt_ids=(5, 6, 7))
    routed = [[[0, 1]], [[2, 3]], []]            # the third token is a tool token: no routing
    s = Sample(prompt=p, group=0, response_ids=[8, 9, 10], rollout_logprobs=[-1.0] * 3, finish_reason="stop",
               weight_version=0, rollout_routed_experts=routed)
    dense = Sample(prompt=p, group=0, response_ids=[8], rollout_logprobs=[-1.0], finish_reason="stop", weight_version=0)
    batch = make_train_batch([s, dense], pad_id=0)
    assert batch.routed_experts.shape == (2, 6, 1, 2)
    assert batch.routed_experts[0, :, 0].tolist() == [[-1, -1], [-1, -1], [0, 1], [2, 3], [-1, -1], [-1, -1]]
    assert (batch.routed_experts[1] == -1).all()
    s.rollout_routed_experts = routed[:2]
    with pytest.raises(ValueError, match="the routing of 2"):
        make_train_batch([s], pad_id=0)


def routing_sample(routed, prompt_ids=(5, 6)) -> Sample:
    return Sample(prompt=Prompt(index=0, text="", prompt_ids=tuple(prompt_ids)), group=0,
                  response_ids=[8] * len(routed), rollout_logprobs=[-1.0] * len(routed), finish_reason="stop",
                  weight_version=0, rollout_routed_experts=routed)


def test_the_train_batch_reads_numpy_list_and_empty_entries_alike():
    # 2 MoE layers, top-2. Sample a: a fast-engine token (uint8 array), a tool token ([]), a checkpoint's
    # token (lists), another array (int16, past 256 experts); sample b: all arrays; c: dense
    a = [[[0, 1], [2, 3]], [], [[4, 5], [6, 7]], [[1, 0], [3, 2]]]
    b = [[[7, 6], [5, 4]], [[3, 1], [2, 0]]]
    mixed_a = [np.asarray(a[0], np.uint8), [], a[2], np.asarray(a[3], np.int16)]
    mixed_b = list(np.asarray(b, np.uint8))
    whole_b = np.asarray(b, np.uint8)            # the fast engine's: one array [tokens, layers, k]
    dense = routing_sample([])
    dense.rollout_routed_experts = None
    want = make_train_batch([routing_sample(a), routing_sample(b), dense], pad_id=0).routed_experts
    got = make_train_batch([routing_sample(mixed_a), routing_sample(mixed_b), dense], pad_id=0).routed_experts
    assert got.dtype == torch.int64 and got.shape == (3, 6, 2, 2)
    assert torch.equal(got, want)
    whole = make_train_batch([routing_sample(mixed_a), routing_sample(whole_b), dense], pad_id=0).routed_experts
    assert torch.equal(whole, want)
    only_arrays = make_train_batch([routing_sample(whole_b), dense], pad_id=0).routed_experts  # the shape from an array
    assert only_arrays.shape == (2, 4, 2, 2) and torch.equal(only_arrays, want[1:, :4])
    # prompt (5, 6): response token t's routing sits at position 1 + t; the tool token's and the rest: -1
    assert got[0, 1:5].tolist() == [a[0], [[-1, -1]] * 2, a[2], a[3]]
    assert got[1, 1:3].tolist() == b and (got[1, 3:] == -1).all() and (got[2] == -1).all()


def test_sample_append_and_settle_keep_the_fast_engines_arrays_aligned():
    from miles.rollout.generation import settle

    s = routing_sample([], prompt_ids=(5,))
    s.rollout_routed_experts = None
    s.append([8, 9], [-0.5, -0.5], trained=True, routed_experts=np.asarray([[[0, 1]], [[1, 2]]], np.uint8))
    s.append([5], [-0.2], trained=True, routed_experts=np.asarray([[[3, 0]]], np.uint8))
    assert isinstance(s.rollout_routed_experts, np.ndarray)            # two turns of the fast engine: one array
    assert s.rollout_routed_experts.tolist() == [[[0, 1]], [[1, 2]], [[3, 0]]]
    s.response_ids.append(3)
    settle(s, "failed", "boom", lambda ids: "")                        # an array is cut by slicing
    assert s.rollout_routed_experts.shape == (3, 1, 2) and len(s.response_ids) == 3
    s.append([4], trained=False)                 # a tool turn
    s.append([7], [-0.1], trained=True, routed_experts=[[[2, 3]]])      # an embedded engine's lists
    assert [np.asarray(r).tolist() for r in s.rollout_routed_experts] == [[[0, 1]], [[1, 2]], [[3, 0]], [], [[2, 3]]]
    s.response_ids.append(3)
    settle(s, "failed", "boom", lambda ids: "")
    assert len(s.rollout_routed_experts) == len(s.response_ids) == 5
    # prompt (5,): response token t's routing at position t; the last position produced no response token
    want = [[0, 1], [1, 2], [3, 0], [-1, -1], [2, 3], [-1, -1]]
    assert make_train_batch([s], pad_id=0).routed_experts[0, :, 0].tolist() == want


def test_sample_append_and_settle_keep_the_routing_aligned():
    from miles.rollout.generation import settle

    s = Sample(prompt=Prompt(index=0, text="", prompt_ids=(5,)), group=0, response_ids=[], rollout_logprobs=[],
               finish_reason="stop", weight_version=0)
    s.append([8, 9], [-0.5, -0.5], trained=True, routed_experts=[[[0, 1]], [[1, 2]]])
    s.append([4], trained=False)                 # a tool turn
    s.append([7], [-0.1], trained=True, routed_experts=[[[2, 3]]])
    assert s.rollout_routed_experts == [[[0, 1]], [[1, 2]], [], [[2, 3]]]
    s.response_ids.append(3)                     # a generate function that returned more ids than the rest
    settle(s, "failed", "boom", lambda ids: "")
    assert len(s.rollout_routed_experts) == len(s.response_ids) == 4


def test_partial_rollout_continuation_extends_the_routing():
    from miles.rollout.executor import _extend
    from miles.rollout.partial import continuation
    from miles.types import Generation

    s = Sample(prompt=Prompt(index=0, text="", prompt_ids=(5,)), group=0, response_ids=[], rollout_logprobs=[],
               finish_reason="abort", weight_version=0)
    _extend(s, Generation([8, 9], [-1.0, -1.0], "abort", 1, [[[0, 1]], [[1, 2]]]))
    cont = continuation(s, mask_old=False)
    _extend(cont, Generation([7], [-1.0], "stop", 2, [[[2, 3]]]))
    assert cont.rollout_routed_experts == [[[0, 1]], [[1, 2]], [[2, 3]]]
    assert s.rollout_routed_experts == [[[0, 1]], [[1, 2]]]          # the buffer's own is untouched
    # the partial-rollout buffer's checkpoint (rollout.json) carries it
    import json

    from miles.rollout.partial import PartialBuffer

    buffer = PartialBuffer(RolloutConfig(batch_size=1, n_samples_per_prompt=1, partial_rollout=True))
    buffer.add([[s]])
    resumed = PartialBuffer(RolloutConfig(batch_size=1, n_samples_per_prompt=1, partial_rollout=True))
    resumed.load_state_dict(json.loads(json.dumps(buffer.state_dict())), {0: s.prompt})
    assert resumed._groups[0][0].rollout_routed_experts == [[[0, 1]], [[1, 2]]]


def test_a_continued_sample_joins_a_checkpoints_lists_and_the_fast_engines_arrays():
    from miles.rollout.executor import _extend
    from miles.rollout.partial import PartialBuffer, continuation
    from miles.types import Generation

    s = routing_sample([], prompt_ids=(5,))
    s.rollout_routed_experts, s.finish_reason = None, "abort"
    _extend(s, Generation([8, 9], [-1.0, -1.0], "abort", 1, np.asarray([[[0, 1]], [[1, 2]]], np.uint8)))
    config = RolloutConfig(batch_size=1, n_samples_per_prompt=1, partial_rollout=True)
    buffer = PartialBuffer(config)
    buffer.add([[s]])
    resumed = PartialBuffer(config)             # rollout.json: the buffer's arrays come back as lists
    resumed.load_state_dict(json.loads(json.dumps(buffer.state_dict())), {0: s.prompt})
    back = resumed._groups[0][0]
    assert back.rollout_routed_experts == [[[0, 1]], [[1, 2]]]
    for before in (s, back):                    # an array then an array; lists then an array
        cont = continuation(before, mask_old=False)
        _extend(cont, Generation([7, 6], [-1.0, -1.0], "stop", 2, np.asarray([[[2, 3]], [[3, 0]]], np.uint8)))
        assert len(cont.rollout_routed_experts) == len(cont.response_ids) == 4
        assert isinstance(cont.rollout_routed_experts, np.ndarray) == (before is s)    # arrays join into one
        assert [np.asarray(r).tolist() for r in cont.rollout_routed_experts] == [[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]]]
        assert make_train_batch([cont], pad_id=0).routed_experts[0, :4, 0].tolist() == [[0, 1], [1, 2], [2, 3], [3, 0]]
        assert len(before.rollout_routed_experts) == 2         # the buffer's own is untouched
    # a call that records no routing (None): its tokens carry none
    cont = continuation(back, mask_old=False)
    _extend(cont, Generation([7], [-1.0], "stop", 2, None))
    assert cont.rollout_routed_experts == [[[0, 1]], [[1, 2]], []]


def perturb_routers(model, scale: float, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in MOE_LAYERS:
            w = model.model.layers[layer].mlp.gate.weight
            w.add_(torch.randn(w.shape, generator=g) * scale)


@pytest.mark.parametrize("engine_cls", ["embedded", "fast"])
def test_r3_routes_every_response_token_as_the_engine_did_per_layer(moe_path, engine_cls):
    from miles.rollout.engines.fast.engine import FastEngine

    engine = (EmbeddedEngine if engine_cls == "embedded" else FastEngine)(moe_path, device="cpu", seed=0)
    prompts = PROMPTS * 2
    gens = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    samples = samples_of(prompts, gens)
    t = trainer(moe_path, use_rollout_routing_replay=True, micro_batch_size=8)
    perturb_routers(t.model, 0.5)                # the trainer's own routing now differs from the rollout's
    batch = make_train_batch(samples, t.pad_id)
    t._forward(t.model, batch, False, False)
    applied = t._moe.routing.applied().view(*batch.tokens.shape, len(MOE_LAYERS), 2)
    own = t._moe.routing.own().view(*batch.tokens.shape, len(MOE_LAYERS), 2)
    differs = 0
    for i, s in enumerate(samples):
        start = len(s.prompt.prompt_ids) - 1
        rollout = torch.from_numpy(np.asarray(s.rollout_routed_experts, np.int64))    # fast: arrays, embedded: lists
        for layer in range(len(MOE_LAYERS)):
            assert torch.equal(applied[i, start:start + s.response_length, layer], rollout[:, layer])
        differs += int((own[i, start:start + s.response_length].sort(-1).values != rollout.sort(-1).values).any(-1).sum())
    assert differs > 0          # replay changed something: the trainer's own top-k was not the rollout's
    metrics = t.train(samples, rollout_id=0)
    assert metrics["moe/routing_replayed"] == 1.0
    assert 0 < metrics["moe/routing_mismatch"] <= 1
    # the router trains through the replayed gate weights
    assert all(torch.isfinite(t.model.model.layers[layer].mlp.gate.weight).all() for layer in MOE_LAYERS)


def test_compiled_moe_layers_replay_route_and_train_as_eager_ones(moe_path):
    # --trainer-compile on an MoE model: the routing hooks (their records, the replayed experts) run inside the
    # compiled layers. Dynamo's tracing does not depend on the backend: a counting one runs its graphs on the
    # CPU, and each compiled trainer must route every token, report and step exactly as the eager one.
    from torch._dynamo.testing import CompileCounter

    from miles.training.torch.forward import compile_decoder_layers

    engine = EmbeddedEngine(moe_path, device="cpu", seed=0)
    prompts = PROMPTS * 2
    samples = samples_of(prompts, engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)))
    torch._dynamo.reset()
    try:
        runs = []
        for compiled in (False, True):
            t = trainer(moe_path, use_rollout_routing_replay=True, micro_batch_size=8)
            perturb_routers(t.model, 0.5)        # replay matters: the trainer's own top-k is not the rollout's
            counter = CompileCounter()
            if compiled:
                assert compile_decoder_layers(t.model, backend=counter) == t.model.config.num_hidden_layers
            batch = make_train_batch(samples, t.pad_id)
            t._forward(t.model, batch, False, False)
            applied = t._moe.routing.applied()
            metrics = t.train(samples, rollout_id=0)
            runs.append((applied, metrics, [p.detach().clone() for p in t.model.parameters()], counter.frame_count))
        (applied, metrics, params, _), (c_applied, c_metrics, c_params, frames) = runs
        assert frames >= 1                      # the layers did run compiled
        assert torch.equal(c_applied, applied)
        assert c_metrics["moe/routing_replayed"] == metrics["moe/routing_replayed"] == 1.0
        for key in ("loss", "grad_norm", "moe/routing_mismatch", "moe/router_entropy"):
            assert c_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(c_params, params))
    finally:
        torch._dynamo.reset()

def test_without_replay_a_near_tied_router_shows_a_routing_mismatch(tmp_path):
    # near-tied router logits (tiny router weights) + a bf16 engine against the fp32 trainer: the rollout's
    # top-k and the trainer's differ on some tokens, and the metric says how often; R3 replays them all
    path = make_tiny_family(tmp_path / "tied", "qwen3_moe", seed=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():        # every expert's row the same, plus a little noise: logits equal to ~1e-3
        for layer in MOE_LAYERS:
            w = model.model.layers[layer].mlp.gate.weight
            w.copy_(w[:1] + 1e-3 * torch.randn_like(w))
    model.save_pretrained(path)
    engine = EmbeddedEngine(path, device="cpu", dtype="bfloat16", seed=0)
    prompts = PROMPTS * 2
    samples = samples_of(prompts, engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)))
    plain = trainer(path, lr=0.0).train(samples, rollout_id=0)
    assert plain["moe/routing_mismatch"] > 0 and plain["moe/routing_replayed"] == 0.0
    replayed = trainer(path, lr=0.0, use_rollout_routing_replay=True)
    replayed.train(samples, rollout_id=0)        # its applied routing is the rollout's (the test above); here
    batch = make_train_batch(samples, replayed.pad_id)       # the same mismatch shows as the router's own view
    replayed._forward(replayed.model, batch, False, False)
    applied = replayed._moe.routing.applied().view(*batch.tokens.shape, len(MOE_LAYERS), 2)
    rollout = batch.routed_experts
    has = rollout[..., 0, 0] >= 0
    assert torch.equal(applied[has].sort(-1).values, rollout[has].sort(-1).values)


def test_use_routing_replay_trains_with_the_old_pass_routing(moe_path):
    engine = EmbeddedEngine(moe_path, device="cpu", seed=0)
    samples = samples_of(PROMPTS, engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)))
    t = trainer(moe_path, use_routing_replay=True, global_batch_size=2, micro_batch_size=2)   # 2 steps: an old pass
    t.prepare_rollout(samples, rollout_id=0)
    batch = t._prepared[1]
    assert batch.old_routed_experts is not None
    real = batch.attention_mask.bool()
    assert (batch.old_routed_experts[real] >= 0).all()
    # a training forward after the first step (other weights) still routes as the old pass did
    perturb_routers(t.model, 0.5)
    with torch.enable_grad():
        t._forward(t.model, batch, False, False)
    applied = t._moe.routing.applied().view(*batch.tokens.shape, len(MOE_LAYERS), 2)
    assert torch.equal(applied[real], batch.old_routed_experts[real])
    assert t.train(samples, rollout_id=0)["num_steps"] == 2


def test_router_losses_match_hand_derived_numbers():
    # E = 2, k = 1, two tokens: softmax [1/2, 1/2] and [3/4, 1/4]; routed to experts 0 and 1
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    experts = torch.tensor([[0], [1]])
    # P = [1.25, 0.75], n = [1, 1]: E / (k T^2) x sum_e P_e n_e = 2 / 4 x 2 = 1
    assert load_balancing_loss(logits, experts, 2, 1).item() == pytest.approx(1.0)
    # per sequence (one token each): 2 x 1/2 = 1 and 2 x 1/4 = 1/2, averaged: 3/4
    assert load_balancing_loss(logits, experts, 2, 1, torch.tensor([0, 1])).item() == pytest.approx(0.75)
    # logsumexp: ln 2 and ln 4 = 2 ln 2; the mean of their squares: 5/2 (ln 2)^2
    assert z_loss(logits).item() == pytest.approx(2.5 * math.log(2.0) ** 2)


def test_expert_counts_are_the_picks_per_layer_and_expert():
    from miles.training.moe import expert_counts

    applied = torch.tensor([[[0, 2], [1, 3]], [[2, 3], [1, 0]]])       # 2 positions, 2 layers, top-2 of 4
    assert expert_counts(applied, 4).tolist() == [[1, 0, 2, 1], [1, 2, 0, 1]]
    picks = torch.stack([torch.randperm(16)[:4] for _ in range(300 * 3)]).view(300, 3, 4)
    want = torch.nn.functional.one_hot(picks, 16).sum(dim=(0, 2)).float()
    assert torch.equal(expert_counts(picks, 16), want)

def test_routing_stats_leave_padding_positions_out_without_indexing_by_the_mask():
    # add() sums under the real-position mask (no boolean index: a host sync per forward); every statistic must
    # be what the real positions alone give, whatever the padding rows were routed to
    from types import SimpleNamespace

    from miles.training.moe import RoutingStats

    g = torch.Generator().manual_seed(0)
    n, layers, k, experts = 40, 3, 2, 8

    def pick():
        return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n * layers)]).view(n, layers, k)

    applied, rollout = pick(), pick()
    logits = [torch.randn(n, experts, generator=g) for _ in range(layers)]
    real = torch.rand(n, generator=g) > 0.3
    own = rollout.clone()                            # the router agrees with the rollout but at 4 real positions
    own[real.nonzero()[:4, 0]] = pick()[:4]          # (and at padding, if it were counted: its own picks differ)
    own[~real] = pick()[~real]
    rollout[(~real).nonzero()[::2, 0]] = -1          # half the padding -1, half with experts: the mask decides
    rollout[:5, 1] = -1                              # a layer with no recorded routing for some real positions
    routing = SimpleNamespace(applied=lambda: applied, own=lambda: own, num_experts=experts, layers=list(range(layers)),
                              records=[SimpleNamespace(logits=lg) for lg in logits])
    stats = RoutingStats()
    stats.add(routing, real, rollout, replayed=True)
    got = stats.metrics()
    a, o, r = applied[real], own[real], rollout[real]
    counts = torch.nn.functional.one_hot(a, experts).sum(dim=(0, 2)).float()
    ent = sum(-(torch.log_softmax(lg[real], -1).exp() * torch.log_softmax(lg[real], -1)).sum() for lg in logits)
    has = r[:, :, 0] >= 0
    differ = (o.sort(-1).values != r.sort(-1).values).any(-1) & has
    assert torch.equal(stats.tokens, counts)
    assert got["moe/router_entropy"] == pytest.approx(float(ent) / (int(real.sum()) * layers), rel=1e-6)
    assert got["moe/routing_mismatch"] == pytest.approx(float(differ.sum()) / float(has.sum()))
    assert got["moe/routing_mismatch_tokens"] == pytest.approx(float(differ.any(-1).sum()) / float(has.any(-1).sum()))
    assert got["moe/routing_replayed"] == 1.0

@pytest.mark.parametrize("seq_aux", [False, True])
def test_router_losses_under_the_real_position_mask_equal_them_over_the_real_positions_alone(seq_aux):
    # aux_losses computes over every position with the padding weighted 0 (no boolean index: a host sync per
    # layer); the losses and their gradients must be those of the real positions alone. Row 2 is all padding.
    g = torch.Generator().manual_seed(1)
    rows, width, experts, k = 4, 6, 8, 2
    logits = torch.randn(rows * width, experts, generator=g, requires_grad=True)
    picked = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows * width)])
    real = torch.rand(rows * width, generator=g) > 0.3
    real[2 * width:3 * width] = False
    seqs = torch.arange(rows).repeat_interleave(width)
    masked = load_balancing_loss(logits, picked, experts, k, seqs if seq_aux else None, real, rows) + z_loss(logits, real)
    (grad_masked,) = torch.autograd.grad(masked, logits)
    alone = load_balancing_loss(logits[real], picked[real], experts, k, seqs[real] if seq_aux else None) + \
        z_loss(logits[real])
    (grad_alone,) = torch.autograd.grad(alone, logits)
    assert masked.item() == pytest.approx(alone.item(), rel=1e-6)
    assert torch.allclose(grad_masked, grad_alone, atol=1e-7) and (grad_masked[~real] == 0).all()

def test_the_aux_and_z_losses_enter_the_step_and_train_the_router(moe_path):
    engine = EmbeddedEngine(moe_path, device="cpu", seed=0)
    samples = samples_of(PROMPTS, engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)))
    for s in samples:
        s.advantage = 0.0                        # no policy gradient: what moves the routers is the router losses
    t = trainer(moe_path, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
                moe_router_dtype="fp32")
    before = t.model.model.layers[1].mlp.gate.weight.detach().clone()
    metrics = t.train(samples, rollout_id=0)
    assert metrics["moe/moe_aux_loss"] > 0 and metrics["moe/moe_z_loss"] > 0
    assert not torch.equal(t.model.model.layers[1].mlp.gate.weight, before)
    assert metrics["moe/router_entropy"] > 0 and metrics["moe/expert_load_max_over_mean"] >= 1.0
    assert "moe/layer1/tokens_per_expert_max" in metrics
    off = trainer(moe_path)
    before = off.model.model.layers[1].mlp.gate.weight.detach().clone()
    assert "moe/moe_aux_loss" not in off.train(samples, rollout_id=0)
    assert torch.equal(off.model.model.layers[1].mlp.gate.weight, before)


def test_weight_sync_checkpoint_and_hf_export(moe_path, tmp_path):
    t = trainer(moe_path)
    engine = EmbeddedEngine(moe_path, device="cpu")
    samples = samples_of(PROMPTS, engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)))
    t.train(samples, rollout_id=0)
    engine.update_weights(t.weights(), version=1)
    assert engine.weights_checksum() == t.weights_checksum(dtype=engine.weights_dtype())
    t.save(tmp_path / "ckpt")
    again = trainer(moe_path)
    again.load(tmp_path / "ckpt")
    assert again.weights_checksum() == t.weights_checksum()
    t.export_hf(tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    mine = t.weights()
    for name, tensor in exported.state_dict().items():
        if name in mine:
            assert torch.equal(tensor, mine[name].float()), name
    assert {n for n in mine if "experts" in n} <= set(exported.state_dict())


# --- start-up refusals ------------------------------------------------------------------------------
def argv(path, data, *extra):
    return ["--hf-checkpoint", str(path), "--prompt-data", str(data), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rollout-max-response-len", "8", *extra]


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"input": "1+1=", "label": "2"}\n')
    return f


def problems_of(args) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_flags(args)
    return info.value.problems


def test_the_moe_flags_parse_on_a_qwen3_moe(moe_path, data):
    cfg, _ = parse_flags(argv(moe_path, data, "--use-rollout-routing-replay", "--use-routing-replay",
                              "--moe-aux-loss-coeff", "1e-3", "--moe-router-load-balancing-type", "seq_aux_loss",
                              "--moe-z-loss-coeff", "1e-4", "--moe-router-dtype", "fp32"))
    t = cfg.train
    assert (t.use_rollout_routing_replay, t.use_routing_replay, t.moe_aux_loss_coeff, t.moe_router_load_balancing_type,
            t.moe_z_loss_coeff, t.moe_router_dtype) == (True, True, 1e-3, "seq_aux_loss", 1e-4, "fp32")


def test_unbuilt_paths_are_refused_by_name(moe_path, data, tmp_path):
    from tests.tiny_model import make_tiny_model

    problems = problems_of(argv(moe_path, data, "--train-backend", "megatron", "--context-parallel-size", "2",
                                "--expert-model-parallel-size", "3", "--tensor-model-parallel-size", "2"))
    assert any(p.startswith("--tensor-model-parallel-size 2 with a Qwen3-MoE model") for p in problems), problems
    assert any(p.startswith("--context-parallel-size with a Qwen3-MoE model") for p in problems), problems
    assert any(p.startswith("--expert-model-parallel-size 3 does not divide the model's") for p in problems), problems
    problems = problems_of(argv(moe_path, data, "--expert-model-parallel-size", "2"))       # the torch trainer
    assert any(p.startswith("--expert-model-parallel-size 2: --train-backend torch does not split models")
               for p in problems), problems
    assert parse_flags(argv(moe_path, data, "--trainer-compile"))[0].train.compile_layers is True   # compiled MoE layers
    problems = problems_of(argv(moe_path, data, "--rollout-engine", "sglang", "--use-rollout-routing-replay"))
    assert any("--rollout-engine sglang: the engine's routed-experts capture" in p
               and p.endswith("use --rollout-engine embedded / fast") for p in problems)
    problems = problems_of(argv(moe_path, data, "--rollout-quantization", "fp8"))
    assert [p for p in problems if "FP8 experts are not built" in p] == [
        f"--rollout-quantization fp8 with --hf-checkpoint {moe_path} (Qwen3-MoE): FP8 experts are not built yet "
        "(docs/fp8.md); drop it (--kv-cache-dtype fp8_e4m3 works with MoE models)"]
    dense = make_tiny_model(tmp_path / "dense")
    problems = problems_of(argv(dense, data, "--use-rollout-routing-replay", "--moe-aux-loss-coeff", "0.01"))
    assert any(p.startswith("--use-rollout-routing-replay, --moe-aux-loss-coeff: --hf-checkpoint") and
               "not a mixture-of-experts model" in p for p in problems)


def test_other_moe_families_are_refused_by_name(data, tmp_path):
    import json

    for cfg, what in (({"model_type": "qwen2_moe", "num_experts": 8, "shared_expert_intermediate_size": 64},
                       "shared experts"),
                      ({"model_type": "deepseek_v3", "n_routed_experts": 8, "n_shared_experts": 1,
                        "topk_method": "noaux_tc"}, "expert bias")):
        folder = tmp_path / cfg["model_type"]
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
        from miles.training.moe_checks import moe_kind
        kind = moe_kind(cfg)
        assert f"model_type {cfg['model_type']!r} is a mixture-of-experts family this build does not run yet" in kind
        assert what in kind and "built: qwen3_moe" in kind
        assert any(p.startswith(f"--hf-checkpoint {folder}: {kind}") for p in problems_of(argv(folder, data)))


def test_the_fp32_router_in_a_bf16_trainer_routes_from_float32_logits(moe_path):
    # a bfloat16 compute trainer: with --moe-router-dtype fp32 its routers' logits are the float32 ones
    # (the float32 model's, up to the bf16 hidden states they read), and the gate weights stay float32
    samples = samples_of(PROMPTS, EmbeddedEngine(moe_path, device="cpu").generate(PROMPTS, GREEDY))
    t = Trainer(moe_path, train=TrainConfig(moe_router_dtype="fp32"), algorithm=AlgorithmConfig(),
                rollout=RolloutConfig(batch_size=2, n_samples_per_prompt=2), device="cpu", dtype="bfloat16")
    batch = make_train_batch(samples, t.pad_id)
    seen = {}
    router = t.model.model.layers[1].mlp.gate
    hook = router.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out), prepend=False)
    with t._autocast():
        t._forward(t.model, batch, False, False)
    hook.remove()
    logits, weights, _ = seen["out"]
    assert logits.dtype == torch.float32 and weights.dtype == torch.float32
    want = torch.nn.functional.linear(seen["x"].reshape(-1, router.weight.shape[1]).float(), router.weight.float())
    assert torch.equal(logits, want)
    assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[0]))        # norm_topk_prob


# --- two FSDP2 ranks (gloo, spawned processes) against the one-process trainer -------------------------
FSDP_TRAIN = dict(lr=1e-2, micro_batch_size=1, global_batch_size=2, use_rollout_routing_replay=True,   # 2 steps: an old pass
                  use_routing_replay=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def _moe_rank_main(rank: int, world_size: int, port: int, model: str, out: str):
    from miles.training.torch.fsdp.rank import FSDPRank
    from tests.unit.test_fsdp_ranks import end_rank_process

    torch.set_num_threads(1)
    samples = torch.load(Path(out) / "samples.pt", weights_only=False)
    t = FSDPRank(model, rank=rank, world_size=world_size, train=TrainConfig(**FSDP_TRAIN),
                 algorithm=AlgorithmConfig(loss_agg_mode="token_mean"),
                 rollout=RolloutConfig(batch_size=2, n_samples_per_prompt=2), device="cpu")
    t.setup("127.0.0.1", port)
    metrics = t.train(samples, 0)
    torch.save((metrics, t.weights()), Path(out) / f"rank_{rank}.pt")
    t.dispose()
    end_rank_process()


def test_two_fsdp_ranks_train_an_moe_model_as_one_process_does(moe_path, tmp_path):
    import torch.multiprocessing as mp

    from tests.unit.test_fsdp_ranks import free_port

    engine = EmbeddedEngine(moe_path, device="cpu", seed=0)
    samples = samples_of(PROMPTS, engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)))
    torch.save(samples, tmp_path / "samples.pt")
    one = trainer(moe_path, **FSDP_TRAIN)
    want = one.train(samples, rollout_id=0)
    mp.spawn(_moe_rank_main, args=(2, free_port(), moe_path, str(tmp_path)), nprocs=2)
    (got, weights), (other, _) = (torch.load(tmp_path / f"rank_{r}.pt", weights_only=False) for r in range(2))
    moe = lambda m: {k: v for k, v in m.items() if k.startswith("moe/") or k in ("loss", "grad_norm")}  # noqa: E731
    assert moe(got) == moe(other) and len(moe(got)) > 10      # the ranks agree on the metrics
    for key in ("loss", "grad_norm", "moe/moe_aux_loss", "moe/moe_z_loss", "moe/routing_replayed",
                "moe/routing_mismatch", "moe/router_entropy", "moe/layer1/tokens_per_expert_max"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    mine = one.weights()
    assert max(float((weights[n] - mine[n]).abs().max()) for n in mine) < 1e-5
