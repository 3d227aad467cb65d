"""What an MoE rollout's recorded routing costs on the host, by its form in the samples.

The fast engine records each sampled token's top-k experts per MoE layer. Between the engine and the trainer
those ids cross the host several times: out of the engine's call (`CallOutputs.routed_to_host`), through
Ray to the rollout executor and on to the trainer (pickled: Ray serializes a list of samples with pickle
protocol 5, numpy buffers out of band), and into the train batch (`make_train_batch`'s [B, T, L, k]
tensor). This times each hop for the three forms the field has had:

- `lists`: nested Python ints per token (before Dec 7: 8.3 s of a 42 s H200 call went to making them);
- `token_arrays`: one numpy array [L, k] per token (Dec 7 evening);
- `sample_arrays`: one numpy array [T, L, k] per response (`miles.types.Routing`, now).

Usage: PYTHONPATH=$PWD python3 scripts/bench/routing_hops_cpu.py [--samples 256 --tokens 1024 --layers 12
--top-k 8 --repeats 3] [--forms lists,token_arrays,sample_arrays] [--out FILE.json]
Each time is the best of --repeats; the JSON also records the machine's core count and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from miles.rollout.engines.fast.sampling import CallOutputs  # noqa: E402
from miles.training.batch import make_train_batch  # noqa: E402
from miles.types import Prompt, Sample  # noqa: E402

FORMS = ("lists", "token_arrays", "sample_arrays")


def best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def to_host(out: CallOutputs, lengths: list[int], form: str):
    if form == "sample_arrays":
        return out.routed_to_host(lengths)
    host = out.routed[:-1].cpu().numpy()
    if form == "token_arrays":
        return [list(host[i, :n].copy()) for i, n in enumerate(lengths)]
    return [host[i, :n].tolist() for i, n in enumerate(lengths)]


def hop(samples: list[Sample]) -> list[Sample]:
    """One actor-to-actor hop's serialization: pickle protocol 5 with out-of-band buffers, as Ray's."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(samples, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[b.raw() for b in buffers])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12, help="MoE layers (12: the 30b-a3b-12l GRPO workload; 48: full)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    out = CallOutputs(a.samples, a.tokens, torch.device("cpu"), routing=(a.layers, a.top_k, a.experts))
    out.routed.copy_(torch.randint(0, a.experts, out.routed.shape, dtype=torch.uint8))
    lengths = [a.tokens] * a.samples
    prompt = Prompt(index=0, text="", prompt_ids=tuple(range(64)))
    report = {"shape": dict(samples=a.samples, tokens=a.tokens, layers=a.layers, top_k=a.top_k, experts=a.experts),
              "cores": os.cpu_count(), "load_avg_start": os.getloadavg()[0], "seconds": {}}
    for form in a.forms.split(","):
        t_host, routed = best(lambda: to_host(out, lengths, form), a.repeats)
        samples = [Sample(prompt=prompt, group=i, response_ids=[1] * a.tokens, rollout_logprobs=[0.0] * a.tokens,
                          finish_reason="length", weight_version=0, rollout_routed_experts=r)
                   for i, r in enumerate(routed)]
        t_hop, back = best(lambda: hop(samples), a.repeats)
        t_batch, batch = best(lambda: make_train_batch(back, pad_id=0), a.repeats)
        assert torch.equal(batch.routed_experts[0, 63:63 + a.tokens], out.routed[0].to(torch.int64))
        report["seconds"][form] = dict(routed_to_host=round(t_host, 4), actor_hop=round(t_hop, 4),
                                       train_batch=round(t_batch, 4), total_one_hop=round(t_host + t_hop + t_batch, 4))
        print(form, report["seconds"][form], flush=True)
    report["load_avg_end"] = os.getloadavg()[0]
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
