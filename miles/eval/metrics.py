"""Eval metrics as pure functions."""

from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): P(at least one of k draws from n samples, c correct, is correct)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)
