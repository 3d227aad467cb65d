"""Benchmark: the torch trainer's step on one rank under FSDP2 against the unsharded trainer, one GPU.

Builds a random Qwen2.5-0.5B-shaped model (as scripts/bench/train_megatron_gpu.py does; --size picks
a scale workload's shape instead, e.g. --size 1.7b: Qwen3-1.7B as grpo_step_gpu.py builds it) and trains
each variant on the same GRPO rollouts of random tokens (--samples samples of --prompt-len prompt and
--response-len response tokens, one optimizer step per rollout, micro-batches of --micro-batch-size).
All variants live in the process at once (the FSDP ranks share one process group of 1): each
runs --warmup rollouts, then the --rollouts timed ones go round-robin over the variants (the step at
this shape is bound by the host CPU, whose speed drifted by 25% between runs of the sequential
version); medians over the timed rollouts, each timed in its two calls:

  prepare_s   prepare_rollout: the no-grad forward for the old logprobs (and packing)
  step_s      train: forward + backward + optimizer step
  optimizer_s of step_s: gradient clipping + the optimizer's update
  tokens_per_s; peak_mem_gib_all_variants (torch.cuda.max_memory_allocated, every variant alive)
  mfu         with --size: 6 * params * tokens / (step_s * 989 TFLOP/s), as grpo_scale_gpu.py counts it

Variants (--variants, in this order by default):
  torch   the unsharded trainer as a one-GPU CUDA run gets it (chunked hidden-state logprobs,
          compiled decoder layers, autocast to bf16)
  fsdp    one FSDP2 rank (miles.training.fsdp.rank.FSDPRank, NCCL world of 1 on CUDA, gloo on the
          CPU): fully_shard per decoder layer and a root, bf16 params / fp32 reduce on CUDA, the same
          chunked logprobs (inside the root's forward) and compiled layers as torch (what each of N
          ranks runs; a one-GPU run itself trains with the one-process trainer)
  fsdp2, fsdp4  (not run by default) fsdp with 2 or 4 consecutive decoder layers per FSDP unit
  NAME-sync  (not run by default) an fsdp variant that reduce-scatters every micro-batch's gradients and
          accumulates them sharded (`FSDPRank(sync_every_micro_batch=True)`) instead of whole in float32
  plain   (not run by default) the unsharded trainer on the slower path: full logits, eager layers
  NAME-eager  (not run by default) torch or fsdp with eager decoder layers (--no-trainer-compile)

`fsdp_over_torch` is fsdp's median (prepare_s + step_s) over torch's: the sharding's overhead on one rank
(the issue's bound: at most 1.10).

Usage (GPU machine, from the checkout):
  PYTHONPATH=$PWD python3 scripts/bench/fsdp_step_gpu.py [--out result.json] [--profile DIR]
  --profile DIR: one more rollout per variant under torch.profiler; DIR/<variant>.txt gets its ops by
  self CUDA time and by CPU time (where the sharding's time goes)
  --device cpu: a tiny shape and batch on the CPU (a smoke run: float32, gloo)
  --max-tokens-per-gpu N: token-budget micro-batches (packed) in every variant instead of
  --micro-batch-size rows (the configuration the scale runs use)
  --family F --size Z: a shape of grpo_step_gpu.SHAPES (qwen3 1.7b, 4b, ...) instead of the 0.5B one;
  the 1.7B scale workload's train step: --size 1.7b --samples 64 --prompt-len 128 --response-len 1024
  --max-tokens-per-gpu 16384 (the step there is bound by the GPU, not by the host's launches)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# the shapes, the model and the rollouts of the megatron bench beside this file: the same inputs
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_step_gpu as step  # noqa: E402  (the scale workloads' shapes, model builder and peak)
from train_megatron_gpu import (SHAPE_05B, SHAPE_SMOKE, add_rollout_args, build_model, free_port,  # noqa: E402
                                log, rollout)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_optimizer(trainer, device: str) -> list[float]:
    """The trainer's `_optimizer_step` timed (synchronised) from now on; the list fills per step."""
    times: list[float] = []
    step = trainer._optimizer_step

    def timed():
        sync(device)
        t0 = time.perf_counter()
        out = step()
        sync(device)
        times.append(time.perf_counter() - t0)
        return out

    trainer._optimizer_step = timed
    return times


def profile(trainer, args, shape: dict, rollout_id: int, path: Path, trace: bool = False) -> None:
    """One more rollout under torch.profiler; its op tables into `path` (and its Chrome trace beside it
    with `trace`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    samples = rollout(rollout_id, args.samples, args.prompt_len, args.response_len, shape["vocab_size"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        trainer.prepare_rollout(samples, rollout_id)
        trainer.train(samples, rollout_id)
        sync(args.device)
    table = prof.key_averages()
    by_cuda = table.table(sort_by="self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total",
                          row_limit=45, max_name_column_width=70)
    by_cpu = table.table(sort_by="cpu_time_total", row_limit=60, max_name_column_width=70)
    path.parent.mkdir(parents=True, exist_ok=True)
    if trace:
        prof.export_chrome_trace(str(path.with_suffix(".trace.json")))
    path.write_text(f"=== by self device time\n{by_cuda}\n=== by CPU time (inclusive)\n{by_cpu}\n")


def time_one(trainer, args, shape: dict, rollout_id: int) -> tuple[float, float, float]:
    """(prepare_s, step_s, loss) of one rollout."""
    samples = rollout(rollout_id, args.samples, args.prompt_len, args.response_len, shape["vocab_size"])
    sync(args.device)
    t0 = time.perf_counter()
    trainer.prepare_rollout(samples, rollout_id)
    sync(args.device)
    t1 = time.perf_counter()
    metrics = trainer.train(samples, rollout_id)
    sync(args.device)
    return t1 - t0, time.perf_counter() - t1, metrics["loss"]


def time_interleaved(trainers: dict, args, shape: dict) -> dict:
    """Every variant warmed up, then the timed rollouts round-robin (rollout r on every variant
    before r + 1, the order rotated each round), so that a drift of the host's speed over the run
    (the step is bound by the CPU's launches at this shape) falls on all variants alike."""
    names = list(trainers)
    optimizer_times = {n: time_optimizer(t, args.device) for n, t in trainers.items()}
    for n, t in trainers.items():
        for r in range(args.warmup):
            time_one(t, args, shape, r)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs: dict[str, list] = {n: [] for n in names}
    for i, r in enumerate(range(args.warmup, args.warmup + args.rollouts)):
        for n in names[i % len(names):] + names[:i % len(names)]:
            runs[n].append(time_one(trainers[n], args, shape, r))
    tokens = args.samples * (args.prompt_len + args.response_len)
    out = {}
    for n in names:
        prepare, step, losses = zip(*runs[n])
        totals = [a + b for a, b in zip(prepare, step)]
        timed = optimizer_times[n][-args.rollouts:]
        out[n] = {"prepare_s": round(statistics.median(prepare), 4), "step_s": round(statistics.median(step), 4),
                  "total_s_median": round(statistics.median(totals), 4), "total_s": [round(v, 4) for v in totals],
                  "optimizer_s": round(statistics.median(timed), 4) if timed else None, "tokens_per_rollout": tokens,
                  "tokens_per_s": round(tokens / statistics.median(totals)), "losses": [round(v, 6) for v in losses]}
    if args.device == "cuda":
        out["peak_mem_gib_all_variants"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def make(variant: str, model: str, args):
    """A trainer for `variant` (see the module docstring); a "-eager" suffix turns off compiled layers."""
    from dataclasses import replace

    from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig

    base, eager = variant.removesuffix("-eager"), variant.endswith("-eager")
    base, sync_each = base.removesuffix("-sync"), base.endswith("-sync")
    budget = args.max_tokens_per_gpu
    train = TrainConfig(lr=1e-5, micro_batch_size=args.micro_batch_size, global_batch_size=args.samples,
                        compile_layers=False if eager or base == "plain" else None,
                        use_dynamic_batch_size=budget is not None, max_tokens_per_gpu=budget)
    kw = dict(train=train, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
              rollout=RolloutConfig(batch_size=args.samples // 8, n_samples_per_prompt=8,
                                    max_response_len=args.response_len), device=args.device)
    if base.startswith("fsdp") and base[4:] in ("", "2", "4"):
        from miles.training.fsdp.rank import FSDPRank

        rank = FSDPRank(model, rank=0, world_size=1, layers_per_unit=int(base[4:] or 1),
                        sync_every_micro_batch=sync_each, **kw)
        rank.setup("127.0.0.1", free_port())
        return rank
    from miles.training.trainer import Trainer

    if sync_each:
        raise SystemExit(f"--variants: {variant!r}: only an fsdp variant can end in -sync")
    if base == "plain":
        return Trainer(model, **kw, hidden_forward=False)
    if base == "torch":
        return Trainer(model, **kw)
    raise SystemExit(f"--variants: unknown variant {variant!r}; use plain, fsdp, fsdp2, fsdp4 (each may end in -sync), "
                     "torch (each may end in -eager)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    add_rollout_args(p)
    p.add_argument("--variants", default="torch,fsdp")
    p.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="micro-batches by token budget (--use-dynamic-batch-size, packed) in every variant, not by "
                        "--micro-batch-size rows: fewer, larger micro-batches, so fewer FSDP hooks per step")
    p.add_argument("--family", default=None, help="with --size: a grpo_step_gpu.py shape (default qwen3)")
    p.add_argument("--size", default=None, help="a grpo_step_gpu.py shape's size (1.7b, 4b, ...); default: the 0.5B "
                                                "shape of train_megatron_gpu.py")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--profile", type=Path, help="profile one more rollout per variant; tables into this folder")
    p.add_argument("--trace", action="store_true", help="with --profile: also each variant's Chrome trace")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA here; pass --device cpu for the smoke run")
    shape = SHAPE_05B if args.device == "cuda" else SHAPE_SMOKE
    if args.device == "cpu":
        args.samples, args.prompt_len, args.response_len, args.micro_batch_size = 16, 8, 16, 4
        args.warmup, args.rollouts = 1, 1
    key = None       # a scale workload's (family, size), else the 0.5B shape
    if args.size is not None or args.family is not None:
        key = (args.family or "qwen3", args.size or "")
        if key not in step.SHAPES:
            raise SystemExit(f"--family {key[0]} --size {key[1]}: no such shape; use one of "
                             f"{sorted(f'{f} {z}' for f, z in step.SHAPES)}")
        if args.device == "cpu":
            raise SystemExit("--size is a GPU shape; the CPU smoke run takes the tiny one (leave --size out)")
        shape = step.SHAPES[key]
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "shape": shape,
              "workload": "-".join(key) if key else ("qwen2-0.5b" if args.device == "cuda" else "smoke"),
              "samples": args.samples, "prompt_len": args.prompt_len, "response_len": args.response_len,
              "micro_batch_size": args.micro_batch_size, "max_tokens_per_gpu": args.max_tokens_per_gpu,
              "rollouts_timed": args.rollouts, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if key:
            result["params"] = step.build_model(Path(tmp) / "model", *key)
            model = str(Path(tmp) / "model")
        else:
            model = build_model(Path(tmp) / "model", shape, args.device)
        trainers = {}
        for variant in args.variants.split(","):
            log(f"{variant}: building")
            trainers[variant] = make(variant, model, args)      # all alive at once: they take turns
        result["variants"] = time_interleaved(trainers, args, shape)
        result["peak_mem_gib_all_variants"] = result["variants"].pop("peak_mem_gib_all_variants", None)
        for variant, trainer in trainers.items():
            log(f"{variant}: {result['variants'][variant]}")
            if args.profile:
                profile(trainer, args, shape, args.warmup + args.rollouts, args.profile / f"{variant}.txt",
                        trace=args.trace)
        for trainer in reversed(list(trainers.values())):   # the rank that made the process group goes last
            trainer.dispose()
        del trainers
        gc.collect()
    done = result["variants"]
    if result.get("params"):     # the scale bench's formula: 6 * params * tokens a step at the bf16 peak
        for v in done.values():
            v["mfu"] = round(6 * result["params"] * v["tokens_per_rollout"] / (v["step_s"] * step.PEAK_TFLOPS * 1e12), 4)
    total = {k: v["total_s_median"] for k, v in done.items()}
    for base in ("torch", "plain"):
        for fsdp in ("fsdp", "fsdp2", "fsdp4", "fsdp-sync"):
            if {base, fsdp} <= done.keys():
                result[f"{fsdp}_over_{base}"] = round(total[fsdp] / total[base], 3)
    if {"fsdp-eager", "torch-eager"} <= done.keys():
        result["fsdp_over_torch_eager"] = round(total["fsdp-eager"] / total["torch-eager"], 3)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
