"""Fit one network to what its dense layer *does* on calibration data.

A linear layer ``W`` (``[out, in]``) with input second moment ``C`` is fit by
minimizing the relative output error

    e(W') = tr((W - W') C_r (W - W')^T) / tr(W C_r W^T),   C_r = C / mean_eig(C) + ridge I,

over the TT cores of ``W'`` (the ridge keeps directions the calibration data
never visited from drifting). With ``W'^T = A B`` (:func:`~tncompile.formats.tt_factors`)
the error is ``tr(A^T C_r A . B B^T) - 2 tr(A^T C_r W^T B^T) + const``: no
dense ``in x out`` product per step. An embedding table ``E`` is fit by
``sum_v w_v ||E_v - E'_v||^2 / sum_v w_v ||E_v||^2`` with ``w`` the rows'
share of calibration lookups, plus ``uniform_share`` spread over all rows
(evaluated on the used rows and a fixed sample of the others).

A linear starts from the better of TT-SVD of ``W`` and TT-SVD of the best
matrix in this metric at the rank of the bond between input and output cores
(closed form: truncated SVD of ``W L`` with ``L L^T = C_r``, mapped back); a table from
TT-SVD. Then L-BFGS in float64; the result is never worse than the start.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from ..formats.factorization import tt_factors, tt_from_linear_weight, tt_to_dense, ttm_from_embedding_weight, ttm_to_dense
from ..formats.layout import TTLayout, TTMLayout
from ..runtime.kernels.traced_lookup import half_tables, split_ids
from ..runtime.ways.lookup import GatheredProduct

__all__ = ["FitResult", "fit_linear_cores", "fit_table_cores", "normalized_root", "weighted_table",
           "row_weights", "RIDGE", "UNIFORM_SHARE", "LINEAR_ITERATIONS", "TABLE_ITERATIONS"]

#: Ridge added to the normalized input second moment (mean eigenvalue 1).
RIDGE = 1e-2
#: Share of a table's fitting weight spread evenly over all rows (rows calibration never used still count).
UNIFORM_SHARE = 0.1
#: L-BFGS iterations per linear network and per table.
LINEAR_ITERATIONS = 100
TABLE_ITERATIONS = 100
#: L-BFGS stops early once an iteration lowers the relative error by less than this.
TOLERANCE = 1e-6
#: Precision of a linear fit's products (``A^T C A``: ``in^2 x r`` multiply-adds per step,
#: most of a wide layer's fit); the cores, their sums and L-BFGS stay float64.
LINEAR_FIT_DTYPE = torch.float32
#: Precision of a linear's closed-form start (``W L``, its Gram's eigenvectors, the
#: triangular solve and the TT-SVD): a start, chosen against the plain TT-SVD by the float64
#: error and then fit, so its rounding is fit away.
START_DTYPE = torch.float32
#: Curvature pairs L-BFGS keeps. Its two-loop recursion makes two passes over every core
#: per pair and iteration -- on a vocabulary's cores (millions of values) more than the
#: objective itself; 10 fit MiniLM's word table as closely as 20 in 80% of the time.
HISTORY = 10
#: Unused rows of a table the fit samples to stand for all of them.
UNUSED_SAMPLE = 1024
#: Further unused rows, disjoint from those, on which a table fit is judged: it stops once
#: their error stops falling (fitting the sample more closely then only overfits it).
HELD_OUT_SAMPLE = 1024
#: L-BFGS iterations between two looks at the held-out rows.
TABLE_CHUNK = 5
#: A table's fit runs in this precision (its errors are reported in float64). Its products
#: are over rows x D x r, with r at the middle bond in the hundreds: float32 halves their time.
TABLE_FIT_DTYPE = torch.float32


@dataclass
class FitResult:
    """Relative output error of a network before (TT-SVD) and after the fit."""

    cores: list[torch.Tensor]
    svd_error: float
    fit_error: float
    iterations: int = 0   # L-BFGS iterations run (judged fits stop early)


def output_error(weight: torch.Tensor, cores: list[torch.Tensor], layout: TTLayout, moment: torch.Tensor) -> float:
    """``tr(dW C dW^T) / tr(W C W^T)``: the network's relative output error on inputs of
    second moment ``C`` (``dW = TT(cores) - weight``; its products in float32, summed in float64)."""
    w = weight.detach().to(torch.float64)
    c = moment.to(device=w.device, dtype=torch.float32)
    delta = (tt_to_dense([k.detach().to(torch.float64) for k in cores], layout) - w).float()
    w32 = w.float()   # products in float32 (a report: 1e-7 of the energy is far below any error shown), sums float64
    base = ((w32 @ c) * w32).sum(dtype=torch.float64).clamp_min(torch.finfo(torch.float64).tiny)
    return float(((delta @ c) * delta).sum(dtype=torch.float64) / base)


def normalized_root(moment: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """``L (in, in)``, lower triangular, float64, with ``L L^T = C_r``: what the fit's
    closed-form start and the allocation's whitening both need. Any square root serves
    (``||D L||_F^2 = tr(D C_r D^T)`` for every ``L`` with ``L L^T = C_r``); Cholesky's costs
    a tenth of an eigendecomposition, and ``C_r`` is positive definite by its ridge."""
    return torch.linalg.cholesky(_normalized_moment(moment.to(torch.float64), ridge))


def _normalized_moment(moment: torch.Tensor, ridge: float) -> torch.Tensor:
    scale = moment.diagonal().mean().clamp_min(torch.finfo(torch.float64).tiny)
    return moment / scale + ridge * torch.eye(moment.shape[0], dtype=moment.dtype, device=moment.device)


def _lbfgs(params: list[torch.Tensor], objective, iterations: int, judge=None) -> int:
    """At most ``iterations`` L-BFGS iterations on ``objective()``; with ``judge`` (an error
    on other data), in chunks of :data:`TABLE_CHUNK`, stopping once the judged error no
    longer falls and leaving ``params`` where it was lowest. Returns the iterations run."""
    chunk = iterations if judge is None else min(iterations, TABLE_CHUNK)
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=chunk, history_size=HISTORY, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-10, tolerance_change=TOLERANCE)

    def closure():
        opt.zero_grad()
        loss = objective()
        loss.backward()
        return loss
    if judge is None:
        opt.step(closure)
        return opt.state[params[0]].get("n_iter", 0)
    with torch.no_grad():
        best, kept = float(judge()), [p.detach().clone() for p in params]
    done = 0
    while done < iterations:
        opt.step(closure)
        before, done = done, opt.state[params[0]].get("n_iter", 0)   # L-BFGS's own count, over its steps
        with torch.no_grad():
            now = float(judge())
        if now < best:
            best, kept = now, [p.detach().clone() for p in params]
        if not now < best * (1 + TOLERANCE) or done == before:   # rising, or converged (no iteration made)
            break
    with torch.no_grad():
        for p, k in zip(params, kept):
            p.copy_(k)
    return done


def _fit(cores: list[torch.Tensor], objective, iterations: int, report=None,
         baseline: list[torch.Tensor] | None = None, judge=None) -> FitResult:
    """L-BFGS on ``objective(cores)`` from ``cores``; errors measured by ``report``
    (default: the objective), the "before" one at ``baseline`` (default: the start: TT-SVD);
    with ``judge(cores)``, stopped early where that error is lowest (:func:`_lbfgs`)."""
    report = report or objective
    start = [c.detach().clone() for c in cores]
    params = [c.detach().contiguous().clone().requires_grad_(True) for c in cores]
    with torch.no_grad():
        at_start = float(report(start))
        before = float(report(baseline)) if baseline is not None else at_start
    ran = 0
    if iterations > 0 and at_start > 0:
        ran = _lbfgs(params, lambda: objective(params), iterations, None if judge is None else lambda: judge(params))
    with torch.no_grad():
        after = float(report(params))
    if not after <= at_start:  # NaN or worse: keep the start
        return FitResult(start, before, at_start, ran)
    return FitResult([p.detach() for p in params], before, after, ran)


def fit_linear_cores(weight: torch.Tensor, layout: TTLayout, moment: torch.Tensor, *, ridge: float = RIDGE,
                     iterations: int = LINEAR_ITERATIONS, start: list[torch.Tensor] | None = None,
                     root: torch.Tensor | None = None) -> FitResult:
    """TT cores of ``weight`` fit to its outputs on inputs of second moment ``moment``.

    Parameters
    ----------
    weight : Tensor, shape ``(out, in)``
    layout : TTLayout with ranks
    moment : Tensor, shape ``(in, in)``
        ``X^T X / rows`` of the layer's calibration inputs.
    start : list of Tensor, optional
        The weight's TT-SVD cores where the caller has them: not computed again.
    root : Tensor, optional
        :func:`normalized_root` of ``moment`` at ``ridge``, where the caller has it.

    Returns
    -------
    FitResult
        float64 cores ``(r_{k-1}, s_k, r_k)`` and the relative output errors.
    """
    w = weight.detach().to(torch.float64)
    out_f, in_f = w.shape
    c = torch.zeros(layout.padded_in, layout.padded_in, dtype=torch.float64, device=w.device)
    c[:in_f, :in_f] = _normalized_moment(moment.to(device=w.device, dtype=torch.float64), ridge)
    cw = c[:, :in_f] @ w.t()                                    # C W^T  (padded_in, out)
    base = (w.t() * cw[:in_f]).sum()                            # tr(W C W^T)
    n_in = len(layout.in_modes)

    def error_in(dtype: torch.dtype):
        c_d, cw_d = c.to(dtype), cw.to(dtype)

        def error(cores):
            a, b = tt_factors([k.to(dtype) for k in cores], n_in)
            b = b[:, :out_f]
            quad = ((a.t() @ c_d @ a) * (b @ b.t())).sum(dtype=torch.float64)
            cross = ((a.t() @ cw_d) * b).sum(dtype=torch.float64)
            return (quad - 2 * cross + base) / base
        return error
    objective, exact = error_in(LINEAR_FIT_DTYPE), error_in(torch.float64)
    plain = [c.detach().to(torch.float64) for c in start] if start is not None else tt_from_linear_weight(w, layout)
    # the bond between input and output cores at its best in this metric (closed form), then TT-SVD of that
    root = root if root is not None else normalized_root(moment, ridge)
    # a start, polished by the fit after: its products and SVDs in START_DTYPE
    nearest = _best_at_bond(w.to(START_DTYPE), root.to(device=w.device, dtype=START_DTYPE), layout.ranks[n_in - 1])
    whitened = [k.to(torch.float64) for k in tt_from_linear_weight(nearest, layout)]
    with torch.no_grad():
        start = whitened if float(exact(whitened)) < float(exact(plain)) else plain
    return _fit(start, objective, iterations, report=exact, baseline=plain)


def _best_at_bond(w: torch.Tensor, root: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank-``rank`` matrix nearest ``w`` in ``tr(D C D^T)``: ``W L`` projected on its
    leading ``rank`` singular vectors (truncated SVD), mapped back by ``L^{-1}`` (``L L^T = C``, ``L`` invertible: ``C`` has the ridge; ``X -> X L``
    maps the rank-``rank`` matrices onto themselves, so the nearest is found where the
    metric is Frobenius)."""
    m = w @ root
    if m.shape[0] >= m.shape[1]:    # the leading singular subspace from the smaller Gram: a third of an SVD's time
        v = torch.linalg.eigh(m.t() @ m).eigenvectors[:, -rank:]
        nearest = (m @ v) @ v.t()
    else:
        u = torch.linalg.eigh(m @ m.t()).eigenvectors[:, -rank:]
        nearest = u @ (u.t() @ m)
    return torch.linalg.solve_triangular(root, nearest, upper=False, left=False)


def row_weights(counts: torch.Tensor, uniform_share: float = UNIFORM_SHARE) -> torch.Tensor:
    """Per-row fitting weight ``(V,)``, float64, summing to 1: lookup share plus an even floor."""
    counts = counts.to(torch.float64)
    total = counts.sum()
    used = counts / total if total > 0 else torch.full_like(counts, 1.0 / counts.numel())
    return (1 - uniform_share) * used + uniform_share / counts.numel()


def fit_table_cores(table: torch.Tensor, layout: TTMLayout, counts: torch.Tensor, *,
                    uniform_share: float = UNIFORM_SHARE, iterations: int = TABLE_ITERATIONS,
                    sample_rows: int = UNUSED_SAMPLE, held_out_rows: int = HELD_OUT_SAMPLE,
                    seed: int = 0, start: list[torch.Tensor] | None = None) -> FitResult:
    """TTM cores of an embedding table fit with rows weighted by use.

    The error is evaluated on the rows calibration used plus a fixed random
    sample of ``sample_rows`` unused rows standing for all of them (their even
    share scaled up), each row built from the two half tables of the network
    (``O(rows x D x r)`` per step, never the whole table). Every
    :data:`TABLE_CHUNK` iterations the error is estimated again with ``held_out_rows``
    other unused rows in place of the sample; the fit stops when that rises (fitting the
    sample ever closer only overfits it) and keeps the cores it was lowest at. The reported errors are
    exact, over every row.

    Parameters
    ----------
    table : Tensor, shape ``(V, D)``
    layout : TTMLayout with ranks
    counts : Tensor, shape ``(V,)``
        Lookups of each row in the calibration inputs.
    start : list of Tensor, optional
        The table's TT-SVD cores where the caller has them (the layer just built):
        not computed again.
    """
    e = table.detach().to(torch.float64)
    w = row_weights(counts, uniform_share).to(e.device)
    used = torch.nonzero(counts.to(e.device) > 0).flatten()
    unused = torch.nonzero(counts.to(e.device) == 0).flatten()
    scale = torch.ones(e.shape[0], dtype=torch.float64, device=e.device)
    held_out = None
    if unused.numel() > sample_rows:
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(unused.numel(), generator=gen).to(e.device)
        if unused.numel() >= sample_rows + held_out_rows > sample_rows:   # the used rows, and others for the unused
            held_out = torch.cat([used, unused[order[sample_rows:sample_rows + held_out_rows]]]).sort().values
            judged_scale = torch.zeros_like(scale)
            judged_scale[used] = 1.0
            judged_scale[unused[order[sample_rows:sample_rows + held_out_rows]]] = unused.numel() / held_out_rows
        scale[unused] = 0.0
        scale[unused[order[:sample_rows]]] = unused.numel() / sample_rows
        unused = unused[order[:sample_rows]]
    base = (w[:, None] * e * e).sum()
    split = max(1, len(layout.row_modes) // 2)

    def error_on(rows: torch.Tensor, row_w: torch.Tensor):
        target, row_w = e[rows].to(TABLE_FIT_DTYPE), row_w.to(TABLE_FIT_DTYPE)
        i, j = split_ids(rows, prod(layout.row_modes[split:]))

        def error(cores):
            left, right = half_tables(cores, split)
            out = GatheredProduct.apply(left, right, i, j).reshape(rows.numel(), -1)
            diff = out[:, : e.shape[1]] - target
            return (row_w * diff * diff).sum() / base
        return error
    rows = torch.cat([used, unused]).sort().values
    sampled = error_on(rows, (w * scale)[rows][:, None])
    judged = None if held_out is None else error_on(held_out, (w * judged_scale)[held_out][:, None])

    def exact(cores):
        diff = ttm_to_dense([c.to(torch.float64) for c in cores], layout) - e
        return (w[:, None] * diff * diff).sum() / base
    start = [c.detach().to(TABLE_FIT_DTYPE) for c in (start if start is not None else ttm_from_embedding_weight(e, layout))]
    return _fit(start, sampled, iterations, report=exact, judge=judged)


def weighted_table(table: torch.Tensor, counts: torch.Tensor, uniform_share: float = UNIFORM_SHARE) -> torch.Tensor:
    """``diag(sqrt(w)) E``: its plain Frobenius error is the usage-weighted error."""
    w = row_weights(counts, uniform_share).to(table.device)
    return table.detach().to(torch.float64) * w.sqrt()[:, None]
