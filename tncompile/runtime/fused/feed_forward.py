"""``tt_feed_forward``: a feed-forward block ``second(act(first(x)))`` of two TT linears,
fused where that is faster (:mod:`..ways.feed_forward` chooses and runs)."""
from __future__ import annotations

import torch
from torch import nn

from ..layers.module_kinds import runs_as, runs_hooks
from ..layers.tt_linear import TTLinear
from ..ways import feed_forward as feed_forward_way
from ..ways.feed_forward import ACTIVATIONS, fused_macs

__all__ = ["ACTIVATIONS", "tt_feed_forward", "fused_macs", "uses_fused_kernel", "feed_forward_way_for"]


def _runs_tt(module: nn.Module) -> bool:
    return runs_as(module, TTLinear) and not runs_hooks(module)


def uses_fused_kernel(x: torch.Tensor, first: nn.Module, second: nn.Module):
    """The native ops when :func:`tt_feed_forward` would fuse the block for input ``x``, else ``None``."""
    return feed_forward_way.fused_kernels(x, first, second, _runs_tt(first) and _runs_tt(second))


def feed_forward_way_for(x: torch.Tensor, first: nn.Module, second: nn.Module,
                         activation: str) -> feed_forward_way.FeedForwardWay:
    """The way :func:`tt_feed_forward` runs the block on ``x`` (measured now where it may be)."""
    return feed_forward_way.choose(x, first, second, _runs_tt(first) and _runs_tt(second), activation)


def tt_feed_forward(x: torch.Tensor, first: nn.Module, second: nn.Module, activation: str) -> torch.Tensor:
    """``second(act(first(x)))``, with the hidden activation never written to memory when
    both layers are :class:`TTLinear` (:mod:`..ways.feed_forward`).

    Parameters
    ----------
    x : Tensor ``(..., first.in_features)``
    first, second : nn.Module
        ``TTLinear`` layers (fused), or any modules (run in sequence).
    activation : str
        A key of :data:`ACTIVATIONS`: ``"gelu"``, ``"gelu_tanh"``, ``"relu"``.

    Returns
    -------
    Tensor ``(..., second.out_features)``
    """
    first_tt = _runs_tt(first)
    return feed_forward_way.run(x, first, second, activation, first_tt and _runs_tt(second), first_tt)
