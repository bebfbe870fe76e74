"""Balanced factorization of a dimension into tensor-train modes.

A dimension ``n`` is written as a product of ``d`` modes ``n_1 ... n_d`` (each
at least 2). Parameter count of a TT network grows with the *sum* of its modes
(``sum_k r^2 n_k``), so we look for the factorization with the smallest sum.
When ``n`` factors badly (a prime, 30522 = 2 * 3 * 5087) we allow padding it up
to a nearby ``N >= n`` that factors well; the cost of padding is the extra
work it causes (``N / n``) plus a fixed ``tuning.PAD_PENALTY`` for the pad and crop
copies it adds to every call, so that 1024 stays ``8x8x16`` rather than
becoming ``8x10x13`` (sum 31, but 1040 = 1024 + padding).
"""
from __future__ import annotations

from functools import lru_cache
import math

from .. import tuning

__all__ = ["factorize", "balanced_factors"]


@lru_cache(maxsize=1 << 16)   # bounded: a million-row table tries ~10^5 products, each with its sub-calls
def balanced_factors(n: int, d: int, min_factor: int = 2) -> tuple[int, ...] | None:
    """Exact factorization of ``n`` into ``d`` factors ``>= min_factor`` with minimal sum.

    Returns the factors in ascending order, or ``None`` if no such
    factorization exists.
    """
    if d == 1:
        return (n,) if n >= min_factor else None
    best: tuple[int, ...] | None = None
    # the smallest factor is at most the d-th root of n
    limit = int(round(n ** (1.0 / d))) + 1
    for f in range(min_factor, limit + 1):
        if n % f:
            continue
        rest = balanced_factors(n // f, d - 1, f)
        if rest is None:
            continue
        cand = (f,) + rest
        if best is None or sum(cand) < sum(best):
            best = cand
    return best


def factorize(n: int, d: int, max_padding: float | None = None) -> tuple[int, ...]:
    """Choose ``d`` modes whose product ``N >= n`` minimizes ``sum(modes) * N / n``
    (times ``1 + PAD_PENALTY`` when ``N > n``).

    Parameters
    ----------
    n : int
        The dimension to factor (e.g. ``in_features`` or a vocabulary size).
    d : int
        Number of modes (cores on that side).
    max_padding : float, optional
        Largest relative padding ``(N - n) / n`` considered
        (default :data:`tncompile.tuning.MAX_MODE_PADDING`).

    Returns
    -------
    tuple of int
        ``d`` modes in ascending order, product ``>= n``.

    Raises
    ------
    ValueError
        If ``n`` cannot be split into ``d`` modes of at least 2 within
        ``max_padding`` (the dimension is too small for ``d`` cores).
    """
    if d < 1:
        raise ValueError(f"number of modes must be >= 1, got {d}")
    if n < 1:
        raise ValueError(f"dimension must be >= 1, got {n}")
    if max_padding is None:
        max_padding = tuning.MAX_MODE_PADDING
    lo = max(n, 2 ** d)
    hi = int(math.floor(n * (1.0 + max_padding)))
    best: tuple[float, int, tuple[int, ...]] | None = None
    for N in range(lo, hi + 1):
        # d modes of product N sum to at least d * N ** (1/d) (AM-GM), and past n that bound
        # only grows with N: once it reaches the best score, no larger N can win
        if best is not None and N != n and (d * N ** (1.0 / d) * N / n * (1.0 + tuning.PAD_PENALTY)
                                            >= best[0] - 1e-12):
            break
        f = balanced_factors(N, d)
        if f is None:
            continue
        score = sum(f) * N / n * (1.0 + tuning.PAD_PENALTY if N != n else 1.0)
        if best is None or score < best[0] - 1e-12:
            best = (score, N, f)
    if best is None:
        raise ValueError(
            f"dimension {n} cannot be split into {d} modes >= 2 with at most "
            f"{max_padding:.0%} padding (needs at least {2 ** d})"
        )
    return best[2]
