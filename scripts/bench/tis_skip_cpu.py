"""Benchmark (CPU, not a test): one `Trainer.train` call with `--use-tis`, the old-logprob pass run
(`skip_old_logprobs=False`, the rule before issue 57's TIS skip) against skipped (the default now).

The workload is scripts/bench/fully_async_bench.py's train step on the CPU: the tests' tiny random model,
64 samples (8 prompts x 8) of 4-8 prompt tokens and answers that stop with probability 1/32 a token, capped
at --max-len (mean ~30), --micro-batch-size 16, one optimizer step a rollout, --use-tis; torch on
--threads threads (1: what an overlapped machine's trainer gets on 2 cores, `cpu_thread_budget`). The
two trainers alternate, each call on a fresh rollout (the same rollouts for both); reported: the medians
of the train call's wall time and of its `step_time_s`, its `logprob_passes`, and the largest difference
between the two trainers' metrics (loss, TIS, mismatch) over the calls. JSON on stdout.

Usage: PYTHONPATH=$PWD python3 scripts/bench/tis_skip_cpu.py [--calls 12] [--threads 1] [--max-len 192]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig  # noqa: E402
from miles.training.torch.trainer import Trainer  # noqa: E402
from miles.types import Prompt, Sample  # noqa: E402
from tests.tiny_model import VOCAB_SIZE, make_tiny_model  # noqa: E402


def rollout(seed: int, max_len: int, stop_p: float = 1 / 32) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(64):
        n = 1
        while n < max_len and rng.random() > stop_p:
            n += 1
        out.append(Sample(prompt=Prompt(index=i // 8, text="", prompt_ids=tuple(rng.randrange(4, VOCAB_SIZE)
                                                                              for _ in range(rng.randrange(4, 9)))),
                          group=i // 8, response_ids=[rng.randrange(4, VOCAB_SIZE) for _ in range(n)],
                          rollout_logprobs=[-rng.uniform(3.0, 4.5) for _ in range(n)], finish_reason="length",
                          weight_version=0, advantage=rng.uniform(-1, 1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=12, help="train calls per trainer (the first is left out)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=192)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["MILES_CPU_THREADS"] = str(args.threads)
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="tis-skip-")) / "model")
    algorithm = AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", use_tis=True)
    trainers = {name: Trainer(model, train=TrainConfig(lr=1e-4, global_batch_size=64, micro_batch_size=16),
                              algorithm=algorithm, rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=8,
                                                                         max_response_len=args.max_len),
                              device="cpu", skip_old_logprobs=skip)
                for name, skip in (("pass", False), ("skipped", True))}
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in trainers}
    keys = ("loss", "pg_loss", "grad_norm", "tis_weight_mean", "tis_clip_frac", "logprob_diff_rollout",
            "logprob_diff_rollout_max", "train_rollout_k3_kl")
    diff = 0.0
    load_start = os.getloadavg()[0]
    for call in range(args.calls):
        samples = rollout(call, args.max_len)
        seen = {}
        for name in (list(trainers) if call % 2 == 0 else list(trainers)[::-1]):
            start = time.perf_counter()
            seen[name] = m = trainers[name].train(samples, call)
            times[name].append((time.perf_counter() - start, m["step_time_s"], m["logprob_passes"]))
        diff = max(diff, *(abs(seen["pass"][k] - seen["skipped"][k]) for k in keys))
    result = {"host": platform.node(), "cpus": os.cpu_count(), "threads": args.threads, "calls": args.calls,
              "max_len": args.max_len, "load_avg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)]}
    for name, ts in times.items():
        kept = ts[1:]
        result[name] = {"train_call_s_median": round(statistics.median(t[0] for t in kept), 4),
                        "step_time_s_median": round(statistics.median(t[1] for t in kept), 4),
                        "logprob_passes": kept[0][2]}
    result["metrics_max_abs_diff"] = diff
    result["skipped_over_pass"] = round(result["skipped"]["train_call_s_median"]
                                        / result["pass"]["train_call_s_median"], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
