"""CPU GEMM with the operand layouts and sizes MKL runs fastest for thin products.

A TT layer's big GEMMs have one side of rank size (8-64): a thin output, a
thin contraction, or a weight gradient with a few rows. MKL (on the 2-core
AMD machines these rules were measured on) is sensitive to layout and to
exact sizes there; :func:`cpu_gemm` picks the layout and pads sizes with
zeros where that measured faster. ``benchmarks/bench_gemm_shapes.py``
re-measures the padding rules on the machine at hand.
"""
from __future__ import annotations

import torch

from ... import tuning
from ..native import kernels_for, traced_kernels

__all__ = ["cpu_gemm", "padded_rows", "padded_columns"]


def cpu_gemm(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` with the operand layouts CPU BLAS runs fastest when the
    output is thin (measured on MKL, 2 cores).

    * ``left`` is a transposed view of a large tensor and the output has at
      most ``tuning.GEMM_THIN`` columns (a weight gradient ``x.T @ g``): compute
      ``(right.T @ left.T).T``, whose large operand is then read row by row
      (4x faster at 8 columns, 1.3x at 35).
    * the output has at most ``tuning.GEMM_SKINNY`` columns and ``right`` is row-major:
      copy ``right`` (a few KB) column-major (2x faster).
    * row and column counts MKL handles badly are padded with zeros
      (:func:`padded_rows`, :func:`padded_columns`).
    * a weight gradient with at most ``tuning.WEIGHT_GRAD_ROWS`` rows, ``t.T @ x`` over
      many rows into a wide output, or its transpose ``x.T @ t``, runs the native
      kernel that sums ``t.T @ x`` block by block (1.25-1.6x over MKL at r = 8-35,
      4096 rows, 768 / 3072 columns; at r = 64 MKL is faster);
    * a wide output from a contraction over at most ``tuning.THIN_RANK`` (``t @ B``)
      or a thin output from a wide row-major input (``x @ A``) runs the native
      thin kernels where they are built: 1.03-2.9x faster than MKL at 47 of
      48 points over M = 512, 4096, N = 768, 3072, r = 8-64 (the expand at
      r = 64, M = 4096, N = 3072: 0.78-1.04x; ``bench_gemm_shapes.py``).
    """
    m, n = left.shape[0], right.shape[1]
    k = left.shape[1]
    if m * n * k < tuning.GEMM_TINY:
        return torch.mm(left, right)
    if left.dtype == right.dtype and (k <= tuning.THIN_RANK < n or n <= tuning.THIN_RANK < k):
        # the eager kernels have no autograd formula; while torch.compile traces, the traced ones do
        native = traced_kernels(left) or (None if _recording(left, right) else kernels_for(left))
        if native is not None:
            if k <= tuning.THIN_RANK < n and m * n >= tuning.THIN_OUTPUT:                      # thin rank in, wide out
                return native.thin_expand(left, right, None)
            if n <= tuning.THIN_RANK and k >= 256 and m * k >= tuning.THIN_OUTPUT and left.is_contiguous():  # wide in, thin out
                return native.thin_project(left, right)
    if k >= tuning.WEIGHT_GRAD_MIN_K and left.dtype == right.dtype and not _recording(left, right):
        # a core block's gradient t.T @ x (or its transpose x.T @ t): the thin t read beside each cached
        # row block of x. The kernel copies t into its own (rows x r+1) buffer, so t may have any strides
        # (a rank-padded dt from thin_expand_backward is a narrowed view); x must be row-major.
        if m <= tuning.WEIGHT_GRAD_ROWS < tuning.THIN_RANK < n and right.is_contiguous():
            native = kernels_for(left)
            if native is not None:
                return _weight_grad(native, left.t(), right)
        if n <= tuning.WEIGHT_GRAD_ROWS < tuning.THIN_RANK < m and left.t().is_contiguous():
            native = kernels_for(left)
            if native is not None:
                return _weight_grad(native, right, left.t()).t()
    if n <= tuning.GEMM_THIN and m >= 4 * n and left.stride(0) == 1 and left.stride(1) != 1:
        return torch.mm(right.t(), left.t()).t()
    rows = padded_rows(m, left.shape[1], n)
    if rows != m:
        padded = left.new_zeros(rows, left.shape[1])
        padded[:m] = left
        return torch.mm(padded, right)[:m]
    wide = padded_columns(m, left.shape[1], n)
    if wide != n:
        padded = right.new_zeros(right.shape[0], wide)
        padded[:, :n] = right
        return torch.mm(left, padded)[:, :n]
    if n <= tuning.GEMM_SKINNY < m and right.stride(1) == 1 and right.stride(0) != 1:
        right = right.t().contiguous().t()
    return torch.mm(left, right)


def _weight_grad(native, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t.T @ x`` for a thin ``t (rows x r)`` and a row-major ``x (rows x N)``, on the
    native kernel's weight-gradient pass (``thin_expand_backward``'s ``dB``)."""
    return native.thin_expand_backward(x, t, x.new_zeros(()).expand(t.shape[1], x.shape[1]), False, True, False)[1]


def _recording(left: torch.Tensor, right: torch.Tensor) -> bool:
    """Whether autograd records this product (an eager native kernel would lose its gradient)."""
    return torch.is_grad_enabled() and (left.requires_grad or right.requires_grad)


def padded_rows(m: int, k: int, n: int) -> int:
    """How many rows to compute a GEMM with ``m`` output rows as (zero rows
    appended, cropped after). MKL on this CPU runs 5-7 output rows slower
    than 8 and 9-11 slower than 12 when the product is large: measured over
    ``K = 4096, N = 3072`` (a rank-8 layer's core gradient with its bias row
    has 9), 9-11 rows take 11-12 ms, 12 rows 7-9 ms. Ranks after truncation
    are arbitrary, so every count in that range comes up."""
    if k * n < tuning.GEMM_ROW_PADDING_MIN_KN:
        return m
    return tuning.GEMM_ROW_PADDING.get(m, m)


def padded_columns(m: int, k: int, n: int) -> int:
    """How many output columns to compute a thin GEMM with (zero columns
    appended to the right operand, the result cropped). MKL's kernels on
    this CPU run a column count that is not a multiple of 8 far slower than
    the next multiple: swept over n = 8..64 at 4096 rows, K = 768 and 3072
    (``benchmarks/results/gemm_columns.json``), padding to a multiple of 8
    (16 below 16) is 1.1-2.0x faster wherever n is not one already, except
    just past a multiple of 16 (n % 16 in 1, 2, 4 above 16: 0.93-1.0x, so
    those stay). The padded right operand is a few hundred KB at most; the
    result is a strided view."""
    small = tuning.GEMM_COLUMN_PADDING_MIN
    vector = tuning.GEMM_VECTOR
    if n >= tuning.GEMM_THIN or m < small or k < small or (n > vector and n % vector in (1, 2, 4)):
        return n
    return max(vector, -(-n // 8) * 8)
