"""``fuse_feed_forward``: ``second(act(first(x)))`` over two TT linears becomes one fused call.

The rewrite (one small rule, applied wherever it matches)::

    %h = call_module[first](%x)                     %first  = get_attr[first]
    %a = gelu(%h)                          ==>      %second = get_attr[second]
    %y = call_module[second](%a)                    %y = tt_feed_forward(%x, %first, %second, "gelu")

when ``first`` and ``second`` are :class:`~tncompile.runtime.TTLinear`, the
activation is GELU (exact or tanh) or ReLU, and neither ``%h`` nor ``%a`` has
another user. The layers stay where they were in the module tree (same
parameter names, state dict, rank control); the graph now passes them to
:func:`~tncompile.runtime.feed_forward.tt_feed_forward`, which decides per
call whether the fused kernel applies and otherwise runs the three steps as
before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..ir.program import Program
from ..runtime.feed_forward import tt_feed_forward
from ..runtime.tt_layers import TTLinear
from .base import Pass, register_pass

__all__ = ["FuseFeedForward"]

_GELU_FUNCTIONS = {F.gelu, torch._C._nn.gelu, torch.ops.aten.gelu.default}
_RELU_FUNCTIONS = {F.relu, torch.relu, torch.ops.aten.relu.default}


def _tt_linear(gm: fx.GraphModule, node: fx.Node) -> TTLinear | None:
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return None
    mod = gm.get_submodule(node.target)
    return mod if type(mod) is TTLinear else None


def _gelu_name(approximate) -> str | None:
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)


def _activation(gm: fx.GraphModule, node: fx.Node, source: fx.Node) -> str | None:
    """The activation ``node`` applies to ``source`` (a key of ``ACTIVATIONS``), or ``None``."""
    if not node.args or node.args[0] is not source:
        return None
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if type(mod) is nn.GELU and len(node.args) == 1:
            return _gelu_name(mod.approximate)
        if type(mod) is nn.ReLU and len(node.args) == 1:
            return "relu"
        return None
    if node.op == "call_function" and node.target in _GELU_FUNCTIONS:
        extra = dict(node.kwargs)
        if len(node.args) > 2 or set(extra) - {"approximate"}:
            return None
        return _gelu_name(node.args[1] if len(node.args) == 2 else extra.get("approximate", "none"))
    if node.op == "call_function" and node.target in _RELU_FUNCTIONS:
        return "relu" if len(node.args) == 1 and set(node.kwargs) <= {"inplace"} else None
    if node.op == "call_method" and node.target == "relu" and len(node.args) == 1 and not node.kwargs:
        return "relu"
    return None


@register_pass
class FuseFeedForward(Pass):
    """Fuse ``TTLinear -> GELU/ReLU -> TTLinear`` chains (see the module doc)."""

    name = "fuse_feed_forward"

    def run(self, program: Program) -> Program:
        gm = program.graph_module
        graph = gm.graph
        matches, claimed = [], set()
        for node in graph.nodes:
            if node in claimed or _tt_linear(gm, node) is None or len(node.users) != 1:
                continue
            act_node = next(iter(node.users))
            activation = _activation(gm, act_node, node)
            if activation is None or len(act_node.users) != 1:
                continue
            second_node = next(iter(act_node.users))
            if _tt_linear(gm, second_node) is None or second_node.args[0] is not act_node:
                continue
            matches.append((node, act_node, second_node, activation))
            claimed.update((node, act_node, second_node))  # a chain of three fuses its first pair only
        for node, act_node, second_node, activation in matches:
            with graph.inserting_before(second_node):
                first_ref = graph.get_attr(node.target)
                second_ref = graph.get_attr(second_node.target)
                fused = graph.call_function(tt_feed_forward, (node.args[0], first_ref, second_ref, activation))
            fused.meta = dict(second_node.meta)
            second_node.replace_all_uses_with(fused)
            for dead in (second_node, act_node, node):
                graph.erase_node(dead)
        return program
