"""CUDA IPC weight buckets between two processes (a trainer and an engine on one GPU); skipped without CUDA.

No Ray: torch.multiprocessing (spawn) stands in for the actors, a queue for the driver's calls. Run on
the GPU machine: `PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_weight_ipc.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from miles.weights.checksum import state_dict_checksum
from miles.weights.hf import model_weights
from miles.weights.transport import BucketSender, WeightReceiver
from tests.tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def engine_process(model_path: str, inbox, outbox) -> None:
    """The engine: a bf16 copy of the model; loads every bucket it is sent, acknowledges each, and
    answers a checksum request with its weights' checksum."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    receiver = WeightReceiver(model_weights(model))
    outbox.put(("ready", state_dict_checksum(model_weights(model))))
    while (msg := inbox.get()) is not None:
        if msg == "checksum":
            outbox.put(("checksum", state_dict_checksum(model_weights(model))))
        else:
            outbox.put(("ack", msg.index, receiver.load(msg)))


def push(sender: BucketSender, version: int, inbox, outbox) -> list:
    acks = []
    for i in range(sender.num_buckets):
        inbox.put(sender.bucket(i, version))
        acks.append(outbox.get(timeout=60))
        sender.release(i)                    # the engine acknowledged: the buffer may go
    return acks


def test_ipc_sync_gives_the_engine_the_trainers_checksum(tmp_path):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=engine_process, args=(make_tiny_model(tmp_path / "engine", seed=1), inbox, outbox))
    engine.start()
    try:
        trainer = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "trainer", seed=2)).cuda()
        expected = lambda: state_dict_checksum(model_weights(trainer), dtype=torch.bfloat16)  # noqa: E731
        kind, before = outbox.get(timeout=120)
        assert kind == "ready" and before != expected()
        sender = BucketSender(lambda: model_weights(trainer), dtype=torch.bfloat16, bucket_bytes=8192, ipc=True)
        assert sender.num_buckets > 1
        baseline = torch.cuda.memory_allocated()
        for version in (1, 2):
            acks = push(sender, version, inbox, outbox)
            assert [a[2] for a in acks] == [None] * (sender.num_buckets - 1) + [version]
            inbox.put("checksum")
            assert outbox.get(timeout=60) == ("checksum", expected())
            assert sender.live_buckets == [] and torch.cuda.memory_allocated() == baseline
            with torch.no_grad():                    # a training step's worth of change
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
    finally:
        inbox.put(None)
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    assert engine.exitcode == 0
