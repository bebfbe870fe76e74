"""What every compressed model answers, graph mode or swap mode: one base for both.

:class:`~.compiled.CompiledModel` (graph mode) and :class:`~tncompile.swap.swapped.SwapMixin`
(swap mode: the user's own class) share ``program``'s readers -- ``ratio``, ``report()``,
``tensorized_modules()`` -- from here; ``program`` and ``to_dense()`` are each mode's own.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..ir.program import Program
from ..runtime.layers.tt_layers import TNModule
from .report import Report, build_report

__all__ = ["CompressedModelAPI", "is_compressed"]


class CompressedModelAPI:
    """The result API of a compressed model (see the module doc)."""

    @property
    def program(self) -> Program:
        raise NotImplementedError

    @property
    def ratio(self) -> float:
        """``params(compiled) / params(original)``, tied parameters counted once."""
        return self.program.ratio

    def report(self) -> Report:
        """Per layer: format, modes, ranks, params dense -> compiled, ratio, FLOPs per token."""
        return build_report(self.program)

    def tensorized_modules(self) -> dict[str, TNModule]:
        """``name -> TT/TTM layer`` for every compressed layer, named by its path in the
        original model (``compiled.tensorized_modules()["layers.0.ff1"]``)."""
        return {node.target: m for node, m in self.program.modules() if isinstance(m, TNModule)}

    def to_dense(self) -> nn.Module:
        raise NotImplementedError


def is_compressed(model: Any) -> bool:
    """Whether ``model`` is what ``tncompile.compile`` or ``load`` returned (either mode)."""
    return isinstance(model, CompressedModelAPI)
