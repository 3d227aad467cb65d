"""What a train call achieved: the train metrics `tflops` and `mfu`.

`tflops` is the model FLOPs of the call's optimizer steps per second of their time, on this rank's
GPU (or CPU): 6 x parameters x the real tokens its forwards covered (a forward and its backward,
padding not counted, recompute's extra forward not counted, attention's quadratic term not counted:
the usual model-FLOPs convention, and the one `scripts/bench/` uses). The no-grad logprob passes run
before the steps and are not in it. `mfu` divides it by the GPU's peak: --mfu-peak-tflops, else the
dense bf16 peak of a GPU in `PEAK_TFLOPS` when the compute dtype is bf16 or fp16; none otherwise.
"""

from __future__ import annotations

import torch

# dense bf16/fp16 tensor-core peaks, TFLOP/s, from the vendor's datasheets; the first name contained in
# the device's name wins ("H100 PCIe" before "H100")
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0),
                                              ("A100", 312.0))


def peak_tflops(device: torch.device, compute_dtype: torch.dtype, given: float | None = None) -> float | None:
    """`given` (--mfu-peak-tflops), else the table's peak for a CUDA device computing in bf16/fp16."""
    if given is not None:
        return given
    if device.type != "cuda" or compute_dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def throughput_metrics(params: int, real_tokens: int, seconds: float, peak: float | None) -> dict[str, float]:
    """{"tflops": ..., "mfu": ...} of steps that covered `real_tokens` in `seconds` (mfu with a peak)."""
    if seconds <= 0 or real_tokens <= 0:
        return {}
    tflops = 6 * params * real_tokens / seconds / 1e12
    return {"tflops": tflops, **({"mfu": tflops / peak} if peak else {})}
