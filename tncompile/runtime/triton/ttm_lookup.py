"""Rows of a TTM embedding from its two merged halves, one Triton launch each way.

A TTM table's row ``id`` with row digits ``(i_0, .., i_{d-1})`` is the product of the core
slices ``G_k[:, i_k, :, :]``. Viewing each core ``(r_{k-1}, m_k, n_k, r_k)`` as a TT core
``(r_{k-1}, m_k n_k, r_k)``, the batched merge (:mod:`.merge_factors`, one network) gives
the two halves ``A (prod_{k<split} m_k n_k, r)`` and ``B (r, prod_{k>=split} m_k n_k)``,
gates included, in one launch: their rows and columns interleave each core's ``m`` and
``n`` digits. Here a program per id reads its ``(N_L, r)`` slab of ``A`` and ``(r, N_R)``
slab of ``B`` through those digits (no permuted copies) and writes the row
``(N_L N_R,)`` = ``(n_0, .., n_{d-1})``; the backward's program per id adds ``dOut B^T``
and ``A^T dOut`` into the halves' gradients (atomic adds: the order of a repeated id's
sums is not fixed on a GPU, as ``index_add_``'s is not), skipping ``padding_idx``.

``tncompile::ttm_gather`` and ``tncompile::ttm_scatter_`` are custom ops with fake
kernels; on the CPU without the interpreter the same index arithmetic runs in PyTorch ops.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from .device_ops import direct
from .merge_factors import _acc, _runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

__all__ = ["lookup_table", "ttm_gather", "ttm_scatter_", "ttm_gather_op", "ttm_scatter_op"]

BLOCK_R = 16


@functools.cache
def _digits(row_modes: tuple[int, ...], col_modes: tuple[int, ...], split: int) -> list[list[int]]:
    """Per core: ``m_k``, ``n_k``, the place value of its combined ``(m, n)`` digit in its
    half (``A``'s rows or ``B``'s columns), and the place value of its row digit in an id."""
    d = len(row_modes)
    rows = []
    for k in range(d):
        side = range(k + 1, split) if k < split else range(k + 1, d)
        place = math.prod(row_modes[j] * col_modes[j] for j in side)
        rows.append([row_modes[k], col_modes[k], place, math.prod(row_modes[k + 1:])])
    return rows


_TABLES: dict[tuple, Tensor] = {}


def lookup_table(row_modes: Sequence[int], col_modes: Sequence[int], split: int, ids: Tensor) -> Tensor:
    """The digits table of a layout and split (:func:`_digits`), int64 on ``ids``' device;
    made once per device (for fake or meta ids, a dry run's, its shape only: the ops' fake
    kernels read no values)."""
    if isinstance(ids, FakeTensor) or ids.is_meta:
        return ids.new_empty((len(row_modes), 4), dtype=torch.int64)
    key = (tuple(row_modes), tuple(col_modes), split, ids.device)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = torch.tensor(_digits(*key[:3]), dtype=torch.int64, device=ids.device)
    return table


def _offsets(ids_row: Tensor, index: Tensor, table: list[list[int]], cores: range) -> Tensor:
    """Offsets into a half (``A``'s rows or ``B``'s columns) of each id's ``index``-th entry
    of its slab: ``(T, len(index))``, the PyTorch form of the kernels' index arithmetic."""
    out = torch.zeros(ids_row.shape[0], index.shape[0], dtype=torch.int64, device=ids_row.device)
    rem = index
    for k in reversed(cores):
        m, n, place, row_place = table[k]
        digit = torch.div(ids_row, row_place, rounding_mode="floor") % m
        out += (digit[:, None] * n + (rem % n)[None, :]) * place
        rem = torch.div(rem, n, rounding_mode="floor")
    return out


# ---------------------------------------------------------------- kernels
@functools.cache
def _compiled(name: str, device_type: str):
    global _slab_offsets
    fn = {"gather": _gather_kernel, "scatter": _scatter_kernel}[name]
    if device_type == "cuda":
        _slab_offsets = triton.jit(_slab_offsets_impl)
        return triton.jit(fn)
    from triton.runtime.interpreter import InterpretedFunction
    _slab_offsets = InterpretedFunction(_slab_offsets_impl)
    return InterpretedFunction(fn)


def _slab_offsets_impl(ident, idx, table_ptr, first, last):
    """Offsets of slab entries ``idx`` (a vector) for id ``ident``: cores ``last-1 .. first``."""
    off = tl.zeros(idx.shape, dtype=tl.int64)
    rem = idx.to(tl.int64)
    for back in range(0, last - first):
        k = last - 1 - back
        m = tl.load(table_ptr + 4 * k)
        n = tl.load(table_ptr + 4 * k + 1)
        place = tl.load(table_ptr + 4 * k + 2)
        digit = (ident // tl.load(table_ptr + 4 * k + 3)) % m
        off += (digit * n + rem % n) * place
        rem = rem // n
    return off


_slab_offsets = None   # the helper, jitted as the kernels calling it are (:func:`_compiled`)


def _gather_kernel(a_ptr, b_ptr, ids_ptr, table_ptr, out_ptr, R, NL, NR, SPLIT, D, b_cols, out_stride,
                   ACC: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    t = tl.program_id(0)
    ident = tl.load(ids_ptr + t).to(tl.int64)
    for l0 in range(0, NL, BL):
        ls = l0 + tl.arange(0, BL)
        rows = _slab_offsets(ident, ls, table_ptr, 0, SPLIT)
        for n0 in range(0, NR, BN):
            ns = n0 + tl.arange(0, BN)
            cols = _slab_offsets(ident, ns, table_ptr, SPLIT, D)
            acc = tl.zeros((BL, BN), dtype=ACC)
            for r0 in range(0, R, BR):
                rs = r0 + tl.arange(0, BR)
                a = tl.load(a_ptr + rows[:, None] * R + rs[None, :], mask=(ls[:, None] < NL) & (rs[None, :] < R),
                            other=0.0).to(ACC)
                b = tl.load(b_ptr + rs[:, None] * b_cols + cols[None, :],
                            mask=(rs[:, None] < R) & (ns[None, :] < NR), other=0.0).to(ACC)
                acc += tl.dot(a, b, input_precision="ieee", out_dtype=ACC)
            tl.store(out_ptr + t * out_stride + ls[:, None] * NR + ns[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=(ls[:, None] < NL) & (ns[None, :] < NR))


def _scatter_kernel(da_ptr, db_ptr, a_ptr, b_ptr, ids_ptr, table_ptr, dout_ptr, R, NL, NR, SPLIT, D, b_cols,
                    dout_stride, padding_idx, ACC: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr,
                    BR: tl.constexpr):
    t = tl.program_id(0)
    ident = tl.load(ids_ptr + t).to(tl.int64)
    if ident != padding_idx:
        for r0 in range(0, R, BR):
            rs = r0 + tl.arange(0, BR)
            for l0 in range(0, NL, BL):          # dA slab rows: dOut (NL, NR) @ B_slab^T (NR, r)
                ls = l0 + tl.arange(0, BL)
                rows = _slab_offsets(ident, ls, table_ptr, 0, SPLIT)
                acc = tl.zeros((BL, BR), dtype=ACC)
                for n0 in range(0, NR, BN):
                    ns = n0 + tl.arange(0, BN)
                    cols = _slab_offsets(ident, ns, table_ptr, SPLIT, D)
                    g = tl.load(dout_ptr + t * dout_stride + ls[:, None] * NR + ns[None, :],
                                mask=(ls[:, None] < NL) & (ns[None, :] < NR), other=0.0).to(ACC)
                    bt = tl.load(b_ptr + rs[None, :] * b_cols + cols[:, None],
                                 mask=(rs[None, :] < R) & (ns[:, None] < NR), other=0.0).to(ACC)
                    acc += tl.dot(g, bt, input_precision="ieee", out_dtype=ACC)
                tl.atomic_add(da_ptr + rows[:, None] * R + rs[None, :], acc.to(da_ptr.dtype.element_ty),
                              mask=(ls[:, None] < NL) & (rs[None, :] < R))
            for n0 in range(0, NR, BN):          # dB slab columns: A_slab^T (r, NL) @ dOut (NL, NR)
                ns = n0 + tl.arange(0, BN)
                cols = _slab_offsets(ident, ns, table_ptr, SPLIT, D)
                acc = tl.zeros((BR, BN), dtype=ACC)
                for l0 in range(0, NL, BL):
                    ls = l0 + tl.arange(0, BL)
                    rows = _slab_offsets(ident, ls, table_ptr, 0, SPLIT)
                    at = tl.load(a_ptr + rows[None, :] * R + rs[:, None],
                                 mask=(rs[:, None] < R) & (ls[None, :] < NL), other=0.0).to(ACC)
                    g = tl.load(dout_ptr + t * dout_stride + ls[:, None] * NR + ns[None, :],
                                mask=(ls[:, None] < NL) & (ns[None, :] < NR), other=0.0).to(ACC)
                    acc += tl.dot(at, g, input_precision="ieee", out_dtype=ACC)
                tl.atomic_add(db_ptr + rs[:, None] * b_cols + cols[None, :], acc.to(db_ptr.dtype.element_ty),
                              mask=(rs[:, None] < R) & (ns[None, :] < NR))


def _blocks(nl: int, nr: int) -> dict:
    return {"BL": max(16, min(64, triton.next_power_of_2(nl))), "BN": max(16, min(64, triton.next_power_of_2(nr))),
            "BR": BLOCK_R}


# ---------------------------------------------------------------- custom ops
def _gather(a: Tensor, b: Tensor, ids: Tensor, table: Tensor, split: int, n_left: int, n_right: int) -> Tensor:
    """Rows ``ids (T,)`` of the table whose halves are ``a (M_A, r)`` and ``b (r, N_B)``:
    ``(T, n_left * n_right)``, ``n_left``/``n_right`` the products of the halves' ``n`` modes."""
    d = table.shape[0]
    out = a.new_empty(ids.shape[0], n_left * n_right)
    if ids.shape[0] == 0:
        return out
    if _runs_triton(a):
        _compiled("gather", a.device.type)[(ids.shape[0],)](
            a, b, ids, table, out, a.shape[1], n_left, n_right, split, d, b.shape[1], out.stride(0),
            ACC=_acc(a), **_blocks(n_left, n_right))
        return out
    digits = table.tolist()
    rows = _offsets(ids, torch.arange(n_left, device=ids.device), digits, range(0, split))   # (T, NL)
    cols = _offsets(ids, torch.arange(n_right, device=ids.device), digits, range(split, d))  # (T, NR)
    prod = torch.bmm(a[rows], b.t()[cols].transpose(1, 2))                                      # (T, NL, NR)
    return out.copy_(prod.reshape(ids.shape[0], -1))


ttm_gather_op = torch.library.custom_op("tncompile::ttm_gather", _gather, mutates_args=())


@ttm_gather_op.register_fake
def _(a, b, ids, table, split, n_left, n_right):
    return a.new_empty(ids.shape[0], n_left * n_right)


def _scatter(da: Tensor, db: Tensor, a: Tensor, b: Tensor, ids: Tensor, table: Tensor, dout: Tensor,
             split: int, n_left: int, n_right: int, padding_idx: Optional[int]) -> None:
    """Add each id's ``dOut B_slab^T`` into ``da`` and ``A_slab^T dOut`` into ``db`` (zeroed
    by the caller), ids equal to ``padding_idx`` left out."""
    d = table.shape[0]
    if ids.shape[0] == 0:
        return
    pad = -1 if padding_idx is None else padding_idx
    if _runs_triton(da):
        _compiled("scatter", da.device.type)[(ids.shape[0],)](
            da, db, a, b, ids, table, dout, a.shape[1], n_left, n_right, split, d, b.shape[1], dout.stride(0), pad,
            ACC=_acc(da), **_blocks(n_left, n_right))
        return
    digits = table.tolist()
    keep = ids != pad
    ids, dout = ids[keep], dout[keep].reshape(-1, n_left, n_right)
    rows = _offsets(ids, torch.arange(n_left, device=ids.device), digits, range(0, split))
    cols = _offsets(ids, torch.arange(n_right, device=ids.device), digits, range(split, d))
    b_slab = b.t()[cols]                                                   # (T, NR, r)
    a_slab = a[rows]                                                       # (T, NL, r)
    da.index_put_((rows.reshape(-1),), torch.bmm(dout, b_slab).reshape(-1, a.shape[1]).to(da.dtype), accumulate=True)
    db.t().index_put_((cols.reshape(-1),), torch.bmm(dout.transpose(1, 2), a_slab).reshape(-1, a.shape[1]).to(db.dtype),
                      accumulate=True)


ttm_scatter_op = torch.library.custom_op("tncompile::ttm_scatter_", _scatter, mutates_args=("da", "db"))


@ttm_scatter_op.register_fake
def _(da, db, a, b, ids, table, dout, split, n_left, n_right, padding_idx):
    return None


def ttm_gather(a: Tensor, b: Tensor, ids: Tensor, table: Tensor, split: int, n_left: int, n_right: int) -> Tensor:
    """``tncompile::ttm_gather`` (its implementation called directly in an eager step: :func:`.direct`)."""
    return (_gather if direct(a) else ttm_gather_op)(a, b, ids, table, split, n_left, n_right)


def ttm_scatter_(da: Tensor, db: Tensor, a: Tensor, b: Tensor, ids: Tensor, table: Tensor, dout: Tensor,
                 split: int, n_left: int, n_right: int, padding_idx: Optional[int]) -> None:
    """``tncompile::ttm_scatter_`` (directly in an eager step)."""
    (_scatter if direct(da) else ttm_scatter_op)(da, db, a, b, ids, table, dout, split, n_left, n_right, padding_idx)
