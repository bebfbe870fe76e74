"""``fuse_siblings``: TT linears that read the same tensor run through one pass over it.

The rewrite, for every node ``%x`` that two or more different
:class:`~tncompile.runtime.TTLinear` modules are called on::

    %q = call_module[q](%x)                  %q_ref = get_attr[q] (and k, v)
    %k = call_module[k](%x)        ==>       %qkv = tt_siblings(%x, (%q_ref, %k_ref, %v_ref))
    %v = call_module[v](%x)                  %q = getitem(%qkv, 0)  (and 1, 2)

inserted where the first of them was. The layers stay where they were in the module
tree (same parameter names, state dict, rank control); the graph now passes them to
:func:`~tncompile.runtime.fused.siblings.tt_siblings`, which decides per call whether one pass
over ``%x`` applies (CPU, enough rows, the merged factors no costlier than the planned
contractions) and otherwise runs each layer as before. Counted under ``siblings`` (one
per shared input) in the dump.
"""
from __future__ import annotations

import operator

from torch import fx

from ..ir.program import Program
from ..runtime.layers.module_kinds import runs_as
from ..runtime.fused.siblings import tt_siblings
from ..runtime.layers import TTLinear
from .infra.base import Pass, register_pass
from .infra.rule_pass import require_canonical

__all__ = ["FuseSiblings"]


def _tt_calls_on(x: fx.Node, gm: fx.GraphModule, order: dict[fx.Node, int]) -> list[fx.Node]:
    """The call_module nodes of distinct TT linears whose one argument is ``x`` (graph order)."""
    seen, calls = set(), []
    for node in sorted(x.users, key=lambda n: order.get(n, len(order))):  # a node this pass inserted: last
        if (node.op == "call_module" and node.args == (x,) and not node.kwargs and node.target not in seen
                and runs_as(gm.get_submodule(node.target), TTLinear)):
            seen.add(node.target)
            calls.append(node)
    return calls


@register_pass
class FuseSiblings(Pass):
    """Run TT linears that share an input through one pass over it (see the module doc)."""

    name = "fuse_siblings"

    def requires(self, program: Program) -> None:
        require_canonical(program, self.name)

    def run(self, program: Program) -> Program:
        gm = program.graph_module
        self.matches["siblings"] += 0
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        for x in list(gm.graph.nodes):
            group = _tt_calls_on(x, gm, order)
            if len(group) < 2:
                continue
            with gm.graph.inserting_before(group[0]):
                refs = tuple(gm.graph.get_attr(node.target) for node in group)
                fused = gm.graph.call_function(tt_siblings, (x, refs))
                items = [gm.graph.call_function(operator.getitem, (fused, i)) for i in range(len(group))]
            for node, item in zip(group, items):
                item.meta = dict(node.meta)
                node.replace_all_uses_with(item)
                gm.graph.erase_node(node)
            self.matches["siblings"] += 1
        return program
