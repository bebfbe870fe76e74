"""The thin pair ``y = (x @ A) @ B + bias`` in one Triton launch, its ``r``-wide middle on chip.

A TT linear's network, its input cores merged into ``A (in, r)`` and its output cores
(and gates) into ``B (r, out)`` (:meth:`~tncompile.runtime.TTLinear.merged_factors`), is
two thin GEMMs. Run as two cuBLAS calls they write the ``rows x r`` intermediate to memory
and read it back, two launches per layer and direction. Here each program takes
``BLOCK_M`` rows: it accumulates ``h = x A`` over the input in registers, then multiplies
``h`` by ``B`` one ``BLOCK_N`` column block at a time, adding the bias on the way out. With
few rows (a batch of one sequence: 4 row blocks) the output's columns are split among
programs as well, each forming its rows' ``h`` again (cheap: ``r`` is small), so a launch
has about :data:`PROGRAMS` programs to spread over the device.

:func:`thin_pair` is a ``torch.library`` custom op (``tncompile::thin_pair``) with a fake
kernel (so ``torch.compile``, export and capture see one opaque call) and an autograd
formula whose input gradient is the same kernel on ``(B^T, A^T)`` (``dx = (dy B^T) A^T``)
and whose weight gradients are two GEMMs. For training, :func:`thin_pair_train` keeps the
middle from the forward launch (``tncompile::thin_pair_kept`` writes ``[x A, 1]`` beside
``y``), so its backward is three launches -- ``dx`` by the same kernel keeping ``u = dy B^T``,
``dA = x^T u``, and ``[dB; dbias] = [x A, 1]^T dy`` -- where a dense linear runs ``dx``,
``dW`` and the bias sum: a TT linear's step launches what a dense one does. Where it runs:

* CUDA tensors: the compiled Triton kernel;
* CPU tensors with ``TRITON_INTERPRET=1`` (set before Triton is imported: it decides
  how Triton's own language functions load): the same kernel through Triton's
  interpreter (how CI tests it without a GPU);
* otherwise, or without Triton: the same arithmetic in PyTorch ops.

Accumulation is in float32 (float64 for float64 inputs); float32 products are IEEE (no
TF32, as PyTorch's default matmul); 16-bit inputs multiply ``h`` rounded to their dtype,
as a 16-bit matmul would. (Triton's interpreter multiplies bfloat16 operands wrongly -- NumPy
has no bfloat16 -- so on the CPU their products are formed in float32 from the same
bfloat16 values: exact, as the tensor cores' are, accumulated in float32 as theirs are.)
``TTLinear`` runs :func:`thin_pair_train` at any row count under ``tuning.TRITON_KERNELS``
(off until ``benchmarks/bench_gpu.py`` measures it on a GPU).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from .device_ops import direct

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch do not ship Triton: the PyTorch path runs
    triton = tl = None

__all__ = ["thin_pair", "thin_pair_train", "thin_pair_kept", "triton_available", "interpreting", "runs_triton"]

BLOCK_M, BLOCK_K, BLOCK_N = 32, 32, 32
#: programs a launch aims for (about two per SM of an H100): below it, columns are split too
PROGRAMS = 256


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: CPU tensors run the kernels through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_triton(x: Tensor) -> bool:
    """Whether the Triton kernels run on tensors like ``x``: CUDA tensors, CPU tensors under
    the interpreter, and ``meta`` ones (a dry run's fake device, which takes CUDA's path:
    the ops' fake kernels run there)."""
    return triton_available() and x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) \
        and (x.is_cuda or x.is_meta or (x.device.type == "cpu" and interpreting()))


def _thin_pair_kernel(x_ptr, a_ptr, b_ptr, bias_ptr, y_ptr, t_ptr, M, K, N, R, COLS,
                      sxm, sxk, sak, sar, sbr, sbn, sym, syn, stm, str_,
                      HAS_BIAS: tl.constexpr, KEEP: tl.constexpr, ONES: tl.constexpr,
                      ACC: tl.constexpr, LOW: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * sxm + ks[None, :] * sxk,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        a = tl.load(a_ptr + ks[:, None] * sak + rr[None, :] * sar,
                    mask=(ks[:, None] < K) & (rr[None, :] < R), other=0.0)
        if UPCAST:
            h += tl.dot(x.to(ACC), a.to(ACC), input_precision="ieee", out_dtype=ACC)
        elif LOW:
            h += tl.dot(x, a, out_dtype=ACC)
        else:
            h += tl.dot(x.to(ACC), a.to(ACC), input_precision="ieee", out_dtype=ACC)
    first = tl.program_id(1) * COLS      # this program's columns of y: [first, first + COLS)
    if KEEP:  # the middle, for the weight gradients: (rows, R), or (rows, R + 1) ending in ones
        kept = tl.where(rr[None, :] == R, 1.0, h) if ONES else h
        width = (R + 1 if ONES else R) * (tl.program_id(1) == 0).to(tl.int32)   # the first column program's
        tl.store(t_ptr + rows[:, None] * stm + rr[None, :] * str_, kept.to(t_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (rr[None, :] < width))
    for n0 in range(first, tl.minimum(first + COLS, N), BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        b = tl.load(b_ptr + rr[:, None] * sbr + ns[None, :] * sbn,
                    mask=(rr[:, None] < R) & (ns[None, :] < N), other=0.0)
        if UPCAST:
            y = tl.dot(h.to(b.dtype).to(ACC), b.to(ACC), input_precision="ieee", out_dtype=ACC)
        elif LOW:
            y = tl.dot(h.to(b.dtype), b, out_dtype=ACC)
        else:
            y = tl.dot(h, b.to(ACC), input_precision="ieee", out_dtype=ACC)
        if HAS_BIAS:
            y += tl.load(bias_ptr + ns, mask=ns < N, other=0.0).to(ACC)
        tl.store(y_ptr + rows[:, None] * sym + ns[None, :] * syn, y.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (ns[None, :] < N))


@functools.cache
def _kernel(device_type: str):
    """The kernel compiled for CUDA, or wrapped for Triton's interpreter on the CPU."""
    if device_type == "cuda":
        return triton.jit(_thin_pair_kernel)
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(_thin_pair_kernel)


def _launch(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor], keep: bool, ones: bool
            ) -> tuple[Tensor, Optional[Tensor]]:
    """``(y, t)`` for 2-D ``x``: ``t`` the middle ``x a`` when ``keep`` (ending in a column of
    ones when ``ones``), else ``None``."""
    m, k = x.shape
    r, n = b.shape
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    t = torch.empty(m, r + ones, device=x.device, dtype=x.dtype) if keep else None
    if m == 0:
        return y, t
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    kept = t if t is not None else y
    row_blocks, col_blocks = triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)
    # few rows: y's columns split among programs too (each forms its rows' x A again) so the
    # device has PROGRAMS programs to run; many rows: one program per row block
    split = max(1, min(col_blocks, triton.cdiv(PROGRAMS, row_blocks)))
    cols = triton.cdiv(col_blocks, split) * BLOCK_N
    _kernel(x.device.type)[(row_blocks, triton.cdiv(n, cols))](
        x, a, b, bias if bias is not None else y, y, kept, m, k, n, r, cols,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
        kept.stride(0), kept.stride(1),
        HAS_BIAS=bias is not None, KEEP=keep, ONES=ones, ACC=acc, LOW=x.dtype in (torch.float16, torch.bfloat16),
        UPCAST=x.dtype == torch.bfloat16 and x.device.type == "cpu",
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(r + ones)))
    return y, t


def _pair(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor], keep: bool, ones: bool
          ) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`_launch` where Triton runs, else the same arithmetic in PyTorch ops."""
    a, b = a.to(x.dtype), b.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if runs_triton(x):
        return _launch(x, a, b, bias, keep, ones)
    t = x @ a
    y = t @ b if bias is None else torch.addmm(bias, t, b)
    if keep and ones:
        t = torch.cat([t, t.new_ones(t.shape[0], 1)], 1)
    return y, (t if keep else None)


@torch.library.custom_op("tncompile::thin_pair", mutates_args=())
def thin_pair(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``(x @ a) @ b + bias``: one launch (no gradient kept; :func:`thin_pair_train` for training).

    Parameters
    ----------
    x : Tensor, shape ``(..., in)``
    a : Tensor, shape ``(in, r)``
    b : Tensor, shape ``(r, out)``
    bias : Tensor of shape ``(out,)``, or None

    Returns
    -------
    Tensor, shape ``(..., out)``, ``x``'s dtype.
    """
    y, _ = _pair(x.reshape(-1, x.shape[-1]), a, b, bias, keep=False, ones=False)
    return y.reshape(*x.shape[:-1], b.shape[1])


@thin_pair.register_fake
def _(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> Tensor:
    return x.new_empty(*x.shape[:-1], b.shape[1])


def _kept(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(y, t1)``: ``y = (x a) b + bias`` as :func:`thin_pair`, and the middle ``x a`` kept
    for the weight gradients, as ``t1 (rows, r + 1)`` whose last column is ones when there
    is a bias (``t1^T dy`` is then ``dB`` and the bias gradient in one GEMM), else
    ``(rows, r)``; in the same launch. ``x``: ``(rows, in)``."""
    y, t = _pair(x, a, b, bias, keep=True, ones=bias is not None)
    return y, t


thin_pair_kept = torch.library.custom_op("tncompile::thin_pair_kept", _kept, mutates_args=())


def _kept_call(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`thin_pair_kept`, its implementation called directly in an eager step (:func:`.direct`)."""
    return _kept(x, a, b, bias) if direct(x) else thin_pair_kept(x, a, b, bias)


@thin_pair_kept.register_fake
def _(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape[0], b.shape[1]), x.new_empty(x.shape[0], a.shape[1] + (bias is not None))


class _ThinPairTrain(torch.autograd.Function):
    """:func:`thin_pair_kept`'s ``y`` with the gradients of ``x A B + bias``: three launches
    backward -- ``dx`` with ``u = dy B^T`` kept (the same kernel on ``(B^T, A^T)``), ``dA = x^T u``
    and ``[dB; dbias] = t1^T dy`` -- where a dense linear runs ``dx``, ``dW`` and the bias sum."""

    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> Tensor:
        y, t1 = _kept_call(x, a, b, bias)
        ctx.save_for_backward(x, a, b, t1)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, a, b, t1 = ctx.saved_tensors
        need_x, need_a, need_b, need_bias = ctx.needs_input_grad
        dx = da = db = dbias = None
        if need_x or need_a:
            if need_x:
                dx, u = _kept_call(dy, b.t(), a.t(), None)
            else:
                u = dy @ b.t().to(dy.dtype)
            da = (x.t() @ u).to(a.dtype) if need_a else None
        if need_b or need_bias:
            grads = t1.t() @ dy
            r = b.shape[0]
            db = grads[:r].to(b.dtype) if need_b else None
            dbias = grads[r].to(dy.dtype) if need_bias and ctx.has_bias else None
        return dx, da, db, dbias


def _setup_context(ctx, inputs, output) -> None:
    x, a, b, bias = inputs
    ctx.save_for_backward(x, a, b)
    ctx.has_bias = bias is not None


def _backward(ctx, dy: Tensor):
    x, a, b = ctx.saved_tensors
    flat_x, flat_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dx, u = thin_pair_kept(flat_dy, b.t(), a.t(), None)         # (dy B^T) A^T, the middle kept
    da = flat_x.t() @ u                                         # (in, r)
    grads = (flat_x @ a.to(x.dtype)).t() @ flat_dy              # (r, out): the middle recomputed
    dbias = flat_dy.sum(0) if ctx.has_bias else None
    return dx.reshape(x.shape), da.to(a.dtype), grads.to(b.dtype), dbias


thin_pair.register_autograd(_backward, setup_context=_setup_context)


def thin_pair_train(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``(x @ a) @ b + bias`` for training: one launch forward (keeping the ``r``-wide middle),
    three backward (``dx`` by the same kernel, ``dA`` and ``[dB; dbias]`` as one GEMM each):
    a dense linear's count. Shapes as :func:`thin_pair`."""
    y = _ThinPairTrain.apply(x.reshape(-1, x.shape[-1]), a, b, bias)
    return y.reshape(*x.shape[:-1], b.shape[1])
