"""The weight-gradient accumulation of one micro-batch, three ways, on the Qwen3-4B Linear shapes (GPU).

What the trainer does now for every Linear and micro-batch: the weight-gradient matmul writes a bf16
gradient and a separate kernel adds it into the float32 `.grad` (`unfused`). Megatron-LM's
gradient-accumulation fusion writes the float32 sum from the matmul itself; torch's
`addmm(..., out_dtype=torch.float32, out=grad)` (cuBLAS, bf16 inputs, float32 C and D) is the same
thing in one call (`fused`), if it may alias its input and output. `mm_fp32` (a float32 product, then
an add) is the other way to keep the sum exact. Each variant's error is against a float64 reference.

    python3 scripts/bench/wgrad_accum_gpu.py --tokens 8320 --out wgrad.json
"""

from __future__ import annotations

import argparse
import json

import torch

QWEN3_4B = {"q": (4096, 2560), "kv": (1024, 2560), "o": (2560, 4096), "gate_up": (9728, 2560), "down": (2560, 9728)}
PER_LAYER = {"q": 1, "kv": 2, "o": 1, "gate_up": 2, "down": 1}
LAYERS = 36


def unfused(grad, go, x):
    grad.add_(go.t() @ x)


def fused(grad, go, x):
    torch.addmm(grad, go.t(), x, out_dtype=torch.float32, out=grad)


def mm_fp32(grad, go, x):
    grad.add_(torch.mm(go.t(), x, out_dtype=torch.float32))


VARIANTS = {"unfused": unfused, "fused": fused, "mm_fp32": mm_fp32}


def time_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8320, help="rows of a micro-batch (two 4,160-token samples)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    res = {"tokens": a.tokens, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "shapes": {}}
    per_layer = dict.fromkeys(VARIANTS, 0.0)
    for name, (n_out, n_in) in QWEN3_4B.items():
        go = torch.randn(a.tokens, n_out, device=dev, dtype=torch.bfloat16) * 0.01
        x = torch.randn(a.tokens, n_in, device=dev, dtype=torch.bfloat16)
        base = torch.randn(n_out, n_in, device=dev, dtype=torch.float32) * 0.1
        ref = base.double() + go.double().t() @ x.double()
        row = {}
        for v, fn in VARIANTS.items():
            g = base.clone()
            try:
                fn(g, go, x)
            except Exception as e:  # noqa: BLE001 - an unsupported variant is a result
                row[v] = {"error": repr(e)[:300]}
                continue
            err = ((g.double() - ref).abs().max() / ref.abs().max()).item()
            ms = time_ms(lambda g=g, fn=fn: fn(g, go, x), a.reps)
            row[v] = {"ms": round(ms, 4), "max_rel_err": err}
            per_layer[v] += ms * PER_LAYER[name]
        res["shapes"][name] = row
        del go, x, base, ref
    res["per_micro_batch_ms"] = {v: round(ms * LAYERS, 2) for v, ms in per_layer.items()}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
