"""The GEMMs a planned contraction runs: one pairwise step as one GEMM on views, a bias
riding in the last GEMM, the fused gradients of a bias-fused last step, and the namespace
the executor's generated code (:mod:`.plan_program`) calls them through.

``gemm_for(t)`` is the GEMM for ``t``'s device: :func:`~.cpu_gemm.cpu_gemm` on CPU (layout
copies, padding, native thin kernels), ``torch.mm`` elsewhere.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import torch

from ... import tuning
from .cpu_gemm import cpu_gemm
from ..native import kernels_for, traced_kernels
from .plans import ContractionPlan

__all__ = ["pairwise", "gemm_bias", "column_sums", "grad_with_bias", "expand_grads", "finish", "gemm_for",
           "GENERATED_CODE_NAMESPACE"]


def _compute_layout(ndim: int, axes: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """Where an operand's contracted ``axes`` sit: ``"lead"``, ``"trail"`` or
    ``"other"`` (with the permutation that makes them lead)."""
    k = len(axes)
    if axes == tuple(range(k)):
        return "lead", ()
    if axes == tuple(range(ndim - k, ndim)):
        return "trail", ()
    return "other", tuple(axes) + tuple(d for d in range(ndim) if d not in axes)


_layout = lru_cache(maxsize=None)(_compute_layout)


def _as_matrix(t: torch.Tensor, axes: tuple[int, ...], contracted_first: bool) -> torch.Tensor:
    """``t`` as a 2-D matrix ``(contracted, free)`` if ``contracted_first`` else
    ``(free, contracted)``, as a free view (possibly transposed) whenever the
    contracted axes are already the leading or trailing axes of a contiguous
    tensor; otherwise one permuted copy."""
    where, perm = (_compute_layout if torch.compiler.is_compiling() else _layout)(t.dim(), axes)
    shape = t.shape
    size_k = size_free = 1  # explicit sizes, not -1: an empty batch must reshape too
    for d, n in enumerate(shape):
        if d in axes:
            size_k *= n
        else:
            size_free *= n
    if where == "other" or not t.is_contiguous():
        if where != "other":
            perm = tuple(axes) + tuple(d for d in range(t.dim()) if d not in axes)
        m = t.permute(perm).reshape(size_k, size_free)   # (contracted, free), one copy
        return m if contracted_first else m.t()
    if where == "lead":
        m = t.reshape(size_k, size_free)
        return m if contracted_first else m.t()
    m = t.reshape(size_free, size_k)
    return m.t() if contracted_first else m


def pairwise(a: torch.Tensor, a_axes: Sequence[int], b: torch.Tensor, b_axes: Sequence[int],
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``tensordot(a, b, (a_axes, b_axes))`` -- result axes: a's free then b's free --
    with one GEMM on views wherever the layouts allow (no operand copies).
    ``bias`` (shape: b's free size) is added inside the GEMM (``addmm``)."""
    a_axes, b_axes = tuple(a_axes), tuple(b_axes)
    a_free = [n for d, n in enumerate(a.shape) if d not in a_axes]
    b_free = [n for d, n in enumerate(b.shape) if d not in b_axes]
    left = _as_matrix(a, a_axes, contracted_first=False)
    right = _as_matrix(b, b_axes, contracted_first=True)
    if bias is not None:
        out = gemm_bias(left, right, bias)
    elif left.device.type == "cpu":
        out = _CpuGemm.apply(left, right) if torch.compiler.is_compiling() else cpu_gemm(left, right)
    else:
        out = left @ right
    return out.reshape(*a_free, *b_free)


class _CpuGemm(torch.autograd.Function):
    """``left @ right`` whose gradients are :func:`cpu_gemm` products too. Under
    ``torch.compile`` the planned steps run as plain ops and autograd derives the
    backward; through this function (traced forward and backward alike) the
    gradient GEMMs get the layouts and native thin kernels the eager executor
    uses, instead of ``mm`` on transposed views."""

    @staticmethod
    def forward(ctx, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(left, right)
        return cpu_gemm(left, right)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        left, right = ctx.saved_tensors
        d_left = cpu_gemm(grad, right.t()) if ctx.needs_input_grad[0] else None
        d_right = cpu_gemm(left.t(), grad) if ctx.needs_input_grad[1] else None
        return d_left, d_right


def gemm_bias(left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``left @ right + bias``. ``addmm`` first copies the broadcast bias into
    the whole ``M x N`` output (on CPU, a full extra pass over the layer's
    output). When the contracted size ``K`` is small -- the last GEMM of a
    merged-cores plan, ``K`` = a rank -- the bias rides as one more rank
    instead: ``[left, 1] @ [right; bias]``, copying only ``M x (K+1)``."""
    m, k = left.shape
    n = right.shape[1]
    if k <= tuning.THIN_RANK < n and m * n >= tuning.THIN_OUTPUT and left.dtype == right.dtype == bias.dtype:
        native = kernels_for(left) or traced_kernels(left)
        if native is not None:  # the bias initializes the accumulators: no extra pass, no copy
            return native.thin_expand(left, right, bias)
    if left.device.type != "cpu" or 4 * k >= n or m * n < tuning.BIG_OUTPUT:
        return torch.addmm(bias, left, right)
    ones = left.new_ones(m, 1)
    return torch.cat([left, ones], 1) @ torch.cat([right, bias.to(right.dtype).unsqueeze(0)], 0)


def column_sums(grad: torch.Tensor) -> torch.Tensor:
    """``grad (rows, outputs...)`` summed over the rows, flattened: a bias's
    gradient (zeros for an empty batch)."""
    return grad.reshape(grad.shape[0], math.prod(grad.shape[1:])).sum(0)


def grad_with_bias(a: torch.Tensor, a_axes: Sequence[int], grad: torch.Tensor,
                    grad_axes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The last step's right-operand gradient ``A.T @ G`` and the fused bias's
    gradient ``1.T @ G`` from one GEMM over ``G``: ``[A, 1].T @ G``.

    Only for a bias-fused plan's last step, where ``a``'s contracted ``a_axes``
    are exactly the rows, so ``A`` is ``(rows, K)`` and ``grad`` is ``(rows, outputs...)``.
    Reading the layer's output gradient once instead of twice (GEMM, then a
    column sum) saves a full pass over it. Returns ``(g_b (K..., outputs...), g_bias (outputs,))``.
    """
    rows = grad.shape[0]
    if grad.numel() < tuning.BIG_OUTPUT or tuple(grad_axes) != (0,):  # small: the concatenation costs more
        return pairwise(a, a_axes, grad, grad_axes), column_sums(grad)
    left = _as_matrix(a, tuple(a_axes), contracted_first=True)           # (rows, K)
    k_shape = [n for d, n in enumerate(a.shape) if d not in tuple(a_axes)]
    k = left.shape[1]
    extended = torch.cat([left, left.new_ones(rows, 1)], 1)               # (rows, K+1)
    g_mat = grad.reshape(rows, math.prod(grad.shape[1:]))
    both = cpu_gemm(extended.t(), g_mat) if g_mat.device.type == "cpu" else extended.t() @ g_mat
    return both[:k].reshape(*k_shape, *grad.shape[1:]), both[k]


def expand_grads(t: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, want_t: bool, want_w: bool,
                  want_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """All gradients of a bias-fused last step ``y = t @ w (+ bias)``:
    ``(grad @ w.T, t.T @ grad, grad's column sums)``, each only if wanted.

    ``t (rows, K)``, ``w (K, N)``, ``grad (rows, N)``. With a thin ``K`` on
    CPU the native kernel computes all three in one pass over ``grad`` (read
    once instead of twice: it is the layer's largest tensor); elsewhere two
    GEMMs as :func:`grad_with_bias` does.
    """
    rows, k = t.shape
    n = w.shape[1]
    if k <= tuning.THIN_RANK < n and rows * n >= tuning.THIN_OUTPUT and t.dtype == w.dtype == grad.dtype:
        native = kernels_for(grad)
        if native is not None:
            g_t, g_w, g_bias = native.thin_expand_backward(grad, t, w, want_t, want_w, want_bias)
            return (g_t if want_t else None), (g_w if want_w else None), (g_bias if want_bias else None)
    mm = gemm_for(grad)
    g_t = mm(grad, w.t()) if want_t else None
    g_w = g_bias = None
    if want_w and want_bias and grad.device.type == "cpu" and grad.numel() >= tuning.BIG_OUTPUT:
        g_w, g_bias = grad_with_bias(t, (0,), grad, (0,))  # [t, 1].T @ grad: one pass for both
    else:  # small: two plain calls cost less than building [t, 1]
        if want_w:
            g_w = mm(t.t(), grad)
        if want_bias:
            g_bias = grad.sum(0)
    return g_t, g_w, g_bias


def finish(plan: ContractionPlan, result: torch.Tensor) -> torch.Tensor:
    return result if plan.out_perm is None else result.permute(plan.out_perm)


def gemm_for(t: torch.Tensor):
    return cpu_gemm if t.device.type == "cpu" else torch.mm


GENERATED_CODE_NAMESPACE = {"_gemm_bias": gemm_bias, "_grad_with_bias": grad_with_bias,
                             "_expand_grads": expand_grads, "_column_sums": column_sums, "torch": torch}
