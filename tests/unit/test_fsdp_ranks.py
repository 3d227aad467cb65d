"""The torch trainer on N ranks (FSDP2 over gloo, ranks as spawned processes): the same loss, gradient
norm and updated weights as the one-process trainer on the same global batch, and its sharded
checkpoint resumed on another number of ranks (the one-process trainer, or 4 ranks), and the
one-process checkpoint resumed on 2 ranks.

The 2-rank run also recomputes activations, plans micro-batches by token budget and takes its logprobs
through the chunked hidden-state path (CUDA's), none of which changes the step: the one-process trainer
it is compared with does none of these. Every run has a KL reference (sharded on the ranks) refreshed
from the policy after each rollout and carried by the checkpoints."""

from __future__ import annotations

import os
import queue
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.torch.trainer import Trainer
from tests.tiny_model import make_tiny_model
from tests.unit.test_trainer import SAMPLES, sample

RANKS_TIMEOUT_S = 300

# 6 samples of different lengths: 2 ranks get 3 each, 4 ranks get 2, 2, 1, 1 (unequal micro-batch counts)
ROLLOUT = SAMPLES + [sample([5, 5], [8, 9, 2], 0.25), sample([6], [10, 11, 12, 2], -0.75)]
TRAIN = dict(lr=1e-2, micro_batch_size=2, global_batch_size=3, clip_grad=0.5)     # two optimizer steps a rollout
# the KL reference refreshed from the policy after every rollout: the checkpoints carry it (REF_FILE),
# so each resume below also loads a reference that differs from the initial policy
ALGO = dict(loss_agg_mode="token_mean", kl_loss_type="k3", use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01,
            eps_clip=0.2, ref_update_interval=1)
METRICS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm")


BUCKET_BYTES = 4096      # several buckets of the tiny model (its embedding alone is 2 KiB in bf16)
RANKS_TRAIN = dict(recompute_activations=True, use_dynamic_batch_size=True, max_tokens_per_gpu=12)


def configs(**train) -> dict:
    return dict(train=TrainConfig(**TRAIN, **train), algorithm=AlgorithmConfig(**ALGO),
                rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=8), device="cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_rank_process() -> None:
    """End a spawned rank's process at once, without the interpreter's finalization, as the rank
    group ends its ranks (`ray.kill` after `dispose`). `destroy_process_group` does not join the gloo
    group's worker threads: DTensor's caches and FSDP's device meshes keep the group alive, so its
    threads run until the process ends. A worker that has finished a collective (an FSDP all-gather)
    releases its tensors after the caller's wait returns, and freeing one whose Python object only the
    work still held takes the GIL; once the main thread is finalizing, Python ends that thread with
    pthread_exit, whose unwinding through the work's noexcept destructor calls std::terminate:
    SIGABRT, "terminate called without an active exception". Rare (the worker must be off the CPU
    from its collective's end until the exit), seen on a loaded 2-core CI machine."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_rank(target, rank: int, world_size: int, port: int, out) -> None:
    target(rank, world_size, port, out)
    out.close()
    out.join_thread()           # what the rank put is in the pipe before the process ends
    end_rank_process()


def spawn_gloo_ranks(target, world_size: int = 2) -> dict[int, str]:
    """`target(rank, world_size, port, queue)` in `world_size` spawned processes (each puts (rank,
    "ok" or its traceback) on the queue; the process then ends at once, `end_rank_process`); {rank:
    what it put}."""
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_run_rank, args=(target, r, world_size, port, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, str] = {}
    try:
        for _ in procs:      # generous: on a loaded 2-core machine two spawned torch processes start slowly
            rank, what = out.get(timeout=RANKS_TIMEOUT_S)
            results[rank] = what
    except queue.Empty:
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        raise AssertionError(f"no result from rank(s) {sorted(set(range(world_size)) - set(results))} within "
                             f"{RANKS_TIMEOUT_S} s (exit codes, None = still running: {codes}); got {results}") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def _rank_main(rank: int, world_size: int, port: int, model: str, out: str, script: list[tuple[str, object]],
               hidden: bool, options: dict):
    """One rank runs `script`: ("train", rollout_id), ("save", folder), ("load", folder); writes the
    metrics and the whole weights after each train to out/rank_<r>.pt. `hidden`: the chunked
    hidden-state logprobs (CUDA's path) in place of the logits; `options`: more `FSDPRank` arguments."""
    torch.set_num_threads(1)
    from miles.training.torch.fsdp.rank import FSDPRank

    t = FSDPRank(model, rank=rank, world_size=world_size, hidden_forward=hidden, **configs(**RANKS_TRAIN), **options)
    t.setup("127.0.0.1", port)
    assert t._logits_path is not hidden
    results = []
    for action, arg in script:
        if action == "train":
            results.append((t.train(ROLLOUT, arg), t.weights()))
        elif action in ("buckets", "fp8_buckets"):
            torch.save(take_buckets(t, arg, fp8=action == "fp8_buckets"), Path(out) / f"buckets_{rank}.pt")
        elif action == "fp8_checksum":
            torch.save(t.weights_checksum(torch.bfloat16, fp8=True), Path(out) / f"checksum_{rank}.pt")
        elif arg is None:
            getattr(t, action)()
        else:
            getattr(t, action)(arg)
    torch.save(results, Path(out) / f"rank_{rank}.pt")
    t.dispose()
    end_rank_process()


def take_buckets(t, bucket_bytes: int, fp8: bool = False) -> list[dict[str, torch.Tensor] | None]:
    """The weight buckets (in bf16, an engine's dtype; `fp8`: for FP8 engines) as the weight sync takes
    them: each bucket's tensors, or None where the rank handed out no bytes."""
    from miles.weights.transport import bucket_views

    out = []
    for i in range(t.weight_bucket_count(torch.bfloat16, bucket_bytes, fp8)):
        b = t.weight_bucket(i, 1)
        out.append(None if b is None else {n: v.clone() for n, v in bucket_views(b.metas, b.open()).items()})
        t.release_weight_buckets(i)
    return out


def run_ranks(world_size: int, model: str, out: Path, script: list[tuple[str, object]], hidden: bool = False,
              **options) -> list:
    mp.spawn(_rank_main, args=(world_size, free_port(), model, str(out), script, hidden, options), nprocs=world_size)
    return [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def one_rank(model_path, tmp_path_factory):
    """The one-process trainer on three rollouts; its checkpoint after rollout 0."""
    t = Trainer(model_path, **configs())
    ck = tmp_path_factory.mktemp("one") / "ck"
    results = [(t.train(ROLLOUT, 0), t.weights())]
    t.save(ck)
    results += [(t.train(ROLLOUT, r), t.weights()) for r in (1, 2)]
    return results, ck


@pytest.fixture(scope="module")
def two_ranks(model_path, one_rank, tmp_path_factory):
    """2 ranks: rollout 0 from the initial weights; the one-process checkpoint of rollout 0
    loaded, its optimizer state offloaded (--offload-train: rollout 1's steps stream it from host
    memory), rollout 1, saved (the checkpoint the others resume). The ranks take their logprobs from
    the hidden states through the chunked LM head (the one-process trainer from the logits)."""
    out = tmp_path_factory.mktemp("two")
    script = [("train", 0), ("load", str(one_rank[1])), ("offload", None), ("onload", None), ("train", 1),
              ("buckets", BUCKET_BYTES),
              ("save", str(out / "ck"))]
    ranks = run_ranks(2, model_path, out, script, hidden=True)
    return ranks, out / "ck", [torch.load(out / f"buckets_{r}.pt") for r in range(2)]


def assert_same(got: list, want: list) -> None:
    for (metrics, weights), (want_metrics, want_weights) in zip(got, want, strict=True):
        for k in METRICS:
            assert metrics[k] == pytest.approx(want_metrics[k], rel=1e-4, abs=1e-6), k
        assert metrics["num_steps"] == want_metrics["num_steps"] == 2
        assert weights.keys() == want_weights.keys()
        off = {n: float((w - want_weights[n]).abs().max()) for n, w in weights.items()
               if not torch.allclose(w, want_weights[n], rtol=1e-4, atol=1e-5)}
        # a key bias's gradient is 0 in exact arithmetic (softmax ignores the q.b_k added to a whole row
        # of scores); Adam turns the rounding noise left of it into steps of lr size, in any order of sums
        assert {n for n in off if not n.endswith("k_proj.bias")} == set(), off


def test_two_ranks_take_the_one_rank_steps_and_resume_its_checkpoint(one_rank, two_ranks):
    ranks, _, _ = two_ranks
    for got in ranks:   # every rank reports the same metrics and holds the same whole weights
        assert_same(got, one_rank[0][:2])       # rollout 1 after loading the one-process checkpoint
    assert ranks[0][0][1]["model.embed_tokens.weight"].shape == (32, 32)   # gathered whole, not a shard


def test_two_ranks_hand_out_weight_buckets_of_whole_tensors_in_the_engines_dtype(one_rank, two_ranks):
    ranks, _, buckets = two_ranks
    assert buckets[1] == [None] * len(buckets[0])       # off CUDA rank 0 alone keeps the bytes
    assert len(buckets[0]) > 1
    sent = {n: t for b in buckets[0] for n, t in b.items()}
    assert sum(len(b) for b in buckets[0]) == len(sent)           # every tensor once
    mine, single = ranks[0][1][1], one_rank[0][1][1]      # the weights after rollout 1: the ranks', one rank's
    assert sent.keys() == mine.keys()
    for name, t in sent.items():
        assert t.dtype == torch.bfloat16 and t.shape == mine[name].shape, name
        assert torch.equal(t, mine[name].to(torch.bfloat16)), name
        if not name.endswith("k_proj.bias"):       # see assert_same
            torch.testing.assert_close(t, single[name].to(torch.bfloat16), rtol=1e-2, atol=1e-3, msg=name)


def test_a_checkpoint_saved_on_two_ranks_resumes_on_one(one_rank, two_ranks, model_path):
    _, ck, _ = two_ranks
    assert (ck / "dcp" / ".metadata").is_file() and sorted(p.name for p in (ck / "rng").iterdir()) == [
        "rank_0.pt", "rank_1.pt"]
    t = Trainer(model_path, **configs())
    t.load(ck)
    assert t.num_steps == 4
    assert_same([(t.train(ROLLOUT, 2), t.weights())], one_rank[0][2:])


def test_two_ranks_reducing_every_micro_batch_take_the_one_rank_steps(one_rank, model_path, tmp_path):
    """`sync_every_micro_batch`: each micro-batch's gradients reduce-scattered and summed into the
    shards (the units resharded after each backward) give the step of the whole-gradient accumulation."""
    for got in run_ranks(2, model_path, tmp_path, [("train", 0), ("train", 1)], sync_every_micro_batch=True):
        assert_same(got, one_rank[0][:2])


@pytest.mark.extended
def test_four_ranks_resume_the_two_rank_checkpoint(one_rank, two_ranks, model_path, tmp_path):
    _, ck, _ = two_ranks
    for got in run_ranks(4, model_path, tmp_path, [("load", str(ck)), ("train", 2)]):
        assert_same(got, one_rank[0][2:])


@pytest.mark.extended
def test_four_ranks_take_the_one_rank_steps(one_rank, model_path, tmp_path):
    for got in run_ranks(4, model_path, tmp_path, [("train", 0), ("train", 1)]):
        assert_same(got, one_rank[0][:2])


def test_two_ranks_quantize_fp8_buckets_after_each_gather(model_path, tmp_path):
    """--rollout-quantization fp8 on 2 ranks: the buckets carry the decoder's Linear weights as e4m3 plus
    float32 scales (rank 0's bytes; the other rank takes part in the gathers only), equal to quantizing the
    one-process trainer's weights cast to bf16, and the checksum the weight check compares is theirs."""
    from miles.weights import fp8
    from miles.weights.checksum import state_dict_checksum

    run_ranks(2, model_path, tmp_path, [("fp8_buckets", BUCKET_BYTES), ("fp8_checksum", None)])
    buckets = [torch.load(tmp_path / f"buckets_{r}.pt") for r in range(2)]
    assert buckets[1] == [None] * len(buckets[0]) and len(buckets[0]) > 1
    sent = {n: t for b in buckets[0] for n, t in b.items()}
    one = Trainer(model_path, **configs())
    want = fp8.quantize_state_dict({n: t.detach().to(torch.bfloat16) for n, t in one.weights().items()})
    assert list(sent) == list(want)
    for name, t in want.items():
        got = sent[name]
        assert got.dtype == t.dtype, name
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)) if t.dtype == fp8.FP8 else torch.equal(got, t)
    assert {t.dtype for t in sent.values()} == {torch.bfloat16, fp8.FP8, torch.float32}
    checksums = {torch.load(tmp_path / f"checksum_{r}.pt") for r in range(2)}
    assert checksums == {state_dict_checksum(want)} == {one.weights_checksum(torch.bfloat16, fp8=True)}
    one.dispose()
