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
