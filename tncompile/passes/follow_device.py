"""``follow_device``: ops of an exported graph make tensors where the model runs, not where it was traced.

``torch.export`` records every device argument as the constant it had at
trace time: ``arange(..., device=cpu)`` for an attention mask, ``to(x, cpu)``
for HF's ``mask.to(inputs_embeds.device)``, ``_assert_tensor_metadata(x,
device=cpu)``, also inside the subgraphs of autocast regions. Such a graph traced
on CPU and moved to a GPU mixes devices and fails. This pass reads the device
from the graph's first tensor input (``input.device``, one node) and passes
that instead of each constant device equal to the traced one. A program traced
by ``torch.fx`` records ``x.device`` as it was written and is left alone.
"""
from __future__ import annotations

import builtins

import torch
from torch import fx

from ..ir.program import Program
from .infra.base import Pass, register_pass

__all__ = ["FollowDevice"]


@register_pass
class FollowDevice(Pass):
    """Replace trace-time constant devices of an exported graph by its input's device."""

    name = "follow_device"

    def run(self, program: Program) -> Program:
        if program.inputs.frontend != "export":
            return program
        for gm in _graph_modules(program):  # the graph, and subgraphs of higher-order ops (autocast regions)
            source = _first_tensor_input(gm.graph)
            if source is None:
                continue
            traced = source.meta["val"].device
            device = None
            for node in list(gm.graph.nodes):
                if node.op != "call_function" or not _baked_devices(node, traced):
                    continue
                if device is None:
                    with gm.graph.inserting_after(source):
                        device = gm.graph.call_function(builtins.getattr, (source, "device"))
                node.args = tuple(device if _is_traced(a, traced) else a for a in node.args)
                if _same_device(node.kwargs.get("device"), traced):
                    node.update_kwarg("device", device)
                self.matches["device-followed"] += 1
            gm.recompile()
        return program

    def ensures(self, program: Program) -> None:
        if program.inputs.frontend != "export":
            return
        for gm in _graph_modules(program):
            source = _first_tensor_input(gm.graph)
            if source is None:
                continue
            traced = source.meta["val"].device
            left = [n.name for n in gm.graph.nodes if n.op == "call_function" and _baked_devices(n, traced)]
            if left:
                raise RuntimeError(f"follow_device left trace-time devices on {left[:3]}")


def _graph_modules(program: Program) -> list[fx.GraphModule]:
    return [m for m in program.graph_module.modules() if isinstance(m, fx.GraphModule)]


def _first_tensor_input(graph: fx.Graph) -> fx.Node | None:
    return next((n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)),
                None)


def _is_traced(value, traced: torch.device) -> bool:
    """A positional argument that is the trace-time device."""
    return isinstance(value, torch.device) and value.type == traced.type


def _baked_devices(node: fx.Node, traced: torch.device) -> bool:
    return any(_is_traced(a, traced) for a in node.args) or _same_device(node.kwargs.get("device"), traced)


def _same_device(value, traced: torch.device) -> bool:
    if value is None or isinstance(value, fx.Node):
        return False
    try:
        return torch.device(value).type == traced.type
    except (TypeError, RuntimeError):
        return False
