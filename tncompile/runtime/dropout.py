"""Dropout on the native counter-based generator (CPU), PyTorch's everywhere else.

On CPU, ``nn.Dropout`` costs ~7 ns an element (a sequential generator, then
two more passes over the tensor, and a float mask kept for backward); in a
compressed transformer's training step that is a quarter of the time. The
``lower_dropout`` pass swaps ``nn.Dropout`` modules for :class:`FastDropout`
and functional dropout calls for :func:`dropout`, which on CPU (fp32/fp64,
no autocast, not traced by ``torch.compile``) run ``tncompile::dropout_*``
(:mod:`.native`): Philox4x32-10 keyed by a seed drawn from PyTorch's default
generator, one pass each way, a one-byte mask.

Semantics are dropout's: each element is zeroed independently with
probability ``p`` and the rest are scaled by ``1 / (1 - p)``; eval mode is
the identity. The masks differ from PyTorch's own for the same seed (as
with ``torch.compile``'s generated kernels), but ``torch.manual_seed`` still
makes a run repeat exactly, on any number of threads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .native import kernels_for

__all__ = ["FastDropout", "dropout"]


def _seed() -> int:
    """A 63-bit seed from PyTorch's default CPU generator (so manual_seed and
    saved RNG states govern the masks)."""
    return int(torch.empty((), dtype=torch.int64).random_())


class _NativeDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x: torch.Tensor, p: float) -> torch.Tensor:
        y, mask = ops.dropout_forward(x, p, _seed())
        ctx.ops, ctx.scale = ops, 1.0 / (1.0 - p)
        ctx.save_for_backward(mask)
        ctx.mark_non_differentiable(mask)
        return y

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return None, ctx.ops.dropout_backward(grad, mask, ctx.scale), None


def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``torch.nn.functional.dropout``'s signature and semantics; the native
    kernel where it applies (see the module doc).

    Shapes: any ``input`` -> the same shape.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    ops = kernels_for(input) if training and 0.0 < p < 1.0 and not inplace else None
    if ops is None:
        return F.dropout(input, p, training, inplace)
    return _NativeDropout.apply(ops, input, float(p))


class FastDropout(nn.Dropout):
    """``nn.Dropout`` that runs :func:`dropout` (same ``p``, ``inplace``,
    train/eval behaviour and state)."""

    @classmethod
    def from_dropout(cls, module: nn.Dropout) -> "FastDropout":
        new = cls(module.p, module.inplace)
        new.train(module.training)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return dropout(input, self.p, self.training, self.inplace)
