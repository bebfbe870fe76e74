"""Linking a model's TT linears into :class:`~.factor_groups.FactorPeers`: layers of one
layout merge their factors in one batched pass per forward (its own module: it knows both
the layers and the batching, which know nothing of each other's modules)."""
from __future__ import annotations

from torch import nn

from .factor_groups import FactorPeers
from .tt_linear import TTLinear

__all__ = ["link_factor_groups"]


def link_factor_groups(model: nn.Module) -> FactorPeers | None:
    """Link ``model``'s TT linears so that layers of one layout merge their factors in
    one batched pass per forward (see the module doc); replaces earlier links. Returns
    the shared :class:`FactorPeers` (``None`` when the model has fewer than two)."""
    layers = [m for m in model.modules() if isinstance(m, TTLinear) and not m.stacked]
    for m in layers:
        m.__dict__.pop("_factor_peers", None)
    if len(layers) < 2:
        return None
    peers = FactorPeers(layers)
    for m in layers:
        m.__dict__["_factor_peers"] = peers
    return peers
