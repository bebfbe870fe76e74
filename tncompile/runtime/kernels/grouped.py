"""Grouped matrix products of mixture-of-experts layers.

An MoE layer sorts its (token, expert) pairs by expert and multiplies each
expert's contiguous block of rows by that expert's matrix. The blocks are
given by ``offs``, the running total of rows per expert (``offs[e]`` is the end
of expert ``e``'s block), as in ``torch._grouped_mm`` and HuggingFace's
grouped experts.

:func:`grouped_mm` runs ``torch._grouped_mm`` where PyTorch has a kernel for
the case (CUDA, bfloat16, no host sync: capture-safe), and otherwise
``tncompile::grouped_mm``: one ``mm`` per expert after one host read of
``offs``, as one opaque op (with its backward) so that ``torch.compile`` traces
it without a graph break.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["grouped_mm", "group_bounds"]


def group_bounds(offs: Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of every expert's block of rows (one host read)."""
    bounds, start = [], 0
    for end in offs.tolist():
        bounds.append((start, int(end)))
        start = int(end)
    return bounds


def _check(x: Tensor, w: Tensor, offs: Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"grouped_mm expects x (rows, in), w (experts, in, out), offs (experts,); got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(offs.shape)}")
    if x.shape[1] != w.shape[1] or offs.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and offs {tuple(offs.shape)} "
                         "do not fit (x's columns = w's in, one offset per expert)")


@torch.library.custom_op("tncompile::grouped_mm", mutates_args=())
def _grouped_mm_op(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    out = x.new_zeros(x.shape[0], w.shape[2])
    for e, (start, end) in enumerate(group_bounds(offs)):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
    return out


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("tncompile::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward_op(grad: Tensor, x: Tensor, w: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    d_x, d_w = torch.zeros_like(x), torch.zeros_like(w)
    for e, (start, end) in enumerate(group_bounds(offs)):
        if end > start:
            torch.mm(grad[start:end], w[e].t(), out=d_x[start:end])
            torch.mm(x[start:end].t(), grad[start:end], out=d_w[e])
    return d_x, d_w


@_grouped_mm_backward_op.register_fake
def _(grad, x, w, offs):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    d_x, d_w = torch.ops.tncompile.grouped_mm_backward(grad.contiguous(), x, w, offs)
    return d_x, d_w, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup)


def _native_grouped(x: Tensor, w: Tensor) -> bool:
    """PyTorch's grouped GEMM covers this case (CUDA, bfloat16, 16-byte aligned rows)."""
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == w.dtype == torch.bfloat16
            and x.shape[1] % 8 == 0 and w.shape[2] % 8 == 0)


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``out[rows of expert e] = x[rows of expert e] @ w[e]``.

    Parameters
    ----------
    x : Tensor
        ``(rows, in)``, rows sorted by expert.
    w : Tensor
        ``(experts, in, out)``.
    offs : Tensor
        ``(experts,)`` integer running totals of rows per expert; rows past
        ``offs[-1]`` are returned as zeros.

    Returns
    -------
    Tensor
        ``(rows, out)``.
    """
    _check(x, w, offs)
    if _native_grouped(x, w):
        return torch._grouped_mm(x, w, offs=offs.to(torch.int32))
    return torch.ops.tncompile.grouped_mm(x, w, offs)
