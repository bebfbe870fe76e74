"""Files of tncompile's first format (version 1): a pickle, loaded only with ``trust=True``.

Version 1 stored the whole model with ``torch.save`` (pickle), so loading one
runs whatever code the file carries: :func:`tncompile.load` refuses it unless
the caller passes ``trust=True``. Then this module unpickles it, mapping the
classes that have moved since to their new homes (:data:`MOVED`), and rebuilds
its graph from version 1's node tuples. Save the model again to convert it.
"""
from __future__ import annotations

import importlib
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.node import map_aggregate

__all__ = ["load_v1", "decode_graph_module", "MOVED"]

# (old module, name) -> new module, for classes version-1 files name
MOVED = {
    ("tncompile.ir.plan", "ContractionPlan"): "tncompile.runtime.plans",
    ("tncompile.ir.plan", "Step"): "tncompile.runtime.plans",
    ("tncompile.ir.lookup_plan", "LookupPlan"): "tncompile.runtime.plans",
    ("tncompile.runtime.truncation", "CollapsedLayer"): "tncompile.runtime.collapsed",
    ("tncompile.runtime.pending", "PendingLayer"): "tncompile.passes.pending",
    ("tncompile.history", "History"): "tncompile.train.history",
    ("tncompile.ir.graph_codec", "_Ref"): "tncompile.serialization.legacy",
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return super().find_class(MOVED.get((module, name), module), name)


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs: pickle, with moved classes found."""

    Unpickler = _Unpickler
    load = staticmethod(pickle.load)
    __name__ = "tncompile_v1_pickle"


def load_v1(path, map_location=None) -> dict[str, Any]:
    """The payload dict of a version-1 file (unpickled: the caller checked trust)."""
    return torch.load(path, map_location=map_location, weights_only=False, pickle_module=_PickleModule)


@dataclass(frozen=True)
class _Ref:
    name: str


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


def decode_graph_module(data: dict[str, Any]) -> fx.GraphModule:
    """A version-1 graph: ``(op, name, target, args, kwargs)`` tuples and a pickled root module."""
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
