"""Dropout on the native counter-based generator (CPU), PyTorch's everywhere else.

On CPU, ``nn.Dropout`` costs ~7 ns an element (a sequential generator, then
two more passes over the tensor, and a float mask kept for backward); in a
compressed transformer's training step that is a quarter of the time. The
``lower_dropout`` pass swaps ``nn.Dropout`` modules for :class:`FastDropout`
and functional dropout calls for :func:`dropout`, which on CPU (fp32/fp64,
no autocast) run ``tncompile::dropout_*``
(:mod:`.native`): Philox4x32-10 keyed by a seed drawn from PyTorch's default
generator, one pass each way, a one-byte mask.

Semantics are dropout's: each element is zeroed independently with
probability ``p`` and the rest are scaled by ``1 / (1 - p)``; eval mode is
the identity. The masks differ from PyTorch's own for the same seed (as
with ``torch.compile``'s generated kernels), but ``torch.manual_seed`` still
makes a run repeat exactly, on any number of threads. Under ``torch.compile``
the same kernel runs as one opaque op (``tncompile::traced_dropout``) whose seed
is drawn inside the compiled graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..native import kernels_for, traceable_kernels
from ..native.traced import seed as seed_tensor

__all__ = ["FastDropout", "dropout"]


def _seed() -> int:
    """A seed from PyTorch's default CPU generator (so manual_seed and saved RNG
    states govern the masks), drawn as the traced ops draw theirs
    (:func:`.native.traced.seed`): a model and its ``torch.compile``-d form draw
    the same masks where the compiler leaves PyTorch's generator in place."""
    return int(seed_tensor())


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
    if not (training and 0.0 < p < 1.0 and not inplace):
        return F.dropout(input, p, training, inplace)
    traced = traceable_kernels(input)  # torch.compile / export: one opaque op, its seed drawn in the graph
    if traced is not None:
        return traced.dropout(input, float(p), traced.seed())[0]
    ops = kernels_for(input)
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
