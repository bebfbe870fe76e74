"""``collapse_layers``: replace layers whose rank gates all switched off by their bias.

When every rank of some bond of a TT/TTM network is switched off, its matrix is
zero: the layer is its bias alone (a linear) or zeros (an embedding), and a
head tied to a collapsed embedding is its bias alone too. Rank adaptation
(``allow_layer_removal=True``) decides which layers collapse and runs this
pass through the pipeline to make the graph edit.
"""
from __future__ import annotations

from torch import nn

from ..ir.program import Program
from ..runtime.layers.collapsed import CollapsedLayer
from ..runtime.layers.embedding_bag import TTMEmbeddingBag
from ..runtime.layers.experts import TTExperts
from ..runtime.layers import TTLinear, TTMEmbedding, TTMTiedLinear
from .infra.base import Pass, register_pass
from .truncate_ranks import require_layers

__all__ = ["CollapseLayers"]


@register_pass
class CollapseLayers(Pass):
    """Swap each named TT/TTM layer (and the heads tied to it) for a :class:`CollapsedLayer`.

    Parameters
    ----------
    layers : dict
        ``layer name -> reason`` (the name as in ``compiled.tensorized_modules()``).
    """

    name = "collapse_layers"

    def __init__(self, layers: dict[str, str] | None = None):
        self.layers = dict(layers or {})

    def requires(self, program: Program) -> None:
        require_layers(program, self.layers, self.name)

    def run(self, program: Program) -> Program:
        gm = program.graph_module
        modules = {node.target: m for node, m in program.modules()}
        replace: dict[int, CollapsedLayer] = {}
        for name, reason in self.layers.items():
            replace.update(_collapsed(modules[name], modules.values(), reason))
        paths = {id(m): node.target for node, m in program.modules()}
        for node, m in list(program.modules()):
            new = replace.get(id(m))
            if new is not None:
                # what rebuilds it before it collapses again (tncompile.load): its modes, its tie
                program.collapsed_layouts[node.target] = m.layout
                if isinstance(m, TTMTiedLinear):
                    program.collapsed_ties[node.target] = paths[id(m.embedding)]
                gm.set_submodule(node.target, new)
                program.notes[node.target] = new.reason
                self.matches["layer-collapsed"] += 1
        return program


def _collapsed(mod: nn.Module, others, reason: str) -> dict[int, CollapsedLayer]:
    """``id(module) -> replacement`` for ``mod`` and the heads tied to it."""
    dtype, device = mod.cores[0].dtype, mod.cores[0].device
    if isinstance(mod, TTLinear):
        return {id(mod): CollapsedLayer("linear", mod.out_features, mod.layout.dense_params, mod.bias,
                                        dtype, device, reason)}
    if isinstance(mod, TTExperts):
        return {id(mod): CollapsedLayer("experts", mod.out_features, mod.layout.dense_params, None,
                                        dtype, device, reason)}
    if isinstance(mod, TTMEmbeddingBag):
        return {id(mod): CollapsedLayer("embedding_bag", mod.embedding_dim, mod.layout.dense_params, None,
                                        dtype, device, reason, include_last_offset=mod.include_last_offset)}
    if isinstance(mod, TTMEmbedding):
        out = {id(mod): CollapsedLayer("embedding", mod.embedding_dim, mod.layout.dense_params, None,
                                       dtype, device, reason)}
        for head in others:
            if isinstance(head, TTMTiedLinear) and head.embedding is mod:
                out[id(head)] = CollapsedLayer("linear", head.out_features, 0, head.bias, dtype, device,
                                               reason + " (tied embedding collapsed)")
        return out
    raise TypeError(f"cannot collapse {type(mod).__name__}: only TT linears and TTM embeddings own cores")
