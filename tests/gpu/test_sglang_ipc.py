"""CUDA IPC buckets for SGLang's `/update_weights_from_tensor`, across processes; skipped without a GPU.

The receiving side does what SGLang 0.5.23 does with a payload (patch torch's `rebuild_cuda_tensor`
so a device UUID resolves to a local index, unpickle, view each byte slice as its dtype), in a fresh
process of its own, so the handles really cross a process boundary. SGLang itself is not needed.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from miles.rollout.engines.sglang.weights import bucket_payloads, flatten_bucket

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RECEIVER = r"""
import base64, hashlib, sys, torch
from torch.multiprocessing import reductions

original = reductions.rebuild_cuda_tensor
def by_uuid(*args):                         # what sglang.srt.utils.patch_torch does: UUID -> local index
    device = args[6]
    if isinstance(device, str):
        device = next(i for i in range(torch.cuda.device_count())
                      if str(torch.cuda.get_device_properties(i).uuid) == device)
    return original(*args[:6], device, *args[7:])
reductions.rebuild_cuda_tensor = by_uuid

import pickle
obj = pickle.loads(base64.b64decode(sys.stdin.read()))
for m in obj["metadata"]:
    t = obj["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
    assert t.is_cuda, m.name
    print(m.name, hashlib.sha256(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest())
"""


def test_a_cuda_bucket_is_rebuilt_bit_for_bit_in_another_process():
    g = torch.Generator(device="cuda").manual_seed(0)
    named = [("w", torch.randn(64, 32, device="cuda", generator=g).to(torch.bfloat16)),
             ("b", torch.randn(7, device="cuda", generator=g)),
             ("i", torch.arange(5, device="cuda"))]
    flat, entries = flatten_bucket(named)
    (payload,) = bucket_payloads(flat, entries, tp_size=1)
    out = subprocess.run([sys.executable, "-c", RECEIVER], input=payload, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = {n: hashlib.sha256(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in named}
    got = dict(line.split() for line in out.stdout.strip().splitlines())
    assert got == expected
    del flat       # the sender keeps the bucket alive until the receiver is done (it is, above)
