"""Lookup search: how a TTM embedding looks up a bucket of ids (its :class:`LookupPlan`).

The cores are split at ``split``: the left cores merge into a table
``L[M_L, N_L, r]`` and the right ones into ``R[M_R, r, N_R]`` (both small: each
covers only some modes). An id ``i = i_L * M_R + i_R`` is then one product
``L[i_L] @ R[i_R]`` of shape ``(N_L, N_R)``, the embedding row. The split is
chosen by the same cost model as contraction plans: merge FLOPs + per-id
FLOPs x rows + write weight x elements written (gathered slices, outputs,
tables), forward and backward (about twice the forward).
"""
from __future__ import annotations

from math import prod

from .. import tuning
from ..runtime.kernels.plans import LookupPlan

__all__ = ["plan_lookup", "per_id_macs"]


def _split_cost(ranks, rows_m, cols_n, split: int, tokens: int, w: float) -> tuple[float, int, int]:
    d = len(rows_m)
    merge = 0
    M = N = 1
    for k in range(split):  # left chain
        merge += M * N * ranks[k] * rows_m[k] * cols_n[k] * ranks[k + 1]
        M, N = M * rows_m[k], N * cols_n[k]
    ML, NL = M, N
    M = N = 1
    for k in range(d - 1, split - 1, -1):  # right chain
        merge += ranks[k] * rows_m[k] * cols_n[k] * ranks[k + 1] * M * N
        M, N = M * rows_m[k], N * cols_n[k]
    MR, NR = M, N
    r = ranks[split]
    per_id = NL * r * NR
    gathered = tokens * (NL * r + r * NR)
    out = tokens * NL * NR
    writes = gathered + out + ML * NL * r + MR * r * NR
    fwd = merge + tokens * per_id
    return 3 * fwd + w * 2 * writes, fwd, max(gathered, out)


def per_id_macs(layout, split: int) -> int:
    """Multiply-adds of one id's ``L[i_L] @ R[i_R]`` product at ``split``."""
    if len(layout.row_modes) == 1:
        return 0
    return prod(layout.col_modes[:split]) * layout.full_ranks[split] * prod(layout.col_modes[split:])


def plan_lookup(layout, rows: int, write_weight: float | None = None) -> LookupPlan:
    """Choose the split of a TTM layout's cores for lookups of ``rows`` ids."""
    write_weight = tuning.WRITE_WEIGHT if write_weight is None else write_weight
    ranks = layout.full_ranks
    m, n = layout.row_modes, layout.col_modes
    d = len(m)
    if d == 1:
        cost = 3.0 * rows * n[0] + write_weight * 2 * rows * n[0]
        return LookupPlan(rows, 1, 0, rows * n[0], cost, cost, {1: cost}, ranks=tuple(layout.ranks))
    scored = {s: _split_cost(ranks, m, n, s, rows, write_weight) for s in range(1, d)}
    best = min(scored, key=lambda s: scored[s][0])
    # naive: contract the gathered slices id by id along the chain (what one einsum does)
    chain = sum(prod(n[: k + 1]) * ranks[k + 1] * n[k + 1] * ranks[k + 2] for k in range(d - 1))
    gathered = sum(ranks[k] * n[k] * ranks[k + 1] for k in range(d))
    naive = 3 * rows * chain + write_weight * 2 * rows * (gathered + prod(n))
    cost, fwd, largest = scored[best]
    return LookupPlan(rows, best, fwd, largest, cost, naive, {s: v[0] for s, v in scored.items()},
                      ranks=tuple(layout.ranks))
