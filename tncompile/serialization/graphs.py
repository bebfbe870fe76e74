"""A compiled model's graph and module tree as data (see :mod:`.codec`).

Modules are stored by class name and state (their ``__dict__``: settings,
parameters, buffers, children; hooks are code and are refused), and rebuilt
with the class's own ``__setstate__``, never a constructor the file chooses.
Graph nodes are ``[op, name, target, args, kwargs]`` with targets by name.

What a file may name, unless it is loaded with ``trust=True``:

* module classes from ``torch.nn``, tncompile, and :data:`SAFE_MODULE_CLASSES`
  (extend it with :func:`allow_module_class`);
* functions from ``operator``, ``math``, torch's tensor-math namespaces
  (``torch``, ``torch.nn.functional``, ``torch.linalg``, ... but not
  ``torch.load`` / ``save`` / ``from_file``), ``tncompile.runtime`` and a few
  builtins (``getattr`` only of public attributes);
* ops under ``torch.ops.aten``, ``prims``, ``tncompile`` and
  ``higher_order``; method calls on public method names.

Anything else raises :class:`~.codec.UnsafeFileError` naming it.
"""
from __future__ import annotations

import builtins
import json
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .codec import Decoder, Encoder, UnsafeFileError, qualified_name, resolve

__all__ = ["encode_graph_module", "decode_graph_module", "SAFE_MODULE_CLASSES", "allow_module_class"]

SAFE_MODULE_CLASSES: set[str] = {"transformers.pytorch_utils.Conv1D"}
_SAFE_MODULE_PREFIXES = ("torch.nn.modules.", "tncompile.")

_SAFE_FUNCTION_MODULES = {
    "operator", "_operator", "math", "torch", "torch.functional", "torch.nn.functional", "torch._C._nn",
    "torch._C._linalg", "torch._C._special", "torch._C._fft", "torch.fft", "torch.linalg", "torch.special",
    "torch.amp.autocast_mode", "torch.autograd.grad_mode", "torch._C._VariableFunctions",
}
_SAFE_BUILTINS = {builtins.getattr, builtins.len, builtins.int, builtins.float, builtins.bool, builtins.slice,
                  builtins.range, builtins.tuple, builtins.list, builtins.min, builtins.max, builtins.abs,
                  builtins.round}
_UNSAFE_TORCH = {torch.load, torch.save, torch.from_file}
_SAFE_OP_NAMESPACES = {"aten", "prims", "tncompile"}
_UNSAFE_OPS = {"aten::from_file", "aten::_nested_from_file"}
_HOOK_KEYS = "hook"


def allow_module_class(cls: type) -> type:
    """Let files name module class ``cls`` without ``trust=True`` (usable as a
    decorator). Do this only for classes whose state is plain data."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"allow_module_class takes an nn.Module subclass, got {cls!r}")
    SAFE_MODULE_CLASSES.add(qualified_name(cls))
    return cls


# ----------------------------------------------------------------- modules
def _encode_module(enc: Encoder, mod: nn.Module, path: str, seen: dict[int, str]) -> dict:
    if id(mod) in seen:
        return {"__module_ref__": seen[id(mod)]}
    seen[id(mod)] = path
    where = path or "the model"
    if isinstance(mod, fx.GraphModule):  # a subgraph (e.g. of a higher-order op) is itself a graph
        return {"__graph_module__": encode_graph_module(enc, mod), "path": path}
    transient = set(getattr(type(mod), "transient_state", ()))
    state: dict[str, Any] = {}
    for key, value in mod.__dict__.items():
        if _HOOK_KEYS in key:
            if value:
                raise TypeError(f"cannot save {where} ({type(mod).__name__}): it has {key} registered; hooks "
                                f"are code, which tncompile files do not carry. Remove them before saving.")
            continue
        if key in transient:
            continue
        if key == "_modules":
            state[key] = {name: (None if child is None else
                                 _encode_module(enc, child, f"{path}.{name}" if path else name, seen))
                          for name, child in value.items()}
        else:
            state[key] = enc.encode(value, f"{where}.{key}")
    return {"__module__": qualified_name(type(mod)), "path": path, "state": state}


def _module_class(name: str, trust: bool) -> type:
    if not trust and not (name.startswith(_SAFE_MODULE_PREFIXES) or name in SAFE_MODULE_CLASSES):
        raise UnsafeFileError(
            f"the file's model contains a module of class {name}, which tncompile does not rebuild from a "
            f"file unless told to: load with trust=True if you trust this file, or register the class with "
            f"tncompile.serialization.allow_module_class({name.rsplit('.', 1)[-1]})")
    cls = resolve(name)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise UnsafeFileError(f"the file names {name} as a module class, but it is not an nn.Module")
    return cls


class _ModuleDecoding:
    """Decoder hooks for module trees; keeps shared modules shared."""

    def __init__(self, trust: bool):
        self.trust = trust
        self.by_path: dict[str, nn.Module] = {}

    def module(self, dec: Decoder, v: dict) -> nn.Module:
        cls = _module_class(v["__module__"], self.trust)
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)  # the empty hook tables and registries every module has; no class code
        self.by_path[v["path"]] = obj
        state = {k: dec.decode(x) for k, x in v["state"].items() if k != "_modules"}
        state["_modules"] = {k: (None if x is None else dec.decode(x))
                             for k, x in v["state"].get("_modules", {}).items()}
        obj.__setstate__(state)  # the class's own (nn.Module's, or e.g. an RNN's that relinks its weights)
        return obj

    def ref(self, dec: Decoder, v: dict) -> nn.Module:
        path = v["__module_ref__"]
        if path not in self.by_path:
            raise ValueError(f"the file refers to module {path!r} before defining it (a damaged file)")
        return self.by_path[path]

    def graph_module(self, dec: Decoder, v: dict) -> fx.GraphModule:
        gm = decode_graph_module(dec, v["__graph_module__"], self.trust)
        self.by_path[v["path"]] = gm
        return gm


# ----------------------------------------------------------------- targets
def _encode_target(target: Any) -> Any:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return {"__op__": target.name()}
    if isinstance(target, torch._ops.HigherOrderOperator):
        return {"__hop__": target.name()}
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module is None or qualname is None or "<locals>" in qualname:
        raise TypeError(f"cannot save graph target {target!r}: it is not importable by name")
    for name in (f"{module}.{qualname}", f"{module}.{getattr(target, '__name__', qualname)}"):
        try:
            if resolve(name) is target:
                return {"__fn__": name}
        except (ImportError, AttributeError):
            pass
    raise TypeError(f"cannot save graph target {target!r}: importing {module}.{qualname} does not give it back")


def _decode_target(v: Any, trust: bool) -> Any:
    if isinstance(v, str):
        return v
    if "__op__" in v:
        ns, _, rest = v["__op__"].partition("::")
        packet, _, overload = rest.partition(".")
        if not trust and (ns not in _SAFE_OP_NAMESPACES or f"{ns}::{packet}" in _UNSAFE_OPS):
            raise UnsafeFileError(f"the file's graph calls torch.ops.{ns}.{packet}, which tncompile does not "
                                  f"load unless told to (trust=True)")
        return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")
    if "__hop__" in v:
        return getattr(torch.ops.higher_order, v["__hop__"])
    name = v["__fn__"]
    fn = resolve(name)
    if not trust and not _safe_function(fn):
        raise UnsafeFileError(f"the file's graph calls {name}, which tncompile does not load unless told to: "
                              f"load with trust=True if you trust this file")
    return fn


def _safe_function(fn: Any) -> bool:
    if fn in _UNSAFE_TORCH:
        return False
    if fn in _SAFE_BUILTINS:
        return True
    module = getattr(fn, "__module__", None) or ""
    if module in _SAFE_FUNCTION_MODULES or module.startswith("tncompile.runtime."):
        return True
    return getattr(torch, getattr(fn, "__name__", ""), None) is fn  # torch's C functions (torch.arange)


def _check_node(op: str, target: Any, args: tuple, trust: bool) -> None:
    if trust:
        return
    if op == "call_method" and target.startswith("_"):
        raise UnsafeFileError(f"the file's graph calls the private method {target!r}; load with trust=True "
                              f"if you trust this file")
    if op == "call_function" and target is builtins.getattr and not (
            len(args) >= 2 and isinstance(args[1], str) and not args[1].startswith("_")):
        raise UnsafeFileError(f"the file's graph reads the attribute {args[1:2]!r} with getattr; only public "
                              f"attributes load without trust=True")


# ----------------------------------------------------------------- graphs
def encode_graph_module(enc: Encoder, gm: fx.GraphModule) -> dict:
    """``{"nodes", "pytree", "class_name", "root"}`` for ``gm``."""
    previous = enc.hooks.get(fx.Node)
    enc.hooks[fx.Node] = lambda e, n: {"__node__": n.name}
    try:
        nodes = [[n.op, n.name, _encode_target(n.target), enc.encode(tuple(n.args), f"node {n.name}"),
                  enc.encode(dict(n.kwargs), f"node {n.name}")] for n in gm.graph.nodes]
    finally:
        if previous is None:
            enc.hooks.pop(fx.Node)
        else:
            enc.hooks[fx.Node] = previous
    info = getattr(gm.graph._codegen, "pytree_info", None)
    pytree_info = None if info is None else {
        "orig_args": list(info.orig_args),
        "in_spec": None if info.in_spec is None else pytree.treespec_dumps(info.in_spec),
        "out_spec": None if info.out_spec is None else pytree.treespec_dumps(info.out_spec)}
    root = nn.Module()
    root._modules.update(gm._modules)
    root._parameters.update(gm._parameters)
    root._buffers.update(gm._buffers)
    root.training = gm.training
    return {"nodes": nodes, "pytree": pytree_info, "class_name": type(gm).__name__,
            "root": _encode_module(enc, root, "", {})}


def _load_spec(text: str | None):
    if text is None:
        return None
    try:
        return pytree.treespec_loads(text)
    except (KeyError, NotImplementedError, ValueError):
        # a type registered by its library (e.g. transformers' ModelOutput): import it, then retry
        for name in _spec_types(json.loads(text)):
            if name.startswith("transformers.") or name.startswith("torch."):
                try:
                    resolve(name)
                except (ImportError, AttributeError):
                    pass
        return pytree.treespec_loads(text)


def _spec_types(doc: Any) -> list[str]:
    out = []
    if isinstance(doc, dict):
        if isinstance(doc.get("type"), str):
            out.append(doc["type"])
        for v in doc.values():
            out += _spec_types(v)
    elif isinstance(doc, list):
        for v in doc:
            out += _spec_types(v)
    return out


def decode_graph_module(dec: Decoder, data: dict, trust: bool = False) -> fx.GraphModule:
    """Inverse of :func:`encode_graph_module`."""
    modules = _ModuleDecoding(trust)
    dec.hooks.update({"__module__": modules.module, "__module_ref__": modules.ref,
                      "__graph_module__": modules.graph_module})
    root = dec.decode(data["root"])
    graph = fx.Graph()
    info = data["pytree"]
    if info is not None:
        graph._codegen = fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(
            info["orig_args"], _load_spec(info["in_spec"]), _load_spec(info["out_spec"])))
    env: dict[str, fx.Node] = {}
    dec.hooks["__node__"] = lambda d, v: env[v["__node__"]]
    try:
        for op, name, target, args, kwargs in data["nodes"]:
            if op not in ("placeholder", "get_attr", "call_function", "call_module", "call_method", "output"):
                raise ValueError(f"unknown graph op {op!r} in the file")
            fn = _decode_target(target, trust)
            args, kwargs = dec.decode(args), dec.decode(kwargs)
            _check_node(op, fn, args, trust)
            env[name] = graph.create_node(op, fn, tuple(args), kwargs, name=name)
    finally:
        dec.hooks.pop("__node__")
    gm = fx.GraphModule(root, graph, class_name=data["class_name"])
    gm.training = root.training  # children keep their own modes
    return gm
