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

from .native import kernels_for

__all__ = ["cpu_gemm", "padded_rows", "padded_columns"]

SKINNY = 16  # an output this narrow (or narrower) makes CPU GEMM kernels layout-sensitive
THIN = 64    # up to this many output columns, x.T @ g runs faster as (g.T @ x).T
VECTOR = 16  # fp32 lanes of a 512-bit register: MKL's column blocking on AVX-512
TINY = 1 << 18  # multiply-adds below which a GEMM is all call overhead: no layout tricks
THIN_RANK = 64     # a contracted (expand) or output (project) size up to this goes to the native thin kernels
THIN_OUTPUT = 1 << 18  # ... when the wide matrix has at least this many elements


def cpu_gemm(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` with the operand layouts CPU BLAS runs fastest when the
    output is thin (measured on MKL, 2 cores).

    * ``left`` is a transposed view of a large tensor and the output has at
      most ``THIN`` columns (a weight gradient ``x.T @ g``): compute
      ``(right.T @ left.T).T``, whose large operand is then read row by row
      (4x faster at 8 columns, 1.3x at 35).
    * the output has at most ``SKINNY`` columns and ``right`` is row-major:
      copy ``right`` (a few KB) column-major (2x faster).
    * row and column counts MKL handles badly are padded with zeros
      (:func:`padded_rows`, :func:`padded_columns`).
    * a wide output from a contraction over at most ``THIN_RANK`` (``t @ B``)
      or a thin output from a wide row-major input (``x @ A``) runs the native
      thin kernels where they are built: 1.03-2.9x faster than MKL at 47 of
      48 points over M = 512, 4096, N = 768, 3072, r = 8-64 (the expand at
      r = 64, M = 4096, N = 3072: 0.78-1.04x; ``bench_gemm_shapes.py``).
    """
    m, n = left.shape[0], right.shape[1]
    k = left.shape[1]
    if m * n * k < TINY:
        return torch.mm(left, right)
    if left.dtype == right.dtype and (k <= THIN_RANK < n or n <= THIN_RANK < k):
        native = kernels_for(left)
        if native is not None:
            if k <= THIN_RANK < n and m * n >= THIN_OUTPUT:                      # thin rank in, wide out
                return native.thin_expand(left, right, None)
            if n <= THIN_RANK and k >= 256 and m * k >= THIN_OUTPUT and left.is_contiguous():  # wide in, thin out
                return native.thin_project(left, right)
    if n <= THIN and m >= 4 * n and left.stride(0) == 1 and left.stride(1) != 1:
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
    if n <= SKINNY < m and right.stride(1) == 1 and right.stride(0) != 1:
        right = right.t().contiguous().t()
    return torch.mm(left, right)


# a weight gradient's few output rows: these counts run as the next size up (see padded_rows)
_ROW_PADDING = {5: 8, 6: 8, 7: 8, 9: 12, 10: 12, 11: 12}


def padded_rows(m: int, k: int, n: int) -> int:
    """How many rows to compute a GEMM with ``m`` output rows as (zero rows
    appended, cropped after). MKL on this CPU runs 5-7 output rows slower
    than 8 and 9-11 slower than 12 when the product is large: measured over
    ``K = 4096, N = 3072`` (a rank-8 layer's core gradient with its bias row
    has 9), 9-11 rows take 11-12 ms, 12 rows 7-9 ms. Ranks after truncation
    are arbitrary, so every count in that range comes up."""
    if k * n < (1 << 20):
        return m
    return _ROW_PADDING.get(m, m)


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
    if n >= THIN or m < 256 or k < 256 or (n > VECTOR and n % VECTOR in (1, 2, 4)):
        return n
    return max(VECTOR, -(-n // 8) * 8)
