"""Attention with dropout on CPU as one native op each way (``attention.cpp``).

PyTorch's CPU attention has no fused kernel that takes dropout: under dropout
it runs the math as separate ops, copying head-transposed ``q``/``k``/``v``
for its batched matmuls and writing the scores, the weights, the dropped
weights and a mask. :func:`native_attention` runs ``tncompile::attention_*``
instead: one head's scores stay in cache from ``q k^T`` to the product with
``v``, inputs are read through their strides, and backward keeps only the
softmax weights (the dropout mask rides in their sign bits).

Semantics are ``softmax(scale q k^T + mask)``, dropout on the weights (each
zeroed independently with probability ``p``, the rest scaled by
``1 / (1 - p)``), times ``v``; the masks come from the native counter-based
generator seeded from PyTorch's default generator, as
:func:`tncompile.runtime.ways.dropout.dropout`'s do.
"""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import Tensor

from .dropout import _seed
from ..native import kernels_for, traced_kernels

__all__ = ["AttentionWay", "choose", "native_attention", "native_sdpa", "scaled_dot_product_attention",
           "zeroes_padding"]


class AttentionWay(str, enum.Enum):
    """One way attention runs (its ``value`` is what a report prints)."""

    PYTORCH = "pytorch"          # the caller's own path (sdpa, or the written steps)
    TRACED_OP = "traced op"      # torch.compile / export: tncompile::traced_attention, seed drawn in the graph
    NATIVE = "native"            # eager CPU fp32/fp64: one head's scores in cache, dropout in the sign bits


def choose(q: Tensor) -> AttentionWay:
    """Which kernel :func:`native_attention` would use for ``q`` in the current context
    (before its shape and mask checks, which may still leave the call to PyTorch)."""
    return _decide(q)[0]


def _decide(q: Tensor):
    traced = traced_kernels(q)
    if traced is not None:
        return AttentionWay.TRACED_OP, traced
    ops = kernels_for(q)
    return (AttentionWay.PYTORCH, None) if ops is None else (AttentionWay.NATIVE, ops)


def zeroes_padding(training: bool, mask_check: bool, src: Tensor, key_padding_mask: Tensor) -> bool:
    """Whether ``nn.TransformerEncoder``'s fast path would run on ``src`` and zero the padded
    positions of its output (:class:`~tncompile.runtime.fused.attention.NestedPadding`): eval,
    no autograd, the fast path enabled, no autocast, 3-D input on a device it takes, and
    (``mask_check``) a left-aligned padding mask, which cannot be checked while traced."""
    if (training or torch.is_grad_enabled() or not torch.backends.mha.get_fastpath_enabled()
            or src.dim() != 3 or torch.is_autocast_enabled() or src.device.type not in ("cpu", "cuda", "xpu")):
        return False
    keep = key_padding_mask.logical_not()
    return not mask_check or (not torch.compiler.is_compiling()
                              and bool(torch._nested_tensor_from_mask_left_aligned(src, keep)))


class _NativeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, p: float,
                empty_rows_zero: bool) -> Tensor:
        seed = _seed() if p else 0
        keep_probs = any(ctx.needs_input_grad[1:4])
        out, probs = ops.attention_forward(q, k, v, mask, scale, p, seed, keep_probs, empty_rows_zero)
        ctx.ops, ctx.scale, ctx.p = ops, scale, p
        if keep_probs:
            ctx.save_for_backward(q, k, v, probs)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, probs = ctx.saved_tensors
        dq, dk, dv = ctx.ops.attention_backward(grad, q, k, v, probs, ctx.scale, ctx.p)
        return None, dq, dk, dv, None, None, None, None


def native_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, p: float, *,
                     empty_rows_zero: bool = False) -> Tensor | None:
    """``dropout(softmax(scale q k^T + mask), p) @ v`` on the native kernel, or
    ``None`` where it does not apply (then the caller runs its own path).

    A query whose every key the mask removes gets NaN, as the written softmax gives
    it, or zeros with ``empty_rows_zero`` (``scaled_dot_product_attention``'s answer).

    Applies to CPU float32/float64 tensors outside autocast (under ``torch.compile``
    as the traceable op ``tncompile::traced_attention``), ``q (B, H, L, E)``,
    ``k (B, H, S, E)``, ``v (B, H, S, F)`` (or the same without ``H``), in any
    strides, and an additive mask of ``q``'s dtype that broadcasts to
    ``(B, H, L, S)`` and needs no gradient.

    Shapes: -> ``(B, H, L, F)`` (a view of a ``(B, L, H, F)`` tensor).
    """
    way, ops = _decide(q)  # torch.compile / export: one opaque op each way
    if way is AttentionWay.PYTORCH:
        return None
    traced = ops if way is AttentionWay.TRACED_OP else None
    if not 3 <= q.dim() <= 4 or not q.dim() == k.dim() == v.dim() or not 0.0 <= p < 1.0:
        return None
    if not (q.dtype == k.dtype == v.dtype) or (k.device, v.device) != (q.device, q.device):
        return None
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        mask = mask.unsqueeze(-3) if mask is not None and mask.dim() >= 3 else mask
    batch, heads, length, width = q.shape
    if k.shape[:2] != (batch, heads) or v.shape[:2] != (batch, heads) or k.shape[3] != width \
            or v.shape[2] != k.shape[2]:
        return None
    if mask is not None:
        if mask.dtype != q.dtype or mask.requires_grad or mask.device != q.device or mask.dim() > 4:
            return None
        try:
            mask = mask.expand(batch, heads, length, k.shape[2])
        except RuntimeError:
            return None
    if traced is not None:
        keep_probs = q.requires_grad or k.requires_grad or v.requires_grad
        seed = traced.seed() if p else torch.zeros((), dtype=torch.int64)
        out = traced.attention(q, k, v, mask, float(scale), float(p), seed, keep_probs, empty_rows_zero)[0]
    else:
        out = _NativeAttention.apply(ops, q, k, v, mask, float(scale), float(p), empty_rows_zero)
    return out.squeeze(1) if squeeze else out


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` (same arguments, same result), on the native
    kernel where :func:`native_sdpa` takes the call: in training with dropout on CPU.
    What ``lower_dropout`` puts in a graph's attention calls with dropout.

    Shapes: as ``F.scaled_dot_product_attention``: ``(..., L, E)``, ``(..., S, E)``,
    ``(..., S, F)`` -> ``(..., L, F)``.
    """
    out = native_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if out is not None:
        return out
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def native_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor | None:
    """``F.scaled_dot_product_attention``'s call on the native kernel, or ``None`` where
    the kernel does not compute exactly what it would: no dropout (PyTorch's CPU flash
    attention is as fast), not CPU, a causal flag beside a mask (PyTorch refuses it), a
    mask that needs a gradient, inputs :func:`native_attention` does not take. A query
    the mask leaves no key gets zeros, as from PyTorch; nothing here reads tensor
    values, so tracers (``torch.compile``) take the same path.

    Masks as PyTorch reads them: boolean ``True`` = attend, else added to the scores;
    ``is_causal``: query ``i`` sees keys ``0..i``; ``enable_gqa``: key/value head ``j``
    serves query heads ``j*g .. j*g+g-1``.

    Shapes: ``query (B, H, L, E)`` (or ``(B, L, E)``) -> ``(B, H, L, F)``, a view of a
    ``(B, L, H, F)`` tensor.
    """
    if not dropout_p or query.device.type != "cpu" or (is_causal and attn_mask is not None):
        return None
    if query.dtype not in (torch.float32, torch.float64):  # before any work: the kernel would refuse it
        return None
    if query.dim() != key.dim() or query.dim() != value.dim():
        return None
    if enable_gqa and query.dim() == 4 and key.shape[1] != query.shape[1]:
        if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
            return None
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    length, keys = query.shape[-2], key.shape[-2]
    if is_causal:
        mask = torch.full((length, keys), float("-inf"), dtype=query.dtype, device=query.device).triu_(1)
    elif attn_mask is None:
        mask = None
    elif attn_mask.dtype == torch.bool:
        mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device)
        mask.masked_fill_(attn_mask.logical_not(), float("-inf"))
    elif attn_mask.requires_grad:
        return None
    else:
        mask = attn_mask
    factor = float(scale) if scale is not None else query.shape[-1] ** -0.5
    return native_attention(query, key, value, mask, factor, float(dropout_p), empty_rows_zero=True)
