"""The thin pair ``y = (x @ A) @ B + bias`` in one Triton launch, its ``r``-wide middle on chip.

A TT linear's network, its input cores merged into ``A (in, r)`` and its output cores
(and gates) into ``B (r, out)`` (:meth:`~tncompile.runtime.TTLinear.merged_factors`), is
two thin GEMMs. Run as two cuBLAS calls they write the ``rows x r`` intermediate to memory
and read it back, two launches per layer and direction. Here each program takes
``BLOCK_M`` rows: it accumulates ``h = x A`` over the input in registers, then multiplies
``h`` by ``B`` one ``BLOCK_N`` column block at a time, adding the bias on the way out.

:func:`thin_pair` is a ``torch.library`` custom op (``tncompile::thin_pair``) with a fake
kernel (so ``torch.compile``, export and capture see one opaque call) and an autograd
formula whose input gradient is the same kernel on ``(B^T, A^T)`` (``dx = (dy B^T) A^T``)
and whose weight gradients are two GEMMs. Where it runs:

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
Not dispatched by ``TTLinear`` yet: which layers and shapes gain
is measured on a GPU first (``benchmarks/bench_gpu.py``).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch do not ship Triton: the PyTorch path runs
    triton = tl = None

__all__ = ["thin_pair", "triton_available", "interpreting", "runs_triton"]

BLOCK_M, BLOCK_K, BLOCK_N = 32, 32, 32


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: CPU tensors run the kernels through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_triton(x: Tensor) -> bool:
    """Whether :func:`thin_pair` on tensors like ``x`` runs the Triton kernel."""
    return triton_available() and (x.is_cuda or (x.device.type == "cpu" and interpreting())) \
        and x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _thin_pair_kernel(x_ptr, a_ptr, b_ptr, bias_ptr, y_ptr, M, K, N, R,
                      sxm, sxk, sak, sar, sbr, sbn, sym, syn,
                      HAS_BIAS: tl.constexpr, ACC: tl.constexpr, LOW: tl.constexpr, UPCAST: tl.constexpr,
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
    for n0 in range(0, N, BLOCK_N):
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


def _launch(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> Tensor:
    m, k = x.shape
    r, n = b.shape
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    _kernel(x.device.type)[(triton.cdiv(m, BLOCK_M),)](
        x, a, b, bias if bias is not None else y, y, m, k, n, r,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, ACC=acc, LOW=x.dtype in (torch.float16, torch.bfloat16),
        UPCAST=x.dtype == torch.bfloat16 and x.device.type == "cpu",
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(r)))
    return y


@torch.library.custom_op("tncompile::thin_pair", mutates_args=())
def thin_pair(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``(x @ a) @ b + bias``.

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
    flat = x.reshape(-1, x.shape[-1])
    if runs_triton(x):
        y = _launch(flat, a.to(x.dtype), b.to(x.dtype), None if bias is None else bias.to(x.dtype))
    else:
        y = (flat @ a) @ b
        if bias is not None:
            y = y + bias
    return y.reshape(*x.shape[:-1], b.shape[1])


@thin_pair.register_fake
def _(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> Tensor:
    return x.new_empty(*x.shape[:-1], b.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, a, b, bias = inputs
    ctx.save_for_backward(x, a, b)
    ctx.has_bias = bias is not None


def _backward(ctx, dy: Tensor):
    x, a, b = ctx.saved_tensors
    dx = thin_pair(dy, b.t(), a.t(), None)                       # (dy B^T) A^T: the same launch
    flat_x, flat_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    da = flat_x.t() @ (flat_dy @ b.t())                         # (in, r)
    db = (flat_x @ a).t() @ flat_dy                             # (r, out)
    dbias = flat_dy.sum(0) if ctx.has_bias else None
    return dx, da, db, dbias


thin_pair.register_autograd(_backward, setup_context=_setup_context)
