"""A compiled model's graph and module tree as data (see :mod:`.codec`), checked before anything is built.

Modules are stored by class name and state (their ``__dict__``: settings,
parameters, buffers, children; hooks are code and are refused), and rebuilt
with the class's own ``__setstate__``, never a constructor the file chooses.
Graph nodes are ``[op, name, target, args, kwargs]`` with targets by name.

What a node may be (without ``trust=True``), checked field by field before
any ``fx.GraphModule`` exists -- torch.fx pastes names, targets and keyword
keys into the source of ``forward`` and executes it, so none of them may be
anything but a plain name:

* ``name``: an identifier, unique in the graph;
* ``placeholder``: its target an identifier (``*args`` / ``**kwargs`` forms
  too), its default a number, string, bool or null;
* ``get_attr`` / ``call_module``: a dotted path of the graph's own modules,
  parameters and buffers (each part letters, digits and ``_``);
* ``call_function``: a function of :func:`.tables.function_table`, an op of
  the aten / tncompile op tables, or a higher-order op of
  :data:`.tables.HIGHER_ORDER_OPS`; ``getattr`` reads only
  :data:`.tables.GETATTR_NAMES`;
* ``call_method``: a method of :data:`.tables.METHODS` (``to`` without
  strings);
* arguments: nodes, numbers, strings, bools, null, slices, dtypes, devices,
  sizes and lists / tuples / dicts of them; keyword keys identifiers;
  literal sizes of allocating calls no larger than the file's tensors justify;
* module classes: exactly a name of :func:`.tables.module_class_table`, or a
  class registered with :func:`allow_module_class`;
* pytree specs (the call signature of exported models): parsed as data, node
  types from :func:`.tables.pytree_type_allowed`, keys identifiers.

Anything else raises :class:`~tncompile.errors.UnsafeFileError` naming the
node and the field; malformed data raises :class:`~tncompile.errors.ModelFileError`.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..errors import ModelFileError, UnsafeFileError
from . import tables
from .codec import Decoder, Encoder, qualified_name, resolve
from .node_checks import check_node, decode_target, encode_target, load_spec

__all__ = ["encode_graph_module", "decode_graph_module", "SAFE_MODULE_CLASSES", "allow_module_class",
           "GraphLimits"]

# exact names of the module classes users registered (discard a name to withdraw it)
SAFE_MODULE_CLASSES = tables.SAFE_MODULE_CLASSES

_OPS = ("placeholder", "get_attr", "call_function", "call_module", "call_method", "output")
_PATH_PART = re.compile(r"[A-Za-z0-9_]{1,200}\Z")
_HOOK_KEYS = "hook"


class GraphLimits:
    """The largest literal allocation a graph may ask for: 4x the elements of the
    file's own tensors, and never less than 2**24 (a mask or position table
    of a model whose tensors are small)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.elements = max(4 * sum(t.numel() for t in tensors.values()), 2**24)


def allow_module_class(cls: type) -> type:
    """Let files name module class ``cls`` (by its exact qualified name) without
    ``trust=True``; usable as a decorator. Do this only for classes whose state
    is plain data: loading rebuilds an instance with ``cls.__setstate__``."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"allow_module_class takes an nn.Module subclass, got {cls!r}")
    if "<locals>" in cls.__qualname__:
        raise TypeError(f"allow_module_class: {cls.__qualname__} is defined inside a function; files name "
                        "classes by module and qualified name, so define it at module level")
    tables.register_module_class(cls)
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


def _module_class(name: Any, trust: bool, where: str) -> type:
    cls = tables.lookup_module_class(name) if isinstance(name, str) else None
    if cls is None and trust and isinstance(name, str) and tables.is_qualname(name):
        try:
            cls = resolve(name)
        except (ImportError, AttributeError) as e:
            raise ModelFileError(f"{where}: cannot import the module class {name} ({e})") from e
    if cls is None:
        short = name.rsplit(".", 1)[-1] if isinstance(name, str) else "MyModule"
        raise UnsafeFileError(
            f"{where}: the file's model contains a module of class {name!r}, which tncompile does not rebuild "
            f"from a file unless told to: load with trust=True if you trust this file, or register the class "
            f"with tncompile.serialization.allow_module_class({short})")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise UnsafeFileError(f"{where}: the file names {name} as a module class, but it is not an nn.Module")
    return cls


def _child_names(table: Any, where: str, kind: str) -> dict:
    if not isinstance(table, dict):
        raise ModelFileError(f"{where}: {kind} must be a dict")
    for key in table:
        if not (isinstance(key, str) and _PATH_PART.match(key)):
            raise UnsafeFileError(f"{where}: {kind} has the name {key!r}; names are letters, digits and _")
    return table


class _ModuleDecoding:
    """Decoder hooks for module trees; keeps shared modules shared. Checks each
    module's class against the tables and its state's shape before the class's
    ``__setstate__`` sees it."""

    def __init__(self, trust: bool):
        self.trust = trust
        self.by_path: dict[str, nn.Module] = {}

    def module(self, dec: Decoder, v: dict, where: str) -> nn.Module:
        path, state_in = v.get("path"), v.get("state")
        if not isinstance(path, str) or not all(_PATH_PART.match(p) for p in path.split(".") if path):
            raise UnsafeFileError(f"{where}: a module path {path!r}; paths are dotted names of letters, digits, _")
        where = f"module {path or '<root>'}"
        cls = _module_class(v.get("__module__"), self.trust, where)
        if not isinstance(state_in, dict):
            raise ModelFileError(f"{where}: its state must be a dict")
        for key in state_in:
            if not tables.is_identifier(key):
                raise UnsafeFileError(f"{where}: a state entry named {key!r}; entries are identifiers")
            if _HOOK_KEYS in key and not self.trust:
                raise UnsafeFileError(f"{where}: the file sets {key}; hooks are code, which a file cannot carry")
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)  # the empty hook tables and registries every module has; no class code
        self.by_path[path] = obj
        state = {k: dec.decode(x, f"{where}.{k}") for k, x in state_in.items() if k != "_modules"}
        children = _child_names(state_in.get("_modules", {}), where, "_modules")
        state["_modules"] = {k: (None if x is None else dec.decode(x, f"{where}.{k}")) for k, x in children.items()}
        _check_state(state, where)
        try:
            obj.__setstate__(state)  # the class's own (nn.Module's, or e.g. an RNN's that relinks its weights)
        except Exception as e:  # a library class's __setstate__ meeting state it does not expect
            raise ModelFileError(f"{where}: its state does not fit {cls.__name__} ({type(e).__name__}: {e})") from e
        return obj

    def ref(self, dec: Decoder, v: dict, where: str) -> nn.Module:
        path = v["__module_ref__"]
        if not isinstance(path, str) or path not in self.by_path:
            raise ModelFileError(f"{where}: refers to module {path!r} before defining it (a damaged file)")
        return self.by_path[path]

    def graph_module(self, dec: Decoder, v: dict, where: str) -> fx.GraphModule:
        path = v.get("path")
        if not isinstance(path, str):
            raise ModelFileError(f"{where}: a subgraph without its path")
        gm = decode_graph_module(dec, v["__graph_module__"], self.trust, where=f"subgraph {path}")
        self.by_path[path] = gm
        return gm


def _check_state(state: dict, where: str) -> None:
    """The registries every module has hold what they must (parameters, tensors, modules)."""
    if not isinstance(state.get("training", True), bool):
        raise ModelFileError(f"{where}.training must be true or false")
    for key, kind, ok in (("_parameters", "parameters", lambda x: isinstance(x, nn.Parameter)),
                          ("_buffers", "buffers", lambda x: isinstance(x, torch.Tensor)),
                          ("_modules", "submodules", lambda x: isinstance(x, nn.Module))):
        table = state.get(key, {})
        _child_names(table, where, key)
        bad = [k for k, x in table.items() if x is not None and not ok(x)]
        if bad:
            raise ModelFileError(f"{where}: {key}[{bad[0]!r}] is not one of the module's {kind}")
    persistent = state.get("_non_persistent_buffers_set", set())
    if not isinstance(persistent, set) or not all(isinstance(x, str) for x in persistent):
        raise ModelFileError(f"{where}._non_persistent_buffers_set must be a set of names")


# ----------------------------------------------------------------- graphs
def encode_graph_module(enc: Encoder, gm: fx.GraphModule) -> dict:
    """``{"nodes", "pytree", "class_name", "root"}`` for ``gm``."""
    previous = enc.hooks.get(fx.Node)
    enc.hooks[fx.Node] = lambda e, n: {"__node__": n.name}
    try:
        nodes = [[n.op, n.name, encode_target(n.target, f"node {n.name}"), enc.encode(tuple(n.args), f"node {n.name}"),
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


def _codegen(info: Any, where: str) -> fx.graph.CodeGen | None:
    if info is None:
        return None
    if not (isinstance(info, dict) and set(info) == {"orig_args", "in_spec", "out_spec"}):
        raise ModelFileError(f"{where}: malformed call signature (pytree)")
    names = info["orig_args"]
    if not (isinstance(names, list) and all(tables.is_identifier(x) for x in names)):
        raise UnsafeFileError(f"{where}: the call signature's argument names {names!r} are not identifiers")
    return fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(
        names, load_spec(info["in_spec"], f"{where} (in_spec)", keys_must_be_identifiers=True),
        load_spec(info["out_spec"], f"{where} (out_spec)", keys_must_be_identifiers=False)))


def _owns(root: nn.Module, path: str) -> bool:
    """``path`` names a module, parameter, buffer or tensor attribute of ``root``."""
    *parents, last = path.split(".")
    mod = root
    for part in parents:
        mod = mod._modules.get(part)
        if mod is None:
            return False
    if last in mod._modules or last in mod._parameters or last in mod._buffers:
        return True
    return isinstance(mod.__dict__.get(last), torch.Tensor)


def decode_graph_module(dec: Decoder, data: Any, trust: bool = False, where: str = "graph") -> fx.GraphModule:
    """Inverse of :func:`encode_graph_module`: every node is checked (see the
    module docstring) before the ``GraphModule`` (and its generated code) exists."""
    if not (isinstance(data, dict) and {"nodes", "pytree", "class_name", "root"} <= set(data)):
        raise ModelFileError(f"{where}: malformed graph (needs nodes, pytree, class_name, root)")
    class_name = data["class_name"]
    if not tables.is_identifier(class_name):
        raise UnsafeFileError(f"{where}: the class name {class_name!r} is not an identifier")
    modules = _ModuleDecoding(trust)
    saved_hooks = dict(dec.hooks)
    dec.hooks.update({"__module__": modules.module, "__module_ref__": modules.ref,
                      "__graph_module__": modules.graph_module})
    try:
        root = dec.decode(data["root"], f"{where} root")
        if not isinstance(root, nn.Module):
            raise ModelFileError(f"{where}: the root is not a module")
        graph = fx.Graph()
        codegen = _codegen(data["pytree"], where)
        if codegen is not None:
            graph._codegen = codegen
        nodes = data["nodes"]
        if not isinstance(nodes, list) or not nodes:
            raise ModelFileError(f"{where}: the graph has no nodes")
        env: dict[str, fx.Node] = {}

        def node_ref(d: Decoder, v: dict, at: str) -> fx.Node:
            name = v["__node__"]
            if not isinstance(name, str) or name not in env:
                raise ModelFileError(f"{at}: refers to node {name!r} before it is defined")
            return env[name]

        dec.hooks["__node__"] = node_ref
        limit = GraphLimits(dec.tensors).elements
        outputs = 0
        for k, entry in enumerate(nodes):
            if not (isinstance(entry, list) and len(entry) == 5):
                raise ModelFileError(f"{where} node #{k}: must be [op, name, target, args, kwargs]")
            op, name, target, args, kwargs = entry
            at = f"{where} node #{k} ({name!r})"
            if op not in _OPS:
                raise ModelFileError(f"{at}: unknown graph op {op!r}")
            if name in env:
                raise ModelFileError(f"{at}: a second node named {name!r}")
            fn = decode_target(op, target, trust, at)
            if op in ("get_attr", "call_module") and not _owns(root, fn):
                raise UnsafeFileError(f"{at}: {fn!r} is not an attribute of the graph's own modules")
            if op == "call_module" and not isinstance(root.get_submodule(fn), nn.Module):
                raise ModelFileError(f"{at}: {fn!r} is not a module")
            args, kwargs = dec.decode(args, at), dec.decode(kwargs, at)
            check_node(op, name, fn, args, kwargs, trust, limit, at)
            outputs += op == "output"
            env[name] = graph.create_node(op, fn, args, kwargs, name=name)
            if env[name].name != name:
                raise UnsafeFileError(f"{at}: the node name {name!r} is reserved")
        if outputs != 1 or nodes[-1][0] != "output":
            raise ModelFileError(f"{where}: a graph ends with exactly one output node")
    finally:
        dec.hooks.clear()
        dec.hooks.update(saved_hooks)
    try:
        gm = fx.GraphModule(root, graph, class_name=class_name)
    except Exception as e:  # fx's own checks (e.g. a target it cannot find) after ours passed
        raise ModelFileError(f"{where}: the graph does not build ({type(e).__name__}: {e})") from e
    gm.training = root.training  # children keep their own modes
    return gm
