"""What a compile decided, replayed instead of decided again.

``tncompile.load`` rebuilds a saved model from the user's own dense model: it traces it
and runs the recorded pipeline, but the choices the first compile made from the weights,
the device's speed and calibration data -- which layers became networks, their modes,
their ranks (after any cuts), which heads share an embedding's network, which layers rank
adaptation collapsed -- come from the file's layer table instead. ``tensorize``,
``assign_ranks`` and ``decompose`` read them from the compile's context (``ctx.decisions``); the tensors are
loaded afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..formats.layout import TTLayout, TTMLayout

__all__ = ["CompileDecisions", "LayerDecision", "LAYER_KINDS"]

#: what a compressed layer was: the dense kind it replaced, or a head/lookup sharing an embedding's network
LAYER_KINDS = ("linear", "conv1d", "embedding", "embedding_bag", "experts", "tied", "alias")


@dataclass(frozen=True)
class LayerDecision:
    """One compressed layer.

    Attributes
    ----------
    kind : str
        One of :data:`LAYER_KINDS`.
    layout : TTLayout or TTMLayout
        Modes and ranks (for ``"tied"`` and ``"alias"``: the embedding's).
    tied_to : str or None
        For ``"tied"`` / ``"alias"``: the path of the embedding whose network it shares.
    collapsed : bool
        Rank adaptation removed it (every rank of a bond switched off): rebuilt, then
        collapsed by the ``collapse_layers`` pass.
    """

    kind: str
    layout: TTLayout | TTMLayout
    tied_to: str | None = None
    collapsed: bool = False

    def __post_init__(self):
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"layer kind must be one of {LAYER_KINDS}, got {self.kind!r}")
        if (self.tied_to is not None) != (self.kind in ("tied", "alias")):
            raise ValueError(f"a {self.kind!r} layer {'needs' if self.tied_to is None else 'has no'} tied_to")
        if self.layout.ranks is None:
            raise ValueError("a decided layout has its ranks")


@dataclass
class CompileDecisions:
    """``path -> LayerDecision`` for every compressed layer (paths as the traced graph
    names them); every other compressible layer stays dense."""

    layers: dict[str, LayerDecision] = field(default_factory=dict)

    @property
    def collapsed(self) -> list[str]:
        """Paths of the layers rank adaptation collapsed."""
        return [p for p, d in self.layers.items() if d.collapsed]
