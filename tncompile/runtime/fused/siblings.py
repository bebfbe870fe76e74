"""``tt_siblings``: several TT linears applied to one input, through one pass over it where
that applies (:mod:`..ways.siblings` chooses and runs)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..layers.module_kinds import runs_as, runs_hooks
from ..layers.tt_linear import TTLinear
from ..ways import siblings as siblings_way

__all__ = ["tt_siblings", "sibling_kernels", "siblings_way_for"]


def _fusable(layers: Sequence[nn.Module]) -> bool:
    return all(runs_as(m, TTLinear) and not runs_hooks(m) for m in layers)


def sibling_kernels(x: torch.Tensor, layers: Sequence[nn.Module]):
    """The native ops when :func:`tt_siblings` runs ``layers`` through one pass over ``x``, else ``None``."""
    return siblings_way.sibling_kernels(x, layers, _fusable(layers))


def siblings_way_for(x: torch.Tensor, layers: Sequence[nn.Module]) -> siblings_way.SiblingsWay:
    """The way :func:`tt_siblings` runs ``layers`` on ``x`` (measured now where it may be)."""
    layers = list(layers)
    return siblings_way.choose(x, layers, _fusable(layers))


def tt_siblings(x: torch.Tensor, layers: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)``, through one pass over ``x`` where it applies
    (:mod:`..ways.siblings`).

    Shapes: ``x (..., in_features)`` -> one ``(..., layer.out_features)`` per layer.
    """
    layers = list(layers)
    return siblings_way.run(x, layers, _fusable(layers))
