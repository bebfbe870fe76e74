"""A TTM embedding lookup as one ``torch.library`` custom op, for tracers.

Eagerly, :class:`~tncompile.runtime.TTMEmbedding` checks the ids
on the host, looks up only the distinct ones and runs the native gathered
product. Traced by ``torch.compile``, the same lookup reached inductor as a
device-side id assert, the split of each id into two digits, the half tables'
permuted copies, gathers and index-adds: about eight kernels of its own per
model to generate and compile (about 0.6 s each with a C++ compiler on CPU).
``tncompile::ttm_lookup`` is the whole lookup, gates included, as one opaque
call -- inside it the eager code runs, id check and deduplication included,
as they touch real data there -- and ``tncompile::ttm_lookup_backward`` its
gradient as one more (the half tables' backward written out, the gathered
product's by the native kernel).

The half tables
---------------
A lookup of id ``(i, j)`` (``i`` over the first ``split`` row modes, ``j``
over the rest) is ``L[i] @ R[j]`` with ``L (M_L, N_L, r)`` the first
``split`` cores contracted and ``R (M_R, r, N_R)`` the rest
(:func:`half_tables`).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import tuning
from .gated_cores import gated, gated_grads
from ..native import kernels_for

__all__ = ["half_tables", "split_ids", "distinct_ids", "check_ids", "gathered_product",
           "gathered_product_backward", "ttm_lookup"]


def _merge_left(left: Tensor, core: Tensor) -> Tensor:
    """``left (M, N, a)`` with ``core (a, m, n, b)`` -> ``(M*m, N*n, b)``: one GEMM
    and one permuted copy (``einsum`` costs ~30 us more per call in parsing)."""
    M, N, a = left.shape
    _, m, n, b = core.shape
    prod = left.reshape(M * N, a) @ core.reshape(a, m * n * b)
    return prod.reshape(M, N, m, n, b).permute(0, 2, 1, 3, 4).reshape(M * m, N * n, b)


#: dtypes of 2, 4, 8 and 16 bytes: a small inner block moved as one element
_BLOCK_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


def _swap_middle(x: Tensor, outer: tuple[int, ...], first: int, second: int, block: int) -> Tensor:
    """``x`` read as ``(*outer, first, second, block)``, returned contiguous as
    ``(*outer, second, first, block)``. A block of 2-16 bytes (a TTM's column mode of
    2 or 4) moves as one element of that width -- bytes only, so exact, its gradient moved
    back the same way -- where ``x`` is a plain tensor the native CPU kernels apply to
    (:func:`~tncompile.runtime.native.kernels_for`): PyTorch's CPU strided copy is several
    times slower with an inner dimension that narrow. Elsewhere one permuted copy (``x`` may
    be strided): under ``torch.compile`` (inductor fuses it), on GPUs (not measured there),
    for tensor subclasses, odd alignment or widths."""
    rows = math.prod(outer)
    width = block * x.element_size()
    if (not torch.compiler.is_compiling() and type(x) is Tensor and width in _BLOCK_DTYPES
            and kernels_for(x) is not None):
        x = x.contiguous()
        if x.data_ptr() % width == 0:
            return _BlockSwap.apply(x, rows, first, second, block).reshape(*outer, second, first, block)
    return x.reshape(*outer, first, second, block).transpose(-3, -2).contiguous()


def _move_blocks(x: Tensor, outer: int, first: int, second: int, block: int) -> Tensor:
    wide = _BLOCK_DTYPES[block * x.element_size()]
    moved = x.reshape(outer, first, second * block).view(wide).transpose(1, 2).contiguous()
    return moved.view(x.dtype).reshape(outer, second, first, block)


class _BlockSwap(torch.autograd.Function):
    """:func:`_swap_middle`'s byte move, and the same move back for its gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, outer: int, first: int, second: int, block: int) -> Tensor:
        ctx.sizes, ctx.shape = (outer, first, second, block), x.shape
        return _move_blocks(x, outer, first, second, block)

    @staticmethod
    def backward(ctx, grad: Tensor):
        outer, first, second, block = ctx.sizes
        grad = grad.contiguous()
        back = (_move_blocks(grad, outer, second, first, block) if grad.data_ptr() % (block * grad.element_size()) == 0
                else grad.reshape(outer, second, first, block).transpose(1, 2).contiguous())
        return back.reshape(ctx.shape), None, None, None, None


def _merge_right(core: Tensor, right: Tensor) -> Tensor:
    """``core (a, m, n, b)`` with ``right (b, M, N)`` -> ``(a, m*M, n*N)``."""
    a, m, n, b = core.shape
    _, M, N = right.shape
    prod = core.reshape(a * m * n, b) @ right.reshape(b, M * N)
    return _swap_middle(prod, (a, m), n, M, N).reshape(a, m * M, n * N)


def half_tables(cores: list[Tensor], split: int) -> tuple[Tensor, Tensor]:
    """``L (M_L, N_L, r)`` from ``cores[:split]`` and ``R (M_R, r, N_R)`` from
    the rest (TTM cores ``(r_k, m_k, n_k, r_{k+1})``, gates already applied)."""
    left = cores[0].squeeze(0)                                   # (m0, n0, r1)
    for c in cores[1:split]:
        left = _merge_left(left, c)
    right = cores[-1].squeeze(-1)                                # (r, m, n)
    for c in reversed(cores[split:-1]):
        right = _merge_right(c, right)
    return left, right.transpose(0, 1)                           # R: (M_R, r, N_R)


def _half_tables_backward(cores: list[Tensor], split: int, g_left: Tensor,
                          g_right: Tensor) -> list[Tensor]:
    """The gradients of ``cores`` (gated) given those of :func:`half_tables`'s
    two outputs: the partial tables rebuilt (none with two cores a side),
    then each merge walked back."""
    grads: list[Tensor] = [g_left] * len(cores)                  # every entry is overwritten
    lefts = [cores[0].squeeze(0)]                                # the partial left tables before the last merge
    for c in cores[1:split - 1]:
        lefts.append(_merge_left(lefts[-1], c))
    g = g_left
    for k in range(split - 1, 0, -1):                            # left_k = merge(left_{k-1}, cores[k])
        prev, c = lefts[k - 1], cores[k]
        (M, N, a), (_, m, n, b) = prev.shape, c.shape
        g_prod = g.reshape(M, m, N, n, b).permute(0, 2, 1, 3, 4).reshape(M * N, m * n * b)
        grads[k] = (prev.reshape(M * N, a).t() @ g_prod).reshape(a, m, n, b)
        g = (g_prod @ c.reshape(a, m * n * b).t()).reshape(M, N, a)
    grads[0] = g.unsqueeze(0)
    last = len(cores) - 1
    rights = {last: cores[-1].squeeze(-1)}                       # right_k: the table of cores[k:]
    for k in range(last - 1, split, -1):
        rights[k] = _merge_right(cores[k], rights[k + 1])
    g = g_right.transpose(0, 1)                                  # (r, M_R, N_R)
    for k in range(split, last):                                 # right_k = merge(cores[k], right_{k+1})
        nxt, c = rights[k + 1], cores[k]
        (a, m, n, b), (_, M, N) = c.shape, nxt.shape
        g_prod = _swap_middle(g, (a, m), M, n, N).reshape(a * m * n, M * N)
        grads[k] = (g_prod @ nxt.reshape(b, M * N).t()).reshape(a, m, n, b)
        g = (c.reshape(a * m * n, b).t() @ g_prod).reshape(b, M, N)
    grads[-1] = g.unsqueeze(-1)
    return grads


def split_ids(flat: Tensor, m_right: int) -> tuple[Tensor, Tensor]:
    """Each id as its two digits ``(i, j)`` with ``j < m_right`` (the product of
    the right half's row modes; row-major)."""
    i = torch.div(flat, m_right, rounding_mode="floor")
    return i, flat - i * m_right


def gathered_product(left: Tensor, right: Tensor, i: Tensor, j: Tensor) -> Tensor:
    """``out[t] = left[i[t]] @ right[j[t]]``: the native kernel where it applies
    (CPU fp32/fp64, no autocast, not traced), else two gathers and a ``bmm``."""
    native = kernels_for(left) if left.dtype == right.dtype else None
    if native is not None:
        return native.gathered_product(left, right, i, j)
    return torch.bmm(left.index_select(0, i), right.index_select(0, j))


def gathered_product_backward(grad: Tensor, left: Tensor, right: Tensor, i: Tensor, j: Tensor,
                              need_left: bool = True, need_right: bool = True
                              ) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of ``left`` and ``right`` (``None`` where not needed). The
    fallback rebuilds the gathered slices rather than keeping them, and gives
    every ``bmm`` contiguous operands (CPU ``bmm`` on transposed batch views
    falls back to one small GEMM per id)."""
    native = kernels_for(grad) if grad.dtype == left.dtype == right.dtype else None
    if native is not None:
        g_left, g_right = native.gathered_product_backward(grad, left, right, i, j, need_left, need_right)
        return (g_left if need_left else None), (g_right if need_right else None)
    grad = grad.contiguous()
    g_left = g_right = None
    if need_left:
        b_t = right.transpose(1, 2).contiguous().index_select(0, j)          # (T, N_R, r)
        # new_zeros, not zeros_like: R arrives as a transposed view, and index_add_
        # into a strided destination takes a slow path (7 ms instead of 1 at 4096 ids)
        g_left = left.new_zeros(left.shape).index_add_(0, i, torch.bmm(grad, b_t).to(left.dtype))
    if need_right:
        a_t = left.transpose(1, 2).contiguous().index_select(0, i)           # (T, r, N_L)
        g_right = right.new_zeros(right.shape).index_add_(0, j, torch.bmm(a_t, grad).to(right.dtype))
    return g_left, g_right


def distinct_ids(flat: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(ids to look up, inverse)``: on CPU, for batches of at least
    ``tuning.DEDUP_MIN_IDS`` ids of which under ``tuning.DEDUP_BELOW`` are
    distinct, the distinct ids and where each id finds its row; else the ids
    and ``None``. (``torch.unique``'s output size depends on the data: never on a
    device, whose step must stay capturable.)"""
    if flat.numel() >= tuning.DEDUP_MIN_IDS and flat.device.type == "cpu":
        unique, inverse = torch.unique(flat, return_inverse=True)
        if unique.numel() < tuning.DEDUP_BELOW * flat.numel():
            return unique, inverse
    return flat, None


def _no_autocast(device_type: str):
    """Autocast off inside the ops: their outputs keep the cores' dtype, as the
    fake kernels say (and as ``nn.Embedding`` does under autocast)."""
    try:
        active = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know
        active = False
    return torch.autocast(device_type=device_type, enabled=False) if active else contextlib.nullcontext()


def check_ids(ids: Tensor, num_embeddings: int, who: str = "TTMEmbedding", host_read: bool = True) -> None:
    """Ids must lie in ``[0, num_embeddings)``: on CPU (and ``host_read``) a host
    read, an ``IndexError`` naming the bad id; otherwise a device-side assert
    (``torch._assert_async``: no host sync, so a step stays capturable or traceable)."""
    if ids.numel() == 0:
        return
    if ids.device.type != "cpu" or not host_read:
        torch._assert_async(((ids >= 0) & (ids < num_embeddings)).all(),
                            f"{who}: an id is out of range [0, {num_embeddings})")
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_embeddings:
        raise IndexError(f"{who}: id {lo if lo < 0 else hi} out of range [0, {num_embeddings})")


@torch.library.custom_op("tncompile::ttm_lookup", mutates_args=())
def ttm_lookup(ids: Tensor, cores: list[Tensor], gates: list[Tensor], split: int, num_embeddings: int,
               embedding_dim: int, padding_idx: int | None) -> list[Tensor]:
    """Rows ``ids (T,)`` of the TTM table ``cores`` (gates ``gates`` on each
    core's right bond but the last's) -> ``[out (T, embedding_dim), L, R]``:
    the rows and the two half tables (kept for the backward). Positions
    holding ``padding_idx`` send no gradient (``nn.Embedding``'s meaning).
    Ids are checked against ``num_embeddings`` (:func:`check_ids`)."""
    check_ids(ids, num_embeddings)
    with _no_autocast(ids.device.type):
        left, right = half_tables(gated(cores, gates), split)
        lookup, inverse = distinct_ids(ids)  # a data-dependent size is fine inside the op
        i, j = split_ids(lookup, right.shape[0])
        out = gathered_product(left, right, i, j).reshape(lookup.shape[0], -1)[:, :embedding_dim]
        if inverse is not None:
            out = out.index_select(0, inverse)
        return [out.contiguous(), left.contiguous(), right.contiguous()]


def _table_shapes(cores, split: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    left_rows = math.prod(c.shape[1] for c in cores[:split])
    left_cols = math.prod(c.shape[2] for c in cores[:split])
    right_rows = math.prod(c.shape[1] for c in cores[split:])
    right_cols = math.prod(c.shape[2] for c in cores[split:])
    return (left_rows, left_cols, cores[split].shape[0]), (right_rows, cores[split].shape[0], right_cols)


@ttm_lookup.register_fake
def _(ids, cores, gates, split, num_embeddings, embedding_dim, padding_idx):
    left, right = _table_shapes(cores, split)
    first = cores[0]
    return [first.new_empty((ids.shape[0], embedding_dim)), first.new_empty(left), first.new_empty(right)]


@torch.library.custom_op("tncompile::ttm_lookup_backward", mutates_args=())
def ttm_lookup_backward(grad: Tensor, ids: Tensor, cores: list[Tensor], gates: list[Tensor], left: Tensor,
                        right: Tensor, split: int, padding_idx: int | None) -> list[Tensor]:
    """The gradients of ``cores`` then ``gates`` of :func:`ttm_lookup` for the
    output gradient ``grad (T, embedding_dim)``; ``left``, ``right``: the
    half tables the forward returned."""
    with _no_autocast(grad.device.type):
        grad = grad.to(cores[0].dtype)
        if padding_idx is not None:
            grad = grad * (ids != padding_idx).unsqueeze(-1).to(grad.dtype)
        padded_cols = math.prod(c.shape[2] for c in cores)
        if padded_cols != grad.shape[1]:
            grad = F.pad(grad, (0, padded_cols - grad.shape[1]))
        i, j = split_ids(ids, right.shape[0])
        g_left, g_right = gathered_product_backward(
            grad.reshape(ids.shape[0], left.shape[1], right.shape[2]).contiguous(), left, right, i, j)
        g_gated = _half_tables_backward(gated(cores, gates), split, g_left, g_right)
        return [t.contiguous() for t in gated_grads(g_gated, cores, gates)]


@ttm_lookup_backward.register_fake
def _(grad, ids, cores, gates, left, right, split, padding_idx):
    return [c.new_empty(c.shape) for c in cores] + [g.new_empty(g.shape) for g in gates]


def _setup(ctx, inputs, output):
    ids, cores, gates, split, _, _, padding_idx = inputs
    ctx.n, ctx.split, ctx.padding_idx = len(cores), split, padding_idx
    ctx.save_for_backward(ids, output[1], output[2], *cores, *gates)


def _backward(ctx, grads):
    ids, left, right, *params = ctx.saved_tensors
    got = ttm_lookup_backward(grads[0], ids, params[:ctx.n], params[ctx.n:], left, right, ctx.split,
                              ctx.padding_idx)
    return None, got[:ctx.n], got[ctx.n:], None, None, None, None


ttm_lookup.register_autograd(_backward, setup_context=_setup)
