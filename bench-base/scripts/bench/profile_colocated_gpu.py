"""Benchmark (GPU machine, not a test): where a colocated GRPO iteration's train phase and memory
hand-off spend their time, in one process, on grpo_step_gpu.py's setup (Qwen2.5-0.5B shape, bf16,
256 samples of 64 prompt + 256 response tokens, one optimizer step, --max-tokens-per-gpu 32768).

Prints JSON: the trainer's `train` call split into prepare / forward+backward per micro-batch /
optimizer step (CUDA-synchronised wall times, median of --repeats), the FastEngine's
`release_memory` / `resume_memory` and the first generate after a resume (graph re-capture), and
the top CUDA kernels of one `train` call by the torch profiler.

Usage (GPU machine, from the checkout, after installing the .whl wheels):
  PYTHONPATH=$PWD python3 scripts/bench/profile_colocated_gpu.py [--out DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step_gpu import build_model  # noqa: E402  (the same model as the GRPO bench)


def timed(fn, *args, **kw) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def fake_samples(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    from miles.types import Prompt, Sample

    r = random.Random(seed)
    out = []
    for i in range(n):
        prompt = Prompt(index=i // 8, text="", prompt_ids=tuple(r.randrange(3, vocab) for _ in range(prompt_len)))
        out.append(Sample(prompt=prompt, group=i // 8, response_ids=[r.randrange(3, vocab) for _ in range(response_len)],
                          rollout_logprobs=[-1.0] * response_len, finish_reason="length", weight_version=0,
                          reward=float(r.random() < 0.3)))
    return out


def profile_train(model: Path, a: argparse.Namespace) -> dict:
    from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
    from miles.training.trainer import Trainer

    t = Trainer(str(model), train=TrainConfig(lr=1e-6, micro_batch_size=64, global_batch_size=256,
                                              use_dynamic_batch_size=True, max_tokens_per_gpu=a.max_tokens),
                algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"), rollout=RolloutConfig(batch_size=32, n_samples_per_prompt=8,
                                                                    max_response_len=256),
                device="cuda", dtype="bfloat16")
    samples = fake_samples(256, 64, 256, vocab=1000)
    times, metrics = [], {}
    for i in range(a.repeats + 1):                       # the first warms up
        dt, metrics = timed(t.train, samples, i)
        times.append(dt)
    # the parts of one call: prepare (advantages, maybe the old-logprob pass) and the step
    from miles.training.batch import make_train_batch
    parts = {"prepare": [], "step": []}
    for _ in range(a.repeats):
        dt, batch = timed(t.prepare, make_train_batch(samples, t.pad_id))
        parts["prepare"].append(dt)
        dt, _ = timed(t._step, batch)
        parts["step"].append(dt)
    # forward+backward per micro-batch vs the optimizer alone
    batch = t.prepare(make_train_batch(samples, t.pad_id))
    t._optimizer.zero_grad(set_to_none=True)
    fb, _ = timed(t.accumulate_gradients, batch)
    opt, _ = timed(t._optimizer_step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed(t.train, samples, 99)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.top)
    if a.out:
        prof.export_chrome_trace(str(a.out / "train_trace.json"))
    return {"train_call_s": [round(x, 4) for x in times], "train_call_median_s": round(statistics.median(times[1:]), 4),
            "prepare_s": [round(x, 4) for x in parts["prepare"]], "step_s": [round(x, 4) for x in parts["step"]],
            "forward_backward_s": round(fb, 4), "optimizer_step_s": round(opt, 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "metrics": {k: metrics[k] for k in ("logprob_passes", "step_time_s", "num_steps", "train_tokens")
                        if k in metrics},
            "top_kernels": table.splitlines()}


def profile_engine(model: Path, a: argparse.Namespace) -> dict:
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.types import SamplingParams

    e = FastEngine(str(model), device="cuda", dtype="bfloat16")
    r = random.Random(1)
    prompts = [[r.randrange(3, 1000) for _ in range(64)] for _ in range(256)]
    params = SamplingParams(max_new_tokens=256, temperature=1.0)
    gen = [timed(e.generate, prompts, params)[0] for _ in range(2)]
    out: dict = {"generate_warm_s": round(gen[-1], 4), "release_s": [], "resume_s": [], "generate_after_resume_s": []}
    for _ in range(a.repeats):
        out["release_s"].append(round(timed(e.release_memory)[0], 4))
        out["resume_s"].append(round(timed(e.resume_memory)[0], 4))
        out["generate_after_resume_s"].append(round(timed(e.generate, prompts, params)[0], 4))
    e.dispose() if hasattr(e, "dispose") else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--skip-engine", action="store_true")
    a = p.parse_args()
    root = a.out or Path(tempfile.mkdtemp())
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    build_model(model)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not a.skip_engine:
        result["engine"] = profile_engine(model, a)
        torch.cuda.empty_cache()
    result["train"] = profile_train(model, a)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
