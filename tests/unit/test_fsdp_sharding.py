"""The data-parallel arithmetic of the torch trainer on several ranks, by hand (no process group)."""

from __future__ import annotations

import torch

from miles.training.fsdp.sharding import bucket_names, rank_rows


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
    from miles.training.fsdp.buckets import merge_rank_buckets
    from miles.weights.transport import WeightBucket

    ipc = [WeightBucket(index=0, count=1, version=3, metas=(), ipc=("h", r), device_uuid=f"gpu-{r}") for r in range(3)]
    merged = merge_rank_buckets(ipc)
    assert (merged.device_uuid, merged.ipc) == ("gpu-0", ("h", 0))
    assert merged.peers == (("gpu-1", ("h", 1)), ("gpu-2", ("h", 2)))
    payload = WeightBucket(index=0, count=1, version=3, metas=(), payload=torch.zeros(4, dtype=torch.uint8))
    assert merge_rank_buckets([payload, None]) is payload        # off CUDA: rank 0's bytes, nothing to merge
