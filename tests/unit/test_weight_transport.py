"""Weight buckets: planning, the bytes round trip, the receiver's checks and version stamping (CPU)."""

import pytest
import torch

from miles.weights.checksum import state_dict_checksum
from miles.weights.hf import model_weights
from miles.weights.transport import (ALIGN, BucketSender, WeightBucket, WeightReceiver, bucket_views,
                                     fill_bucket, plan_buckets)
from tests.tiny_model import make_tiny_model


def weights():
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(10, 3, generator=gen), "b": torch.randn(7, generator=gen),
            "steps": torch.tensor([3, 4], dtype=torch.int64), "c": torch.randn(2, 2, 2, generator=gen),
            "scalar": torch.tensor(1.5)}


def test_plan_by_hand():
    # bf16: a = 60 bytes at 0; b = 14 bytes at 256 (aligned); steps keeps int64: 16 bytes at 512 would
    # end at 528 > 520, so it starts bucket 2 at 0; c = 16 bytes at 256; scalar = 2 bytes at 512
    plans = plan_buckets(weights(), dtype=torch.bfloat16, bucket_bytes=520)
    assert [[(m.name, m.offset) for m in p.metas] for p in plans] == [[("a", 0), ("b", 256)],
                                                                      [("steps", 0), ("c", 256), ("scalar", 512)]]
    assert [p.nbytes for p in plans] == [270, 514]
    assert plans[1].metas[0].dtype == torch.int64 and plans[0].metas[0].dtype == torch.bfloat16


@pytest.mark.parametrize("bucket_bytes", [1, 100, 300, 1000, 10 ** 9])
def test_plan_respects_the_size_and_a_larger_tensor_gets_its_own(bucket_bytes):
    w = weights()
    plans = plan_buckets(w, dtype=torch.bfloat16, bucket_bytes=bucket_bytes)
    assert [m.name for p in plans for m in p.metas] == list(w)          # every tensor once, in order
    for p in plans:
        assert p.nbytes <= bucket_bytes or len(p.metas) == 1
        assert all(m.offset % ALIGN == 0 for m in p.metas)
        ends = [m.offset + m.nbytes for m in p.metas]
        assert all(e <= m.offset for e, m in zip(ends, p.metas[1:]))     # no overlap
    if bucket_bytes == 1:
        assert len(plans) == len(w)
    if bucket_bytes == 10 ** 9:
        assert len(plans) == 1


def test_round_trip_gives_the_exact_cast_bytes():
    w = weights()
    for dtype in (torch.bfloat16, torch.float32):
        plans = plan_buckets(w, dtype=dtype, bucket_bytes=300)
        got = {}
        for p in plans:
            flat = fill_bucket(p, w, device="cpu")
            assert flat.dtype == torch.uint8 and flat.numel() == p.nbytes
            got.update(bucket_views(p, flat))
        assert list(got) == list(w)
        for name, t in w.items():
            want = t.to(dtype) if t.is_floating_point() else t
            assert got[name].dtype == want.dtype and got[name].shape == want.shape
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        assert state_dict_checksum(got) == state_dict_checksum(w, dtype=dtype)


def test_the_receiver_loads_contiguous_strided_and_cast_tensors_alike():
    """The engine's tensors as they come: contiguous ones of the bucket's dtype (loaded by one multi-tensor
    copy of their bytes), a transposed view (a strided copy_), a float32 tensor fed bf16 bytes (a cast), a
    0-dim one; each holds exactly the sent values, and the fused tensor under the transposed view too."""
    w = weights()
    fused = torch.zeros(3, 10, dtype=torch.bfloat16)
    named = {"a": fused.t(), "b": torch.zeros(7, dtype=torch.float32), "steps": torch.zeros(2, dtype=torch.int64),
             "c": torch.zeros(2, 2, 2, dtype=torch.bfloat16), "scalar": torch.zeros((), dtype=torch.bfloat16)}
    receiver = WeightReceiver(named)
    plans = plan_buckets(w, dtype=torch.bfloat16, bucket_bytes=300)
    for i, p in enumerate(plans):
        version = receiver.load(WeightBucket(index=i, count=len(plans), version=3, metas=p.metas,
                                             payload=fill_bucket(p, w, device="cpu")))
    assert version == 3
    for name, t in w.items():
        want = (t.to(torch.bfloat16) if t.is_floating_point() else t).to(named[name].dtype)
        assert torch.equal(named[name], want), name
    assert torch.equal(fused, w["a"].to(torch.bfloat16).t())


def test_tied_weights_travel_once_and_the_engine_gets_the_trainer_checksum(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "a", seed=1))
    engine = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "b", seed=2), dtype=torch.bfloat16)
    sender = BucketSender(lambda: model_weights(trainer), dtype=torch.bfloat16, bucket_bytes=4096)
    names = [m.name for p in sender.plans for m in p.metas]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names     # tied: sent once
    assert sender.num_buckets > 1
    receiver = WeightReceiver(model_weights(engine))
    versions = []
    for i in range(sender.num_buckets):
        versions.append(receiver.load(sender.bucket(i, version=7)))
        sender.release(i)
    assert versions == [None] * (sender.num_buckets - 1) + [7]
    assert sender.live_buckets == []
    assert state_dict_checksum(model_weights(engine)) == state_dict_checksum(model_weights(trainer),
                                                                             dtype=torch.bfloat16)
    assert engine.lm_head.weight is engine.model.embed_tokens.weight                    # still tied


def test_sender_keeps_buckets_until_released_and_dispose_frees_them():
    w = weights()
    sender = BucketSender(lambda: w, dtype=torch.float32, bucket_bytes=300)
    buckets = [sender.bucket(i, version=1) for i in range(sender.num_buckets)]
    assert sender.live_buckets == list(range(sender.num_buckets))
    assert all(b.payload is not None and b.ipc is None and b.count == sender.num_buckets for b in buckets)
    sender.release(0)
    assert sender.live_buckets == list(range(1, sender.num_buckets))
    sender.dispose()
    assert sender.live_buckets == []


def test_receiver_rejects_out_of_order_wrong_shapes_and_missing_tensors():
    w = weights()
    sender = BucketSender(lambda: w, dtype=torch.float32, bucket_bytes=300)
    first, second = sender.bucket(0, 1), sender.bucket(1, 1)
    target = {k: torch.zeros_like(v) for k, v in w.items()}
    with pytest.raises(ValueError, match="expected"):
        WeightReceiver(target).load(second)
    bad = dict(target, a=torch.zeros(3, 10))
    with pytest.raises(ValueError, match="a: shape"):
        WeightReceiver(bad).load(first)
    assert (bad["b"] == 0).all()                              # nothing of the bad bucket was copied
    extra = dict(target, extra=torch.zeros(1))
    with pytest.raises(ValueError, match="1 tensors were not sent"):
        receiver = WeightReceiver(extra)
        for i in range(sender.num_buckets):
            receiver.load(sender.bucket(i, 2))
    receiver = WeightReceiver(target)
    assert [receiver.load(sender.bucket(i, 3)) for i in range(sender.num_buckets)][-1] == 3
    retried = WeightReceiver(target)                          # a sync that starts again from bucket 0
    retried.load(sender.bucket(0, 4))
    assert [retried.load(sender.bucket(i, 4)) for i in range(sender.num_buckets)][-1] == 4
    assert all(torch.equal(target[k], w[k]) for k in w)


def test_ipc_needs_cuda_weights():
    sender = BucketSender(weights, dtype=torch.float32, ipc=True)
    with pytest.raises(ValueError, match="on CUDA"):
        sender.bucket(0, 1)


def test_host_weights_pickle_out_of_band_as_the_same_tensors():
    import pickle

    from miles.weights.transport import HostWeights

    sent = {**weights(), "half": torch.randn(3, 5).to(torch.bfloat16)}
    buffers = []     # what Ray keeps out of band: the tensors' bytes, not copies inside the pickle
    data = pickle.dumps(HostWeights(sent), protocol=5, buffer_callback=buffers.append)
    got = pickle.loads(data, buffers=buffers)
    assert type(got) is dict and list(got) == list(sent)
    assert len(buffers) == len(sent) and len(data) < 2000
    for name, t in sent.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name
    assert state_dict_checksum(got) == state_dict_checksum(sent)
