"""Flattened-bucket payloads: what SGLang's `/update_weights_from_tensor` unpickles, rebuilt exactly."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from miles.rollout.engines.sglang.weights import bucket_payloads, flatten_bucket
from tests.fakes.sglang_server import PayloadUnpickler, describe_payload


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 4, generator=g).to(torch.bfloat16)),
            ("b.bias", torch.randn(5, generator=g)),
            ("c.index", torch.arange(6, dtype=torch.int64).reshape(2, 3))]


def test_sglang_rebuilds_every_tensor_bit_for_bit_from_a_payload():
    tensors = named()
    flat, entries = flatten_bucket(tensors)
    payloads = bucket_payloads(flat, entries, tp_size=2)
    assert len(payloads) == 2
    # what sglang/srt/weight_sync/tensor_bucket.py does on one rank (same process: CPU tensors come back)
    obj = pickle.loads(base64.b64decode(payloads[1]))
    rebuilt = {m.name: obj["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
               for m in obj["metadata"]}
    assert list(rebuilt) == [n for n, _ in tensors]
    for name, t in tensors:
        assert rebuilt[name].dtype == t.dtype and torch.equal(rebuilt[name], t)
    assert all(m.numel == m.end_idx - m.start_idx and m.start_idx % m.dtype.itemsize == 0 for m in obj["metadata"])


def test_a_payload_uses_only_globals_sglangs_safe_unpickler_allows():
    flat, entries = flatten_bucket(named())
    (payload,) = bucket_payloads(flat, entries, tp_size=1)
    described = describe_payload(payload, "flattened_bucket")
    assert [(d["name"], d["shape"], d["dtype"]) for d in described] == \
        [("a.weight", [3, 4], "bfloat16"), ("b.bias", [5], "float32"), ("c.index", [2, 3], "int64")]
    evil = base64.b64encode(pickle.dumps(print)).decode()
    with pytest.raises(pickle.UnpicklingError, match="Blocked unsafe global"):
        PayloadUnpickler(io.BytesIO(base64.b64decode(evil))).load()


def test_bad_buckets_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="empty bucket"):
        flatten_bucket([])
    with pytest.raises(ValueError, match="1-D uint8"):
        bucket_payloads(torch.zeros(4), [], tp_size=1)
    flat, entries = flatten_bucket(named())
    with pytest.raises(ValueError, match="outside the"):
        bucket_payloads(flat[:10], entries, tp_size=1)
    shifted = [(n, s, d, a + 1, b + 1) for n, s, d, a, b in entries]
    with pytest.raises(ValueError, match="not aligned"):
        bucket_payloads(torch.cat([flat, flat[:1]]), shifted, tp_size=1)
