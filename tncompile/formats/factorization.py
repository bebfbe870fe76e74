"""TT-SVD and random initialization of TT / TTM cores."""
from __future__ import annotations

from math import prod

import torch

from .layout import TTLayout, TTMLayout

__all__ = ["tt_svd", "tt_from_linear_weight", "linear_unfolding_ranks", "ttm_from_embedding_weight",
           "random_cores", "core_std", "tt_to_dense", "ttm_to_dense", "tt_factors"]


def tt_svd(tensor: torch.Tensor, ranks: tuple[int, ...]) -> list[torch.Tensor]:
    """Sequential truncated SVD (Oseledets' TT-SVD).

    Parameters
    ----------
    tensor : Tensor, shape ``(s_1, ..., s_K)``
    ranks : tuple of int, length ``K - 1``
        Internal ranks; each is clipped to what the unfolding allows.

    Returns
    -------
    list of Tensor
        ``K`` cores of shape ``(r_{k-1}, s_k, r_k)``. Exact when every rank is
        at least the rank of the corresponding unfolding.
    """
    sizes = tensor.shape
    work = tensor.reshape(1, -1)
    cores = []
    r_prev = 1
    for k, s in enumerate(sizes[:-1]):
        mat = work.reshape(r_prev * s, -1)
        u, sv, vh = _truncated_svd(mat, ranks[k])
        r = min(ranks[k], sv.numel())
        cores.append(u[:, :r].reshape(r_prev, s, r))
        work = sv[:r, None] * vh[:r]
        r_prev = r
    cores.append(work.reshape(r_prev, sizes[-1], 1))
    return cores


def _truncated_svd(mat: torch.Tensor, rank: int):
    """Leading ``rank`` singular triplets: exact SVD when the rank is a large
    share of the matrix, randomized (Halko et al., seeded, 4 power iterations)
    when it is a small one -- TT-SVD of a 30522x768 table drops from ~15 s to
    about a second."""
    full = min(mat.shape)
    if rank * 4 >= full:
        if mat.shape[1] > 4 * mat.shape[0]:  # wide: SVD of the small R of mat.T = QR
            q, r = torch.linalg.qr(mat.t())
            u, sv, wh = torch.linalg.svd(r.t())
            return u, sv, wh @ q.t()
        return torch.linalg.svd(mat, full_matrices=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        u, sv, v = torch.svd_lowrank(mat, q=min(full, rank + 16), niter=4)
    return u, sv, v.t()


def _pad2(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = w.new_zeros(rows, cols)
    out[: w.shape[0], : w.shape[1]] = w
    return out


def _fit_ranks(cores: list[torch.Tensor], ranks: tuple[int, ...]) -> list[torch.Tensor]:
    """Zero-pad cores whose SVD rank came out below the requested rank."""
    full = (1, *ranks, 1)
    fitted = []
    for k, c in enumerate(cores):
        shape = (full[k], *c.shape[1:-1], full[k + 1])
        if tuple(c.shape) == shape:
            fitted.append(c)
            continue
        z = c.new_zeros(shape)
        z[: c.shape[0], ..., : c.shape[-1]] = c
        fitted.append(z)
    return fitted


def tt_from_linear_weight(weight: torch.Tensor, layout: TTLayout) -> list[torch.Tensor]:
    """TT cores for ``weight`` of shape ``[out, in]`` (input modes first)."""
    w = _pad2(weight.detach().t().to(torch.float64), layout.padded_in, layout.padded_out)
    cores = tt_svd(w.reshape(layout.site_sizes), layout.ranks)
    return _fit_ranks(cores, layout.ranks)


def linear_unfolding_ranks(weight: torch.Tensor, layout: TTLayout, rtol: float = 1e-6) -> tuple[int, ...]:
    """The ranks at which TT-SVD holds ``weight`` (``[out, in]``) exactly in ``layout``'s
    modes: per bond, the number of singular values of that unfolding above ``rtol`` times
    the largest (at least 1; at most the layout's bound)."""
    t = _pad2(weight.detach().t().to(torch.float64), layout.padded_in, layout.padded_out)
    sizes = layout.site_sizes
    ranks = []
    for k in range(len(sizes) - 1):
        sv = torch.linalg.svdvals(t.reshape(prod(sizes[:k + 1]), -1))
        ranks.append(max(1, int((sv > rtol * sv[0]).sum())) if sv.numel() and sv[0] > 0 else 1)
    return tuple(min(r, b) for r, b in zip(ranks, layout.rank_bounds()))


def ttm_from_embedding_weight(weight: torch.Tensor, layout: TTMLayout) -> list[torch.Tensor]:
    """TTM cores ``(r, m_k, n_k, r)`` for a table of shape ``[V, D]``."""
    d = len(layout.row_modes)
    w = _pad2(weight.detach().to(torch.float64), layout.padded_rows, layout.padded_cols)
    t = w.reshape(*layout.row_modes, *layout.col_modes)
    perm = [i for k in range(d) for i in (k, d + k)]  # (m1, n1, m2, n2, ...)
    t = t.permute(perm).reshape(layout.site_sizes)
    cores = tt_svd(t, layout.ranks)
    cores = [c.reshape(c.shape[0], m, n, c.shape[-1])
             for c, m, n in zip(cores, layout.row_modes, layout.col_modes)]
    return _fit_ranks(cores, layout.ranks)


def core_std(layout: TTLayout | TTMLayout, variance: float) -> float:
    """The standard deviation of independent zero-mean cores whose product has entries of
    variance ``variance``: an entry of the product is a sum over ``prod(r_1..r_{K-1})``
    products of ``K`` independent core entries, so each core gets variance
    ``(variance / prod(ranks)) ** (1 / K)``."""
    return ((variance / prod(layout.ranks)) ** (1.0 / len(layout.core_shapes()))) ** 0.5


def matched_variance(weight: torch.Tensor, default: float) -> float:
    """The entry variance a random draw gives the network that replaces ``weight``: the
    dense weight's own mean square -- what the model's init gave it (a HuggingFace model's
    ``initializer_range``, a custom init), so the compressed model starts where the dense
    one does -- or ``default`` (the dense layer's default init) where the weight holds no
    values (the meta device, a fake tensor) or none that are finite and nonzero (a zero-initialized
    layer's network would get no gradient)."""
    if weight.numel() == 0 or not _has_values(weight):
        return default
    with torch.no_grad():
        mean_square = float(weight.detach().to(torch.float64).pow(2).mean())
    return mean_square if 0.0 < mean_square < float("inf") else default


def random_cores(layout: TTLayout | TTMLayout, variance: float,
                 generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Gaussian cores (:func:`core_std`) whose product has entries of mean square exactly
    ``variance``."""
    std = core_std(layout, variance)
    cores = [torch.randn(s, generator=generator, dtype=torch.float64) * std for s in layout.core_shapes()]
    # one draw's realized variance scatters widely (its entries share cores: a 5-core draw's is
    # often half or twice the target), so scale the draw to have exactly ``variance``
    realized = mean_square(cores) if _has_values(cores[0]) else 0.0   # drawn on meta: shapes only
    if variance > 0 and realized > 0:
        factor = (variance / realized) ** (0.5 / len(cores))
        cores = [c * factor for c in cores]
    return cores


def _has_values(t: torch.Tensor) -> bool:
    """Whether ``t`` holds numbers (not a meta or fake tensor: those have shapes only)."""
    from torch._subclasses.fake_tensor import is_fake
    return not (t.is_meta or is_fake(t))


def mean_square(cores: list[torch.Tensor]) -> float:
    """Mean square entry of the tensor a chain of cores ``(r_{k-1}, ..., r_k)`` stands for
    (its squared Frobenius norm by contracting each core with itself, never the tensor)."""
    gram = torch.ones(1, 1, dtype=torch.float64)
    entries = 1
    for core in cores:
        flat = core.reshape(core.shape[0], -1, core.shape[-1]).to(torch.float64)
        gram = torch.einsum("ab,asc,bsd->cd", gram, flat, flat)
        entries *= flat.shape[1]
    return float(gram.sum()) / entries


def _chain(cores: list[torch.Tensor]) -> torch.Tensor:
    """Contract cores along their bonds: returns ``(s_1 ... s_K)`` flattened per core."""
    out = cores[0].reshape(-1, cores[0].shape[-1])  # (s1, r1)
    for c in cores[1:]:
        out = out @ c.reshape(c.shape[0], -1)  # (..., s_k * r_k)
        out = out.reshape(-1, c.shape[-1])
    return out.reshape(-1)


def tt_factors(cores: list[torch.Tensor], n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A TT matrix (input modes first) as two thin factors, ``W.T = A @ B``.

    Parameters
    ----------
    cores : list of Tensor
        ``(r_{k-1}, s_k, r_k)``; the first ``n_in`` carry the input modes.

    Returns
    -------
    A : Tensor, shape ``(padded_in, r)``
        The input cores merged; ``r`` is the bond between input and output cores.
    B : Tensor, shape ``(r, padded_out)``
        The output cores merged. Differentiable; costs ``O(in r^2 + out r^2)``
        multiply-adds, never ``in x out x r``.
    """
    a = cores[0].reshape(-1, cores[0].shape[-1])                    # (m_1, r_1)
    for core in cores[1:n_in]:                                      # (m_1..m_k, r_k)
        a = (a @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[-1])
    b = cores[-1].reshape(cores[-1].shape[0], -1)                   # (r, n_last)
    for core in reversed(cores[n_in:-1]):                           # (r, n_j..n_last)
        b = (core.reshape(-1, core.shape[-1]) @ b).reshape(core.shape[0], -1)
    return a, b


def tt_to_dense(cores: list[torch.Tensor], layout: TTLayout) -> torch.Tensor:
    """Dense weight ``[out, in]`` (unpadded) from TT cores: one product of the
    two merged factors (:func:`tt_factors`)."""
    a, b = tt_factors(cores, len(layout.in_modes))
    return (a[: layout.in_features] @ b[:, : layout.out_features]).t()


def ttm_to_dense(cores: list[torch.Tensor], layout: TTMLayout) -> torch.Tensor:
    """Dense table ``[V, D]`` (unpadded) from TTM cores."""
    d = len(layout.row_modes)
    flat = [c.reshape(c.shape[0], -1, c.shape[-1]) for c in cores]
    t = _chain(flat).reshape([s for m, n in zip(layout.row_modes, layout.col_modes) for s in (m, n)])
    perm = list(range(0, 2 * d, 2)) + list(range(1, 2 * d, 2))
    full = t.permute(perm).reshape(layout.padded_rows, layout.padded_cols)
    return full[: layout.num_embeddings, : layout.embedding_dim]
