"""Freeze or unfreeze the rank gates of a compiled model (fixed-rank training)."""
from __future__ import annotations

from torch import nn

from ..runtime.layers import TNModule

__all__ = ["freeze_gates"]


def freeze_gates(model: nn.Module, frozen: bool = True) -> int:
    """Set ``requires_grad = not frozen`` on every rank gate of ``model``'s TT / TTM layers.

    For fixed-rank fine-tuning or distillation (:func:`tncompile.fit` without a
    controller): the gates (one scale per bond, all ones after ``compile``)
    stay as they are and only cores, biases and dense layers train. Build the
    optimizer afterwards over ``[p for p in model.parameters() if p.requires_grad]``.
    A :class:`~tncompile.RankController` needs them trainable (``frozen=False``).

    Returns
    -------
    int
        Gate tensors changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"freeze_gates expects the compiled model, got {type(model).__name__}")
    seen = set()
    for module in model.modules():
        if isinstance(module, TNModule):
            for gate in module.gates:
                if id(gate) not in seen:
                    seen.add(id(gate))
                    gate.requires_grad_(not frozen)
    return len(seen)
