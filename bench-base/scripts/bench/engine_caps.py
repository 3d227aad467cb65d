"""Benchmark (not a test): FastEngine on calls whose requests carry their own caps, and with stop strings.

A multi-turn rollout sends each turn with the budget its sample has left, so one engine call holds
requests of many different max_new_tokens. Peers in one run, on the same prompts and engine:

  one_batch       one call with a cap per request (the engine since tree e7b2082: one decode batch)
  cap_by_cap      the same requests served one call per distinct cap (how the engine served them before)
  stop_never_hit  one_batch with a stop string no answer contains: the cost of the host's checks
                  (a gather and copy of each slot's newest tokens every 8 steps, a decode per request)

Random-init Qwen2 of the 0.5B shape on CUDA (`rollout_gpu.SHAPE_05B`), a small one on the CPU
(`SHAPE_SMOKE`); the test tokenizer (characters; "xyz" is not among them). Temperature 1, so answers
also end at the random EOS. Each peer runs once to warm up, then --repeats times (median). JSON on
stdout (and --out). The peers' repeats are interleaved.

Usage: PYTHONPATH=$PWD python3 scripts/bench/engine_caps.py [--prompts 64] [--max-cap 256]
  [--distinct 32] [--repeats 3] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_gpu import DEVICE, SHAPE_05B, SHAPE_SMOKE, build_model, timed  # noqa: E402

import torch  # noqa: E402


def cap_by_cap(engine, prompts: list[list[int]], params, caps: list[int]):
    """One call per distinct cap (the rows of each in order), as the engine served such calls before."""
    out = [None] * len(prompts)
    for cap in sorted(set(caps)):
        rows = [i for i, c in enumerate(caps) if c == cap]
        for i, g in zip(rows, engine.generate([prompts[i] for i in rows], params, [cap] * len(rows))):
            out[i] = g
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-cap", type=int, default=256)
    p.add_argument("--distinct", type=int, default=32, help="distinct caps among the requests")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()

    from miles.rollout.engines.fast.engine import FastEngine
    from miles.types import SamplingParams

    shape = SHAPE_05B if DEVICE == "cuda" else SHAPE_SMOKE
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (a.prompts, a.prompt_len), generator=g).tolist()
    caps = [a.max_cap - (i % a.distinct) * (a.max_cap // a.distinct) for i in range(a.prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=a.max_cap, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model", shape)
        engine = FastEngine(path, device=DEVICE, max_batch_size=max(a.prompts, 1))
        peers = {"one_batch": lambda: engine.generate(prompts, params, caps),
                 "cap_by_cap": lambda: cap_by_cap(engine, prompts, params, caps),
                 "stop_never_hit": lambda: engine.generate(prompts, SamplingParams(**{**vars(params), "stop": ("xyz",)}),
                                                           caps)}
        report = {"device": DEVICE, "machine": platform.processor() or platform.machine(),
                  "torch": torch.__version__, "shape": {k: shape[k] for k in ("hidden_size", "num_hidden_layers")},
                  "prompts": a.prompts, "prompt_len": a.prompt_len, "max_cap": a.max_cap,
                  "distinct_caps": len(set(caps)), "peers": {}}
        for fn in peers.values():
            fn()                                         # warm-up (graphs, compiled shapes)
        runs = {name: [] for name in peers}
        for _ in range(a.repeats):                       # interleaved: a drifting machine affects each alike
            for name, fn in peers.items():
                runs[name].append(timed(fn))
        outputs = {name: r[-1][0] for name, r in runs.items()}
        for name, r in runs.items():
            tokens = sum(len(x.response_ids) for x in r[-1][0])
            seconds = statistics.median(x[1] for x in r)
            report["peers"][name] = {"seconds": round(seconds, 4), "seconds_all": [round(x[1], 4) for x in r],
                                     "tokens": tokens, "tok_s": round(tokens / seconds, 1)}
        report["one_batch_same_as_stop_never_hit"] = outputs["one_batch"] == outputs["stop_never_hit"]
        report["speedup_over_cap_by_cap"] = round(report["peers"]["cap_by_cap"]["seconds"]
                                                  / report["peers"]["one_batch"]["seconds"], 2)
        report["stop_check_overhead"] = round(report["peers"]["stop_never_hit"]["seconds"]
                                              / report["peers"]["one_batch"]["seconds"] - 1, 3)
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
