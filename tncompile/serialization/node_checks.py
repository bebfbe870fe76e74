"""One graph node of a model file, checked field by field against :mod:`.tables`.

:func:`decode_target` turns a node's stored target into the function, op,
method name or path it stands for, looking names up in the tables only;
:func:`check_node` checks the rest of the node (names, argument values,
keyword keys, attribute reads, allocation sizes) before fx sees it; and
:func:`load_spec` parses the pytree specs of an exported model's signature as
data. Each raises :class:`~tncompile.errors.UnsafeFileError` (outside the
tables) or :class:`~tncompile.errors.ModelFileError` (malformed) naming the
node and the field.
"""
from __future__ import annotations

import builtins
import importlib
import json
import math
import re
import warnings
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..errors import ModelFileError, UnsafeFileError
from . import tables
from .codec import MAX_DEPTH, resolve

__all__ = ["encode_target", "decode_target", "check_node", "load_spec", "check_spec_text"]

_OP_NAME = re.compile(r"([a-z_][a-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)(\.([A-Za-z_][A-Za-z0-9_]*))?\Z")
_PLACEHOLDER = re.compile(r"\*{0,2}[A-Za-z_][A-Za-z0-9_]*\Z")
_SPEC_KEY = re.compile(r"[A-Za-z0-9_.\- ]{0,200}\Z")
_ARG_SCALARS = (type(None), bool, int, float, str, slice, type(Ellipsis), torch.dtype, torch.device,
                torch.layout, torch.memory_format)


# ----------------------------------------------------------------- targets
def encode_target(target: Any, where: str) -> Any:
    """The stored form of a node's target. Functions are stored by their table
    name; one outside the table is stored by its importable name, and the file
    will need ``trust=True`` to load (a warning says so)."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return {"__op__": target.name()}
    if isinstance(target, torch._ops.HigherOrderOperator):
        return {"__hop__": target.name()}
    name = tables.function_name(target)
    if name is not None:
        return {"__fn__": name}
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module is None or qualname is None or "<locals>" in qualname:
        raise TypeError(f"cannot save graph target {target!r} ({where}): it is not importable by name")
    for candidate in (f"{module}.{qualname}", f"{module}.{getattr(target, '__name__', qualname)}"):
        try:
            if resolve(candidate) is target:
                warnings.warn(f"tncompile.save: {where} calls {candidate}, which is outside the functions a "
                              f"model file may name; the file will load only with trust=True",
                              RuntimeWarning, stacklevel=4)
                return {"__fn__": candidate}
        except (ImportError, AttributeError):
            pass
    raise TypeError(f"cannot save graph target {target!r} ({where}): importing {module}.{qualname} does not "
                    f"give it back")


def decode_target(op: str, v: Any, trust: bool, where: str) -> Any:
    """The target a node's stored ``v`` names, found in the tables (or, with
    ``trust``, imported)."""
    if op in ("placeholder", "get_attr", "call_module", "call_method", "output"):
        if not isinstance(v, str):
            raise ModelFileError(f"{where}: the target of a {op} node must be a string")
        _check_string_target(op, v, trust, where)
        return v
    if not (isinstance(v, dict) and len(v) == 1):
        raise ModelFileError(f"{where}: a call_function target must be one of {{'__fn__'|'__op__'|'__hop__': name}}")
    tag, name = next(iter(v.items()))
    if not isinstance(name, str) or len(name) > 300:
        raise ModelFileError(f"{where}: the function name must be a string")
    if tag == "__op__":
        return _decode_op(name, trust, where)
    if tag == "__hop__":
        if name not in tables.HIGHER_ORDER_OPS and not (trust and tables.is_identifier(name)):
            raise UnsafeFileError(f"{where}: the graph calls the higher-order op {name!r}, which is not in "
                                  f"tncompile's op table; load with trust=True if you trust this file")
        try:
            return getattr(torch.ops.higher_order, name)
        except AttributeError as e:
            raise ModelFileError(f"{where}: this torch has no higher-order op {name!r}") from e
    if tag != "__fn__":
        raise ModelFileError(f"{where}: unknown target kind {tag!r}")
    fn = tables.function_table().get(name)
    if fn is None and trust and tables.is_qualname(name):
        try:
            fn = resolve(name)
        except (ImportError, AttributeError) as e:
            raise ModelFileError(f"{where}: cannot import {name} ({e})") from e
    if fn is None:
        raise UnsafeFileError(f"{where}: the graph calls {name!r}, which is not in tncompile's function table; "
                              f"load with trust=True if you trust this file")
    return fn


def _decode_op(name: str, trust: bool, where: str) -> Any:
    m = _OP_NAME.match(name)
    if not m:
        raise UnsafeFileError(f"{where}: {name!r} is not an op name (namespace::name.overload)")
    namespace, packet_name, overload = m.group(1), m.group(2), m.group(4) or "default"
    if not tables.aten_allowed(namespace, packet_name) and not trust:
        raise UnsafeFileError(f"{where}: the graph calls torch.ops.{namespace}.{packet_name}, which is not in "
                              f"tncompile's op table; load with trust=True if you trust this file")
    try:
        packet = getattr(getattr(torch.ops, namespace), packet_name)
        if overload not in packet.overloads():
            raise AttributeError(overload)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError) as e:
        raise ModelFileError(f"{where}: this torch has no op {namespace}::{packet_name}.{overload}") from e


def _check_string_target(op: str, target: str, trust: bool, where: str) -> None:
    """Strings fx pastes into code: placeholder names, attribute paths, method names."""
    if op == "placeholder":
        ok = bool(_PLACEHOLDER.match(target)) and tables.is_identifier(target.lstrip("*"))
    elif op in ("get_attr", "call_module"):
        ok = is_module_path(target)
    elif op == "call_method":
        ok = tables.is_identifier(target) and (trust or target in tables.METHODS)
    else:
        ok = target == "output"
    if not ok:
        what = {"call_method": "a method outside tncompile's method table",
                "placeholder": "an input name that is not an identifier",
                "output": "an output node whose target is not 'output'"}.get(op, "an attribute path that is not "
                                                                              "dotted names")
        raise UnsafeFileError(f"{where}: the target {target!r} is {what}"
                              + ("; load with trust=True if you trust this file" if op == "call_method" else ""))


def is_module_path(path: Any) -> bool:
    """``layers.0.ff1``: dotted parts of letters, digits and ``_``."""
    return isinstance(path, str) and 0 < len(path) <= 1000 and all(
        re.fullmatch(r"[A-Za-z0-9_]{1,200}", part) for part in path.split("."))


# ----------------------------------------------------------------- arguments
def check_node(op: str, name: Any, target: Any, args: Any, kwargs: Any, trust: bool, limit: int,
               where: str) -> None:
    """Check a decoded node (before ``graph.create_node``)."""
    if not tables.is_identifier(name):
        raise UnsafeFileError(f"{where}: the node name {name!r} is not an identifier")
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise ModelFileError(f"{where}: args must be a list and kwargs a dict")
    for key in kwargs:
        if not tables.is_identifier(key):
            raise UnsafeFileError(f"{where}: the keyword argument {key!r} is not an identifier")
    _check_values((args, kwargs), where, 0)
    if op == "placeholder" and not (len(args) <= 1 and all(isinstance(a, (type(None), bool, int, float, str))
                                                          for a in args) and not kwargs):
        raise UnsafeFileError(f"{where}: an input's default must be a number, string, bool or null")
    if trust:
        return
    if op == "call_function" and target is builtins.getattr:
        attr = args[1] if len(args) >= 2 else None
        if attr not in tables.GETATTR_NAMES:
            raise UnsafeFileError(f"{where}: the graph reads the attribute {attr!r} with getattr; files may read "
                                  f"only {sorted(tables.GETATTR_NAMES)}")
    if op == "call_method" and target in ("to", "type_as") and _has_string((args[1:], kwargs)):
        raise UnsafeFileError(f"{where}: .{target}() with a string argument (a device or type by name); files "
                              "pass dtypes and devices as values")
    if _allocates(op, target):
        size = _literal_elements(args[1:] if op == "call_method" else args, kwargs)
        if size > limit:
            raise UnsafeFileError(f"{where}: the graph asks for a tensor of {size:,} elements by literal sizes, "
                                  f"more than the file's own tensors justify ({limit:,})")


def _check_values(v: Any, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ModelFileError(f"{where}: arguments nested more than {MAX_DEPTH} deep")
    if isinstance(v, (list, tuple)):
        for x in v:
            _check_values(x, where, depth + 1)
    elif isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, (str, int)):
                raise UnsafeFileError(f"{where}: an argument dict has a {type(k).__name__} key")
            _check_values(x, where, depth + 1)
    elif not isinstance(v, (*_ARG_SCALARS, fx.Node)):
        raise UnsafeFileError(f"{where}: an argument is a {type(v).__module__}.{type(v).__qualname__}; node "
                              f"arguments are nodes, numbers, strings, dtypes, devices, slices and containers")


def _has_string(v: Any) -> bool:
    if isinstance(v, str):
        return True
    if isinstance(v, (list, tuple)):
        return any(_has_string(x) for x in v)
    if isinstance(v, dict):
        return any(_has_string(x) for x in v.values())
    return False


def _allocates(op: str, target: Any) -> bool:
    if op == "call_method":
        return target in tables.ALLOCATING_METHODS
    if op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split(".")[0] in tables.ALLOCATING_OPS
    return tables.function_name(target) in tables.ALLOCATING_FUNCTIONS


def _literal_elements(args: Any, kwargs: dict) -> int:
    """The product of the positive literal ints among ``args`` and ``kwargs`` (sizes; nodes
    are the model's own shapes and are not literal)."""
    total = 1
    stack = [args, list(kwargs.values())]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, int) and not isinstance(v, bool) and v > 1:
            total *= v
        elif isinstance(v, float) and math.isfinite(v) and v > 1:
            total *= int(v)
    return total


# ----------------------------------------------------------------- pytree specs
def check_spec_text(text: Any, where: str, keys_must_be_identifiers: bool) -> list[str]:
    """Validate a serialized treespec as data; returns the modules to import for
    its node types (transformers output modules, by the tables' pattern)."""
    if not isinstance(text, str) or len(text) > 1_000_000:
        raise ModelFileError(f"{where}: a pytree spec must be a string")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ModelFileError(f"{where}: the pytree spec is not JSON ({e})") from e
    if not (isinstance(doc, list) and len(doc) == 2 and doc[0] == 1):
        raise ModelFileError(f"{where}: the pytree spec is not [protocol 1, spec]")
    imports: list[str] = []
    stack = [(doc[1], 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH or not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"}:
            raise ModelFileError(f"{where}: a malformed pytree spec node")
        allowed, module = tables.pytree_type_allowed(node["type"])
        if not allowed:
            raise UnsafeFileError(f"{where}: the pytree spec names the type {node['type']!r}, which tncompile "
                                  "does not load")
        if module is not None:
            imports.append(module)
        context = node["context"]
        if context is not None:
            _check_context(context, where, keys_must_be_identifiers)
        if not isinstance(node["children_spec"], list):
            raise ModelFileError(f"{where}: a malformed pytree spec node")
        stack.extend((child, depth + 1) for child in node["children_spec"])
    return imports


def _check_context(context: Any, where: str, identifiers: bool) -> None:
    if not isinstance(context, str):
        raise ModelFileError(f"{where}: a pytree context must be a JSON string")
    try:
        keys = json.loads(context)
    except (ValueError, RecursionError) as e:
        raise ModelFileError(f"{where}: a pytree context is not JSON") from e
    if keys is None:
        return
    if not isinstance(keys, list):
        raise UnsafeFileError(f"{where}: a pytree context must be a list of keys")
    for key in keys:
        ok = tables.is_identifier(key) if identifiers else (
            isinstance(key, int) and not isinstance(key, bool)) or (isinstance(key, str) and _SPEC_KEY.match(key))
        if not ok:
            raise UnsafeFileError(f"{where}: the pytree key {key!r} is not "
                                  + ("an identifier (it becomes a keyword argument)" if identifiers
                                     else "a plain name"))


def load_spec(text: str | None, where: str, keys_must_be_identifiers: bool):
    """A checked treespec. Output types of transformers are registered by
    importing transformers' own module the tables' pattern admits; the class
    must then be a ``ModelOutput``."""
    if text is None:
        return None
    for module in check_spec_text(text, where, keys_must_be_identifiers):
        try:
            importlib.import_module(module)
        except Exception as e:  # not installed, or a model module needing optional packages
            raise ModelFileError(f"{where}: the model's outputs are {module} types; install transformers to "
                                 f"load it ({type(e).__name__}: {e})") from e
    try:
        spec = pytree.treespec_loads(text)
    except (KeyError, NotImplementedError, ValueError, TypeError) as e:
        raise ModelFileError(f"{where}: the pytree spec cannot be rebuilt ({type(e).__name__}: {e})") from e
    _check_output_types(spec, where)
    return spec


def _check_output_types(spec, where: str) -> None:
    stack = [spec]
    while stack:
        node = stack.pop()
        cls = node.type
        if cls is not None and cls.__module__.startswith("transformers."):
            bases = {f"{b.__module__}.{b.__qualname__}" for b in getattr(cls, "__mro__", ())}
            if "transformers.utils.generic.ModelOutput" not in bases:
                raise UnsafeFileError(f"{where}: the pytree type {cls.__qualname__} is not a transformers "
                                      "ModelOutput")
        stack.extend(node.children_specs)
