"""How dropout runs: on the native counter-based generator (CPU), as one traceable op
under ``torch.compile``, or PyTorch's own -- :class:`DropoutWay`, :func:`choose`, and
:func:`dropout` (``F.dropout``'s signature) that runs it.

Dropout on the native counter-based generator (CPU), PyTorch's everywhere else.

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

import enum

import torch
import torch.nn.functional as F

from ..native import kernels_for, traced_kernels
from ..native.traced import seed as seed_tensor

__all__ = ["DropoutWay", "choose", "dropout"]


class DropoutWay(str, enum.Enum):
    """One way dropout runs (its ``value`` is what a report prints)."""

    PYTORCH = "pytorch"   # eval mode, p of 0 or 1, in place, or no native kernel: F.dropout
    TRACED_OP = "traced op"           # torch.compile / export: tncompile::traced_dropout, seed drawn in the graph
    NATIVE = "native"                 # eager CPU fp32/fp64: Philox masks, one byte each


def choose(input: torch.Tensor, p: float, training: bool = True, inplace: bool = False) -> DropoutWay:
    """The way :func:`dropout` runs on ``input`` in the current context."""
    return _decide(input, p, training, inplace)[0]


def _decide(input: torch.Tensor, p: float, training: bool, inplace: bool):
    if not (training and 0.0 < p < 1.0 and not inplace):
        return DropoutWay.PYTORCH, None
    traced = traced_kernels(input)
    if traced is not None:
        return DropoutWay.TRACED_OP, traced
    ops = kernels_for(input)
    return (DropoutWay.PYTORCH, None) if ops is None else (DropoutWay.NATIVE, ops)


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
    way, ops = _decide(input, p, training, inplace)
    if way is DropoutWay.TRACED_OP:  # torch.compile / export: one opaque op, its seed drawn in the graph
        return ops.dropout(input, float(p), ops.seed())[0]
    if way is DropoutWay.NATIVE:
        return _NativeDropout.apply(ops, input, float(p))
    return F.dropout(input, p, training, inplace)
