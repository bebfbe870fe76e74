"""Rank allocation by sensitivity: spend a parameter budget where the outputs need it.

Each layer gets an error curve ``e(r)``: the relative error of the layer's own
output with its network at rank ``r``, estimated from calibration data as the
TT-SVD error bound of the layer's *whitened* weight ``W C^{1/2}`` (a table:
rows scaled by the square root of their use; :mod:`.layer_fit`). On
all-MiniLM-L6-v2's linears TT-SVD of the whitened weight came within 1.0-1.5x
of the error a calibrated fit reaches at the same rank. Each curve is weighted
by how much the model's outputs move per unit of that layer's error
(:mod:`.statistics`, ``sensitivity``), so the sum estimates the model's output
error. Then the budget is spent greedily on the best weighted error drop per
parameter, jumping to any larger candidate rank (so a curve need not be
convex), until no jump fits.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from ..formats.layout import TTLayout, TTMLayout

__all__ = ["ErrorCurve", "candidate_ranks", "error_curve", "allocate_by_sensitivity", "CURVE_DTYPE"]

#: Precision of the unfoldings' Gram matrices and their eigenvalues. The curve is an
#: estimate (TT-SVD's bound); float32 moves its errors by ~1e-6 of the layer's energy --
#: far below the differences allocation weighs -- in half float64's time. The tails are
#: summed in float64 from the smallest eigenvalue up (no cancellation), and a tail below
#: the Gram's precision counts as none (an exactly low-rank layer gains nothing past its rank).
CURVE_DTYPE = torch.float32


@dataclass
class ErrorCurve:
    """``errors[i]``: estimated relative output error at ``ranks[i]`` (``params[i]`` parameters)."""

    ranks: list[int]
    params: list[int]
    errors: list[float]


def candidate_ranks(cap: int, floor: int = 1) -> list[int]:
    """Every rank up to 8, then steps of about 25%, and ``cap`` itself (``floor..cap``)."""
    out, r = [], max(1, floor)
    while r < cap:
        out.append(r)
        r = r + 1 if r < 8 else max(r + 1, round(r * 1.25))
    out.append(cap)
    return sorted(set(x for x in out if floor <= x <= cap))


def error_curve(target: torch.Tensor, layout: TTLayout | TTMLayout, ranks: list[int]) -> ErrorCurve:
    """Estimated relative error of ``target``'s TT network at each of ``ranks``.

    ``target``: a linear's whitened weight ``W L`` ``(out, in)``
    (:func:`~.layer_fit.normalized_root`) or a table's use-weighted rows ``(V, D)``
    (:func:`~.layer_fit.weighted_table`), so the Frobenius error is the output error.
    The estimate is TT-SVD's error bound, ``sum_k sum_{i > r_k} sigma_i(A_k)^2 / ||A||^2``
    over the unfoldings ``A_k`` at each bond (capped at 1): one set of singular values
    per bond gives the whole curve.
    """
    tensor = _sites(target.detach().to(CURVE_DTYPE), layout)
    norm = tensor.to(torch.float64).pow(2).sum().clamp_min(torch.finfo(torch.float64).tiny)
    sizes = tensor.shape
    tails = []  # per bond: tails[k][r] = energy beyond the first r singular values
    for k in range(1, len(sizes)):
        unfolding = tensor.reshape(prod(sizes[:k]), -1)
        small = unfolding if unfolding.shape[0] <= unfolding.shape[1] else unfolding.t()
        energy = torch.linalg.eigvalsh(small @ small.t()).to(torch.float64).clamp_min(0)  # sigma^2, ascending
        tail = energy.cumsum(0).flip(0)             # energy beyond the first r, summed from the smallest up
        resolution = torch.finfo(CURVE_DTYPE).eps * small.shape[0] * float(tail[0])
        tail = torch.where(tail <= resolution, torch.zeros_like(tail), tail)  # below the Gram's precision: none
        tails.append(torch.cat([tail, tail.new_zeros(1)]))
    errors, params = [], []
    for r in ranks:
        lay = layout.with_ranks(r)
        lost = sum(float(t[min(rk, t.numel() - 1)]) for t, rk in zip(tails, lay.ranks))
        errors.append(min(1.0, lost / float(norm)))
        params.append(lay.num_params())
    return ErrorCurve(list(ranks), params, errors)


def _sites(matrix: torch.Tensor, layout: TTLayout | TTMLayout) -> torch.Tensor:
    """The padded matrix as the tensor whose TT the layout describes (one dim per core)."""
    if isinstance(layout, TTMLayout):
        padded = matrix.new_zeros(layout.padded_rows, layout.padded_cols)
        padded[: matrix.shape[0], : matrix.shape[1]] = matrix
        d = len(layout.row_modes)
        t = padded.reshape(*layout.row_modes, *layout.col_modes)
        t = t.permute([i for k in range(d) for i in (k, d + k)])
        return t.reshape([m * n for m, n in zip(layout.row_modes, layout.col_modes)])
    padded = matrix.new_zeros(layout.padded_in, layout.padded_out)   # W^T, input modes first
    padded[: matrix.shape[1], : matrix.shape[0]] = matrix.t()
    return padded.reshape(*layout.in_modes, *layout.out_modes)


def allocate_by_sensitivity(curves: dict[str, ErrorCurve], budget: int,
                            weights: dict[str, float] | None = None) -> dict[str, int] | None:
    """Ranks minimizing ``sum_l weights[l] * e_l(r_l)`` within ``budget`` parameters.

    Starts every layer at its smallest candidate; repeatedly takes the jump
    (any layer, any larger candidate) with the largest weighted error drop per
    added parameter that still fits. ``weights`` default to 1 (a missing name
    weighs 1). Returns ``None`` if even the smallest candidates exceed ``budget``.
    """
    weights = weights or {}
    at = {n: 0 for n in curves}
    used = sum(c.params[0] for c in curves.values())
    if used > budget:
        return None
    while True:
        best, best_slope = None, 0.0
        for n, c in curves.items():
            i = at[n]
            for j in range(i + 1, len(c.ranks)):
                added = c.params[j] - c.params[i]
                if added <= 0:
                    continue
                if used + added > budget:
                    break  # params grow with the candidate index
                slope = weights.get(n, 1.0) * (c.errors[i] - c.errors[j]) / added
                if slope > best_slope:
                    best, best_slope = (n, j), slope
        if best is None:
            break
        n, j = best
        used += curves[n].params[j] - curves[n].params[at[n]]
        at[n] = j
    return {n: curves[n].ranks[i] for n, i in at.items()}
