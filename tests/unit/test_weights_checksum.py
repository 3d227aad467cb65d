import hashlib
import struct

import pytest
import torch

from miles.weights.checksum import state_dict_checksum, state_dict_to_cpu
from miles.weights.hf import load_weights, model_weights


def test_checksum_is_sha256_of_the_documented_layout():
    # nothing process-dependent (hash seeds, ids, pointers) may enter: rebuild the digest by hand
    sd = {"b": torch.tensor([1.0, -2.0]), "a": torch.tensor([[3]], dtype=torch.int64)}
    h = hashlib.sha256()
    h.update(b"a\0torch.int64\0(1, 1)\0" + struct.pack("<q", 3))
    h.update(b"b\0torch.float32\0(2,)\0" + struct.pack("<ff", 1.0, -2.0))
    assert state_dict_checksum(sd) == h.hexdigest()


def test_checksum_ignores_insertion_order_but_sees_every_change():
    base = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.zeros(3)}
    ref = state_dict_checksum(base)
    assert state_dict_checksum({"b": base["b"], "w": base["w"]}) == ref
    changed_value = {**base, "w": base["w"].clone().index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(5.5))}
    changed_name = {"w2": base["w"], "b": base["b"]}
    changed_shape = {**base, "w": base["w"].reshape(3, 2)}       # same bytes, other shape
    changed_dtype = {**base, "b": torch.zeros(3, dtype=torch.int32)}  # same bytes (zeros), other dtype
    digests = {state_dict_checksum(sd) for sd in (changed_value, changed_name, changed_shape, changed_dtype)}
    assert ref not in digests and len(digests) == 4


def test_checksum_handles_bf16_non_contiguous_and_scalars():
    w = torch.randn(4, 3)
    sd = {"t": w.t(), "s": torch.tensor(2.0)}  # a transposed view and a 0-dim tensor
    assert state_dict_checksum(sd) == state_dict_checksum({"t": w.t().contiguous(), "s": torch.tensor(2.0)})
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    assert state_dict_checksum(sd, dtype=torch.bfloat16) == state_dict_checksum(as_bf16)
    assert state_dict_checksum(sd, dtype=torch.bfloat16) != state_dict_checksum(sd)


def test_state_dict_to_cpu_copies():
    live = {"w": torch.ones(2)}
    copy = state_dict_to_cpu(live)
    live["w"].add_(1.0)
    assert copy["w"].tolist() == [1.0, 1.0]


def _tied_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    m[1].weight = m[0].weight  # tied, as HF ties lm_head to the embeddings
    return m


def test_model_weights_lists_tied_parameters_once():
    assert list(model_weights(_tied_model())) == ["0.weight"]


def test_load_weights_is_strict_and_atomic():
    model = _tied_model()
    before = state_dict_checksum(model_weights(model))
    with pytest.raises(ValueError, match="missing.*0.weight"):
        load_weights(model, {})
    with pytest.raises(ValueError, match="unexpected.*extra"):
        load_weights(model, {"0.weight": torch.zeros(5, 3), "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"wrong shape.*\(3, 5\)"):
        load_weights(model, {"0.weight": torch.zeros(3, 5)})
    assert state_dict_checksum(model_weights(model)) == before
    load_weights(model, {"0.weight": torch.full((5, 3), 2.0, dtype=torch.float64)})  # cast to the model's dtype
    assert model[1].weight is model[0].weight and model[1].weight.dtype == torch.float32
    assert model[1].weight.eq(2.0).all()
