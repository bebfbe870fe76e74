"""``SelfAttention``: what ``nn.MultiheadAttention`` does between its two projections.

``nn.MultiheadAttention`` keeps its input projection as a raw ``in_proj_weight``
and calls ``F.multi_head_attention_forward``, so neither its ``3E x E`` input
projection nor its output projection is a layer a tracer can see, and
``nn.TransformerEncoder`` branches on tensors (its inference fast path), so
torch.fx cannot trace it at all. The fx frontend therefore spells a
self-attention call as three modules: ``in_proj`` (an ``nn.Linear`` holding the
very ``in_proj_weight`` / ``in_proj_bias``), this module, and ``out_proj`` --
the two projections then compress like any linear. Its dropout follows
``train()`` / ``eval()`` as the original's does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ways.attention import native_attention, zeroes_padding
from .dropout import FastDropout

__all__ = ["SelfAttention", "FusedAttention", "NestedPadding", "AttentionDropoutRate", "additive_mask"]


def additive_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None, batch: int, heads: int,
                  queries: int, keys: int, dtype: torch.dtype) -> Tensor | None:
    """``nn.MultiheadAttention``'s two masks as one float mask ``(batch, heads | 1, queries, keys)``
    to add to the scores (``True`` in a boolean mask means: do not attend)."""
    def as_float(mask: Tensor) -> Tensor:
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
        return mask.to(dtype)

    merged = None
    if attn_mask is not None:
        m = as_float(attn_mask)
        merged = m.reshape(batch, heads, queries, keys) if m.dim() == 3 else m.reshape(1, 1, queries, keys)
    if key_padding_mask is not None:
        pad = as_float(key_padding_mask).reshape(batch, 1, 1, keys)
        merged = pad if merged is None else merged + pad
    return merged


class SelfAttention(nn.Module):
    """Scaled dot-product attention over a packed ``q | k | v`` projection.

    Parameters
    ----------
    num_heads : int
    dropout : float
        On the attention weights, in training mode only.
    batch_first : bool
        As in ``nn.MultiheadAttention``.
    native_dropout : bool
        Set by the ``lower_dropout`` pass: in training with dropout on CPU, run
        tncompile's native attention kernel with its counter-based dropout
        (:func:`~tncompile.runtime.ways.attention.native_attention`) instead of
        PyTorch's unfused math path and generator.

    Shapes
    ------
    ``qkv (L, N, 3E)`` (``(N, L, 3E)`` if ``batch_first``, ``(L, 3E)`` unbatched) ->
    ``(attention (like qkv with E columns), weights (N, L, L) or (N, H, L, L) or None)``.
    """

    native_dropout = False  # files saved before the attribute existed load with PyTorch's dropout

    def __init__(self, num_heads: int, dropout: float = 0.0, batch_first: bool = False,
                 native_dropout: bool = False):
        super().__init__()
        self.num_heads, self.dropout, self.batch_first = num_heads, float(dropout), batch_first
        self.native_dropout = bool(native_dropout)

    def forward(self, qkv: Tensor, attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
                need_weights: bool = False, average_attn_weights: bool = True) -> tuple[Tensor, Tensor | None]:
        unbatched = qkv.dim() == 2
        if unbatched:
            qkv = qkv.unsqueeze(0 if self.batch_first else 1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if not self.batch_first:
            qkv = qkv.transpose(0, 1)
        batch, length, width = qkv.shape
        embed, heads = width // 3, self.num_heads
        q, k, v = qkv.reshape(batch, length, 3, heads, embed // heads).permute(2, 0, 3, 1, 4).unbind(0)
        mask = additive_mask(attn_mask, key_padding_mask, batch, heads, length, length, q.dtype)
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:  # the weights themselves are asked for: no fused kernel
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(-1)
            out = F.dropout(weights, p) @ v if p else weights @ v
            if average_attn_weights:
                weights = weights.mean(1)
            if unbatched:
                weights = weights.squeeze(0)
        else:
            # a query whose every key is masked gets zeros, as from PyTorch's attention
            native = p and self.native_dropout and q.device.type == "cpu"
            out = native_attention(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1]), p,
                                   empty_rows_zero=True) if native else None
            if out is None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = out.transpose(1, 2).reshape(batch, length, embed)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(0 if self.batch_first else 1)
        return out, weights

    def extra_repr(self) -> str:
        native = ", native_dropout=True" if self.native_dropout else ""
        return f"num_heads={self.num_heads}, dropout={self.dropout}, batch_first={self.batch_first}{native}"


class NestedPadding(nn.Module):
    """Zeros at padded positions, when ``nn.TransformerEncoder``'s inference fast path would give them.

    In eval mode without autograd, an encoder built with
    ``enable_nested_tensor=True`` runs on nested tensors when it gets a
    (left-aligned) ``src_key_padding_mask`` and no ``mask``, and its output is
    zero at every padded position (before the final norm). The traced encoder
    computes those positions like any other, so this module reproduces the
    zeros under the same conditions -- the compiled model then matches the
    original in every mode, also where a pooling reads padded positions.

    Shapes
    ------
    ``out (N, S, E)``, ``src (N, S, E)``, ``key_padding_mask (N, S)`` -> ``(N, S, E)``.
    """

    def __init__(self, mask_check: bool = True):
        super().__init__()
        self.mask_check = mask_check

    def forward(self, out: Tensor, src: Tensor, key_padding_mask: Tensor) -> Tensor:
        if not zeroes_padding(self.training, self.mask_check, src, key_padding_mask):
            return out
        return out.masked_fill(key_padding_mask.bool().unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        return f"mask_check={self.mask_check}"


class AttentionDropoutRate(nn.Module):
    """The ``dropout_p`` of a traced ``scaled_dot_product_attention`` call: ``p`` in
    training mode, ``0.0`` in eval mode.

    A trace bakes ``dropout_p=self.p if self.training else 0.0`` into a constant;
    the frontend feeds the call from this module instead, so the attention's
    dropout follows ``train()`` / ``eval()`` like every ``nn.Dropout`` does.

    Parameters
    ----------
    p : float in [0, 1)
        The dropout probability in training mode.
    """

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"attention dropout must be in [0, 1), got {p!r}")
        self.p = float(p)

    def forward(self) -> float:
        return self.p if self.training else 0.0

    def extra_repr(self) -> str:
        return f"p={self.p}"


class FusedAttention(nn.Module):
    """``dropout(softmax(scale(q @ k.T) + mask)) @ v`` as one ``scaled_dot_product_attention``.

    What the ``fuse_attention`` pass puts in place of a hand-written attention. The
    scores matrix ``(..., L, S)`` is never written where PyTorch has a fused kernel for
    the call (CUDA: flash / memory-efficient attention, with dropout; CPU: flash
    attention without dropout). Where it has none the steps run as written, one by one
    (:meth:`unfused`), which is also the reference the fused call is tested against:

    * dropout active on CPU: PyTorch's CPU attention has no fused kernel with dropout.
      After ``lower_dropout`` (the dropout is a ``FastDropout``) the call runs
      tncompile's native attention kernel (:meth:`native`: one head's scores in cache,
      no head-transposed copies, the dropout drawn by the native generator); with
      PyTorch's own ``nn.Dropout`` the written steps run, with that module;
    * inputs the kernel does not take: ranks or batch shapes that differ (the matmuls
      broadcast), a mask that is not floating point in the inputs' dtype, one that would
      broadcast the scores up or that needs a gradient, a scale that is a tensor.

    Parameters
    ----------
    scaling : {"div", "mul", "none"}
        How the written code scaled the scores by ``scale``: ``s / scale``, ``s * scale``
        or not at all.
    dropout : nn.Dropout or None
        The dropout the graph applied to the attention weights (the same module object:
        its ``p`` and its ``train()`` / ``eval()`` flag govern the fused call's ``dropout_p``).

    Shapes
    ------
    ``q (..., L, E)``, ``k (..., S, E)``, ``v (..., S, Ev)``, ``mask`` broadcastable to
    ``(..., L, S)`` or ``None``, ``scale`` a number -> ``(..., L, Ev)``.
    """

    def __init__(self, scaling: str = "none", dropout: nn.Module | None = None):
        super().__init__()
        if scaling not in ("div", "mul", "none"):
            raise ValueError(f"scaling must be 'div', 'mul' or 'none', got {scaling!r}")
        self.scaling = scaling
        self.dropout = dropout

    def dropout_p(self) -> float:
        """The dropout probability of this call: the module's ``p`` in training mode, else 0."""
        return float(self.dropout.p) if self.dropout is not None and self.dropout.training else 0.0

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float = 1.0) -> Tensor:
        fusable = _fusable(q, k, v, mask, scale)
        if self.dropout_p() and q.device.type == "cpu":
            out = self.native(q, k, v, mask, scale) if fusable and isinstance(self.dropout, FastDropout) else None
            return self.unfused(q, k, v, mask, scale) if out is None else out
        return self.fused(q, k, v, mask, scale) if fusable else self.unfused(q, k, v, mask, scale)

    def native(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
               scale: float = 1.0) -> Tensor | None:
        """tncompile's CPU attention kernel with its dropout
        (:func:`~tncompile.runtime.ways.attention.native_attention`), or ``None``
        where it does not apply."""
        return native_attention(q, k, v, mask, self._factor(scale), self.dropout_p())

    def _factor(self, scale: float) -> float:
        return 1.0 / scale if self.scaling == "div" else scale if self.scaling == "mul" else 1.0

    def fused(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float = 1.0) -> Tensor:
        """The one ``scaled_dot_product_attention`` call (for inputs it takes)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout_p(),
                                              scale=self._factor(scale))

    def unfused(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float = 1.0) -> Tensor:
        """The steps as the traced graph wrote them. A number ``scale`` multiplies
        ``q`` (``L x E``) instead of the scores (``L x S``): the copy the batched
        matmul makes of a head-transposed ``q`` anyway, and no pass over the
        scores; the mask is added into the fresh scores in place."""
        if self.scaling != "none" and isinstance(scale, (int, float)) and not isinstance(scale, bool):
            scores = (q * (1.0 / scale if self.scaling == "div" else scale)) @ k.transpose(-2, -1)
        else:
            scores = q @ k.transpose(-2, -1)
            if self.scaling == "div":
                scores = scores / scale
            elif self.scaling == "mul":
                scores = scores * scale
        if mask is not None:
            try:
                in_place = tuple(torch.broadcast_shapes(mask.shape, scores.shape)) == tuple(scores.shape)
            except RuntimeError:
                in_place = False
            in_place = in_place and torch.promote_types(scores.dtype, mask.dtype) == scores.dtype
            scores = scores.add_(mask) if in_place else scores + mask
        weights = scores.softmax(-1)
        if self.dropout is not None:
            weights = self.dropout(weights)
        return weights @ v

    def extra_repr(self) -> str:
        return f"scaling={self.scaling!r}"


def _fusable(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale) -> bool:
    """Whether ``scaled_dot_product_attention`` computes exactly the written steps for these inputs."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymInt, torch.SymFloat)):
        return False
    if not (q.dim() == k.dim() == v.dim() >= 3 and q.dtype == k.dtype == v.dtype and q.is_floating_point()):
        return False
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == k.shape[-1]
            and k.shape[-2] == v.shape[-2]):
        return False
    if mask is None:
        return True
    scores = (*q.shape[:-1], k.shape[-2])
    if mask.dtype != q.dtype or mask.requires_grad or mask.dim() > len(scores):
        return False
    try:
        return tuple(torch.broadcast_shapes(mask.shape, scores)) == scores
    except RuntimeError:
        return False
