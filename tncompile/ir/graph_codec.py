"""Plain-data encoding of an fx graph, for saving compiled models.

``GraphModule``'s own pickling re-traces the generated Python on load, which
loses pytree output types (HF ``ModelOutput``) and does not work for
``torch.export`` graphs; ``fx.Graph`` itself does not pickle. We store each
node as ``(op, name, target, args, kwargs)`` with targets by qualified name,
plus the graph's pytree codegen, and rebuild the graph node by node.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.node import map_aggregate, map_arg

__all__ = ["encode_graph_module", "decode_graph_module"]


@dataclass(frozen=True)
class _Ref:
    name: str


def _encode_target(target: Any) -> tuple[str, ...]:
    if isinstance(target, str):
        return ("str", target)
    if isinstance(target, torch._ops.OpOverload):
        ns, rest = target.name().split("::")
        packet, _, overload = rest.partition(".")
        return ("op", ns, packet, overload or "default")
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module is None or qualname is None or "<locals>" in qualname:
        raise TypeError(f"cannot save graph target {target!r}: it is not importable by name")
    return ("fn", module, qualname, getattr(target, "__name__", qualname))


def _decode_target(enc: tuple[str, ...]) -> Any:
    kind = enc[0]
    if kind == "str":
        return enc[1]
    if kind == "op":
        return getattr(getattr(getattr(torch.ops, enc[1]), enc[2]), enc[3])
    module = importlib.import_module(enc[1])
    obj: Any = module
    try:
        for part in enc[2].split("."):
            obj = getattr(obj, part)
        return obj
    except AttributeError:  # e.g. torch.arange's qualname is _VariableFunctionsClass.arange
        return getattr(module, enc[3])


def encode_graph_module(gm: fx.GraphModule) -> dict[str, Any]:
    """``{"nodes", "codegen", "root", "class_name"}``; ``root`` holds the modules and params."""
    nodes = []
    for n in gm.graph.nodes:
        args = map_arg(n.args, lambda a: _Ref(a.name))
        kwargs = map_arg(n.kwargs, lambda a: _Ref(a.name))
        nodes.append((n.op, n.name, _encode_target(n.target), args, kwargs))
    codegen = gm.graph._codegen
    pytree_info = getattr(codegen, "pytree_info", None)
    root = nn.Module()
    root._modules.update(gm._modules)
    root._parameters.update(gm._parameters)
    root._buffers.update(gm._buffers)
    root.training = gm.training
    return {"nodes": nodes, "pytree_info": pytree_info, "root": root,
            "class_name": type(gm).__name__}


def decode_graph_module(data: dict[str, Any]) -> fx.GraphModule:
    """Inverse of :func:`encode_graph_module`."""
    graph = fx.Graph()
    if data["pytree_info"] is not None:
        graph._codegen = fx.graph._PyTreeCodeGen(data["pytree_info"])
    env: dict[str, fx.Node] = {}

    def resolve(a):
        return env[a.name] if isinstance(a, _Ref) else a

    for op, name, target, args, kwargs in data["nodes"]:
        node = graph.create_node(op, _decode_target(target), map_aggregate(args, resolve),
                                 map_aggregate(kwargs, resolve), name=name)
        env[name] = node
    gm = fx.GraphModule(data["root"], graph, class_name=data["class_name"])
    gm.training = data["root"].training  # children keep their own pickled modes
    return gm
