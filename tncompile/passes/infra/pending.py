"""A layer chosen for tensorization whose cores do not exist yet."""
from __future__ import annotations

import torch
from torch import nn

from ...formats.layout import TTLayout, TTMLayout
from ...frontend.layers import kind_of

__all__ = ["PendingLayer"]


class PendingLayer(nn.Module):
    """Placeholder the ``tensorize`` pass puts in the graph.

    It still runs its dense module (so the program stays executable between
    passes) and carries the chosen layout; ``assign_ranks`` sets the ranks and
    ``decompose`` replaces it with a TT / TTM layer.

    Attributes
    ----------
    dense : nn.Module
        The original layer.
    layout : TTLayout or TTMLayout
        For a tied head, the layout of the embedding it is tied to.
    kind : str
        ``"linear"``, ``"conv1d"``, ``"embedding"``, ``"experts"``, ``"tied"``
        (a linear head sharing its weight with the embedding ``tied_to``) or
        ``"alias"`` (another lookup of the table of the embedding ``tied_to``:
        the two become one module).
    """

    is_pending = True

    def __init__(self, dense: nn.Module, layout: TTLayout | TTMLayout, tied_to: str | None = None):
        super().__init__()
        self.dense = dense
        self.layout = layout
        kind = kind_of(dense)
        self.kind = kind if tied_to is None else "alias" if kind == "embedding" else "tied"
        self.tied_to = tied_to

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight

    def forward(self, *args, **kwargs):
        return self.dense(*args, **kwargs)

    def projected_params(self) -> int:
        """Parameters this layer's network will have (0 for a tied head or an alias)."""
        if self.tied_to is not None:
            return 0
        return self.layout.num_params() if self.layout.ranks is not None else self.weight.numel()

    def extra_repr(self) -> str:
        tie = f", {'alias of' if self.kind == 'alias' else 'tied_to='}{self.tied_to}" if self.tied_to else ""
        return f"pending {self.layout.describe()}, kind={self.kind}{tie}"
