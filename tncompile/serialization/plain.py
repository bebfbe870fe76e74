"""Plain data in a model file: JSON values and tensors, nothing else.

A checkpoint's optimizer state, controller state, random streams and ``extra`` (what
``fit`` keeps: its history as a dict, a scheduler's ``state_dict``) are nested dicts,
lists and tuples of ``None``, bools, numbers, strings and tensors. :func:`encode` writes
them as JSON, each tensor replaced by ``{"$tensor": name}`` (stored beside the model's
tensors), a tuple by ``{"$tuple": [...]}`` and a dict whose keys are not all plain strings
by ``{"$items": [[key, value], ...]}``. :func:`decode` reads exactly these forms back --
any other object, a name of no tensor, too deep a nesting or too many values is a
``ModelFileError``. No class is ever named or built: a value is data or it is refused.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ..errors import ModelFileError

__all__ = ["encode", "decode", "MAX_DEPTH", "MAX_VALUES", "MAX_TEXT"]

MAX_DEPTH = 32
MAX_VALUES = 10_000_000
MAX_TEXT = 100_000
_MARKS = ("$tensor", "$tuple", "$items")


def encode(value: Any, tensors: dict[str, torch.Tensor], prefix: str, where: str = "value") -> Any:
    """``value`` as JSON; its tensors go into ``tensors`` as ``prefix.<n>``. ``TypeError``
    naming where an object that is not plain data sits (a file holds no code)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor):
        name = f"{prefix}.{len([k for k in tensors if k.startswith(prefix + '.')])}"
        tensors[name] = value.detach()
        return {"$tensor": name}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, tensors, prefix, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, prefix, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, tensors, prefix, f"{where}[{k!r}]") for k, v in value.items()}
        return {"$items": [[encode(k, tensors, prefix, f"{where} key"), encode(v, tensors, prefix, f"{where}[{k!r}]")]
                           for k, v in value.items()]}
    raise TypeError(f"cannot save {where} (a {type(value).__name__}): a model file holds plain data only (None, "
                    "bools, numbers, strings, tensors, and lists, tuples and dicts of them); convert it first")


def decode(data: Any, tensors: Mapping[str, Any], where: str, used: set[str] | None = None,
           prefix: str | None = None) -> Any:
    """The value :func:`encode` wrote (see the module doc); ``used`` collects the tensor names
    read. Each name is read once (``encode`` never writes one twice: two places sharing a
    tensor, an optimizer's moment two parameters share, are refused), and only names under
    ``prefix`` (the model's own tensors are not data of this part)."""
    count = [0]
    return _decode(data, tensors, where, 0, count, used if used is not None else set(), prefix)


def _decode(data: Any, tensors, where: str, depth: int, count: list, used: set, prefix: str | None) -> Any:
    count[0] += 1
    if count[0] > MAX_VALUES:
        raise ModelFileError(f"{where}: more than {MAX_VALUES:,} values")
    if depth > MAX_DEPTH:
        raise ModelFileError(f"{where}: nested deeper than {MAX_DEPTH}")
    if data is None or isinstance(data, bool):
        return data
    if isinstance(data, int):
        return data
    if isinstance(data, float):
        return data  # NaN and infinities are numbers a loss or a state may hold
    if isinstance(data, str):
        if len(data) > MAX_TEXT:
            raise ModelFileError(f"{where}: a string of {len(data):,} characters (at most {MAX_TEXT:,})")
        return data
    if isinstance(data, list):
        return [_decode(v, tensors, f"{where}[{i}]", depth + 1, count, used, prefix) for i, v in enumerate(data)]
    if not isinstance(data, dict):
        raise ModelFileError(f"{where}: {type(data).__name__} is not plain data")
    marks = [k for k in data if isinstance(k, str) and k.startswith("$")]
    if marks:
        if marks[0] not in _MARKS:
            raise ModelFileError(f"{where}: {marks[0]!r:.40} is not plain data")
        if len(data) != 1:
            raise ModelFileError(f"{where}: {marks[0]!r} must be the object's only key")
        mark, body = next(iter(data.items()))
        if mark == "$tensor":
            if not isinstance(body, str) or body not in tensors:
                raise ModelFileError(f"{where}: names no tensor of the file ({body!r:.80})")
            if prefix is not None and not body.startswith(prefix + "."):
                raise ModelFileError(f"{where}: names the tensor {body!r:.80}, which is not one of {prefix}.*")
            if body in used:
                raise ModelFileError(f"{where}: the tensor {body!r:.80} is named twice (a file shares no tensor "
                                     "between two places of its data)")
            used.add(body)
            return tensors[body]
        if not isinstance(body, list):
            raise ModelFileError(f"{where}: {mark!r} holds a list")
        if mark == "$tuple":
            return tuple(_decode(v, tensors, f"{where}[{i}]", depth + 1, count, used, prefix) for i, v in enumerate(body))
        out = {}
        for i, item in enumerate(body):
            if not (isinstance(item, list) and len(item) == 2):
                raise ModelFileError(f"{where}: item {i} is not a [key, value] pair")
            key = _decode(item[0], tensors, f"{where} key {i}", depth + 1, count, used, prefix)
            if not (key is None or isinstance(key, (bool, int, float, str)) or
                    (isinstance(key, tuple) and all(isinstance(k, (int, str)) for k in key))):
                raise ModelFileError(f"{where}: key {i} is not a plain value")
            if isinstance(key, float) and math.isnan(key):
                raise ModelFileError(f"{where}: key {i} is NaN")
            out[key] = _decode(item[1], tensors, f"{where}[{key!r:.40}]", depth + 1, count, used, prefix)
        return out
    return {k: _decode(v, tensors, f"{where}[{k!r:.40}]", depth + 1, count, used, prefix) for k, v in data.items()}
