"""The data-parallel arithmetic of the torch trainer on several ranks, by hand (no process group)."""

from __future__ import annotations

import pytest
import torch

from miles.training.torch.fsdp.sharding import bucket_names, rank_rows


def test_rank_rows_split_the_rows_contiguously_and_cover_them_once():
    # 7 rows on 3 ranks: 3 + 2 + 2, the first rank takes the remainder
    assert [rank_rows(7, r, 3) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [rank_rows(1, r, 2) for r in range(2)] == [[0], []]          # a rank may get no rows
    assert sum((rank_rows(10, r, 4) for r in range(4)), []) == list(range(10))


def test_buckets_hold_at_most_the_byte_budget_unless_one_tensor_is_larger():
    weights = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(30), "d": torch.zeros(5)}   # 40, 40, 120, 20 B
    assert bucket_names(weights, 80) == [["a", "b"], ["c"], ["d"]]
    assert bucket_names(weights, 1000) == [["a", "b", "c", "d"]]
    assert bucket_names({}, 80) == []


def test_a_merged_bucket_offers_every_ranks_ipc_copy_and_keeps_rank_0s_bytes():
    from miles.training.torch.fsdp.buckets import merge_rank_buckets
    from miles.weights.transport import WeightBucket

    ipc = [WeightBucket(index=0, count=1, version=3, metas=(), ipc=("h", r), device_uuid=f"gpu-{r}") for r in range(3)]
    merged = merge_rank_buckets(ipc)
    assert (merged.device_uuid, merged.ipc) == ("gpu-0", ("h", 0))
    assert merged.peers == (("gpu-1", ("h", 1)), ("gpu-2", ("h", 2)))
    payload = WeightBucket(index=0, count=1, version=3, metas=(), payload=torch.zeros(4, dtype=torch.uint8))
    assert merge_rank_buckets([payload, None]) is payload        # off CUDA: rank 0's bytes, nothing to merge


@pytest.mark.extended   # out of the default run (CI budget): compiled FSDP layers on CUDA in tests/gpu/test_fsdp_gpu.py
def test_decoder_layers_compiled_after_fully_shard_give_the_eager_gradients(tmp_path):
    """The order the trainer uses on CUDA (shard, then compile each layer in place), on one gloo rank:
    FSDP's hooks run outside the compiled code, the gradients are the eager ones. aot_eager traces
    forward and backward as inductor does, without its C++ compiler."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from miles.training.torch.forward import compile_decoder_layers
    from miles.training.torch.fsdp.sharding import shard_model
    from miles.weights.hf import load_causal_lm
    from tests.tiny_model import make_tiny_model
    from tests.unit.test_fsdp_ranks import free_port

    path = make_tiny_model(tmp_path / "tiny")
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        grads = []
        for compiled in (False, True):
            model = load_causal_lm(path, device=torch.device("cpu"), dtype=torch.float32)
            root = shard_model(model, compute_dtype=torch.float32, world_size=1)
            graphs = counters["stats"]["unique_graphs"]
            if compiled:
                assert compile_decoder_layers(model, backend="aot_eager") == model.config.num_hidden_layers
            for _ in range(2):      # two micro-batches: the layers stay gathered between them on one rank
                root(lambda lm: lm(input_ids=tokens).logits.logsumexp(-1).sum()).backward()
            assert (counters["stats"]["unique_graphs"] > graphs) is compiled
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    finally:
        dist.destroy_process_group()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_rank_uses_the_process_group_it_finds_and_refuses_one_of_another_shape(tmp_path):
    """A program that made the process's default group (the FSDP bench keeps several one-rank
    trainers in one process) has a rank join it and keep it after `dispose`; a group of another
    size is refused with what to do."""
    import torch.distributed as dist

    from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
    from miles.training.torch.fsdp.rank import FSDPRank
    from tests.tiny_model import make_tiny_model
    from tests.unit.test_fsdp_ranks import free_port

    path = make_tiny_model(tmp_path / "tiny")
    kw = dict(train=TrainConfig(lr=1e-3, micro_batch_size=2), algorithm=AlgorithmConfig(),
              rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=2), device="cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ranks = [FSDPRank(str(path), rank=0, world_size=1, **kw) for _ in range(2)]
        for r in ranks:
            r.setup("127.0.0.1", 0)          # no rendezvous: the group is there
        assert ranks[0].weights_checksum() == ranks[1].weights_checksum()
        for r in ranks:
            r.dispose()
        assert dist.is_initialized()          # its maker's, not the ranks'
        with pytest.raises(RuntimeError, match="rank 0 of 1, not rank 1 of 2: one group per process"):
            FSDPRank(str(path), rank=1, world_size=2, **kw).setup("127.0.0.1", 0)
    finally:
        dist.destroy_process_group()


def test_layers_grouped_into_units_give_the_per_layer_gradients(tmp_path):
    """`layers_per_unit` runs of consecutive decoder layers share one FSDP unit (one gather, one
    reduce): fewer units, the same gradients as one unit per layer, a last short run included."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from miles.training.torch.fsdp.sharding import shard_model
    from miles.weights.hf import load_causal_lm
    from tests.tiny_model import make_tiny_model
    from tests.unit.test_fsdp_ranks import free_port

    path = make_tiny_model(tmp_path / "tiny")          # 2 decoder layers
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        grads, units = [], []
        for per_unit in (1, 2, 3):
            model = load_causal_lm(path, device=torch.device("cpu"), dtype=torch.float32)
            root = shard_model(model, compute_dtype=torch.float32, world_size=1, layers_per_unit=per_unit)
            units.append(len({id(m._get_fsdp_state()) for m in root.modules() if isinstance(m, FSDPModule)}))
            root(lambda lm: lm(input_ids=tokens).logits.logsumexp(-1).sum()).backward()
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        with pytest.raises(ValueError, match="layers_per_unit must be >= 1"):
            shard_model(load_causal_lm(path, device=torch.device("cpu"), dtype=torch.float32),
                        compute_dtype=torch.float32, world_size=1, layers_per_unit=0)
    finally:
        dist.destroy_process_group()
    assert units == [3, 2, 2], units          # the layers' units + the root's; a run longer than the layers: one
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-6, atol=1e-7, msg=name)
