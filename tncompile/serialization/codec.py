"""Plain data <-> JSON + a table of tensors, with no code in between.

A tncompile file holds a JSON manifest and tensors (safetensors). Everything
that is not a tensor is encoded here as JSON values, tagged where JSON has no
type of its own::

    tuple            {"__tuple__": [...]}
    set              {"__set__": [...]}
    dict             a JSON object when every key is a str not starting "__",
                     else {"__dict__": [[key, value], ...]}
    tensor           {"__tensor__": "t3"}     (one entry per tensor object: ties survive)
    nn.Parameter     {"__param__": "t3", "requires_grad": true}
    torch.dtype      {"__dtype__": "float32"}   (also device, Size, layout, memory_format)
    slice, ...       {"__slice__": [a, b, c]}, {"__ellipsis__": true}
    dataclass        {"__dataclass__": "tncompile.runtime.plans.ContractionPlan", "fields": {...}}

Decoding builds only these values. Dataclasses are rebuilt only from the
classes in :data:`SAFE_DATACLASSES` (tncompile's own data records), by their
constructor; anything else is refused with an error that says so.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["Encoder", "Decoder", "UnsafeFileError", "SAFE_DATACLASSES", "qualified_name", "resolve"]

# tncompile's own records, the only dataclasses a file may name
SAFE_DATACLASSES = {
    "tncompile.runtime.plans.ContractionPlan", "tncompile.runtime.plans.Step",
    "tncompile.runtime.plans.LookupPlan", "tncompile.formats.layout.TTLayout",
    "tncompile.formats.layout.TTMLayout", "tncompile.ir.program.InputSpec",
    "tncompile.ir.program.PassRecord", "tncompile.options.CompileOptions",
    "tncompile.train.history.History",
}

_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeFileError(ValueError):
    """A file asks for something tncompile does not load without ``trust=True``."""


def qualified_name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def resolve(name: str) -> Any:
    """Import ``a.b.C`` (module ``a.b``, attribute path ``C``)."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import {name}")


class Encoder:
    """Encode values to JSON, collecting tensors in :attr:`tensors`.

    ``hooks`` maps a type to a function ``(encoder, value) -> json`` for types
    the caller encodes itself (modules, graph nodes).
    """

    def __init__(self, hooks: dict[type, Callable] | None = None):
        self.tensors: dict[str, torch.Tensor] = {}
        self._keys: dict[int, str] = {}
        self._keep: list[torch.Tensor] = []  # keep ids stable while encoding
        self.hooks = dict(hooks or {})

    def tensor_key(self, t: torch.Tensor) -> str:
        key = self._keys.get(id(t))
        if key is None:
            if t.is_sparse or t.is_quantized or t.layout != torch.strided:
                raise TypeError(f"cannot save a {t.layout} tensor (only dense tensors)")
            key = self._keys[id(t)] = f"t{len(self.tensors)}"
            self.tensors[key] = t.detach().to("cpu").clone().contiguous()
            self._keep.append(t)
        return key

    def encode(self, v: Any, where: str = "value") -> Any:
        for cls, hook in self.hooks.items():
            if isinstance(v, cls):
                return hook(self, v)
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, float)):
            return v
        if isinstance(v, nn.Parameter):
            return {"__param__": self.tensor_key(v), "requires_grad": bool(v.requires_grad)}
        if isinstance(v, torch.Tensor):
            return {"__tensor__": self.tensor_key(v)}
        if isinstance(v, torch.Size):
            return {"__size__": list(v)}
        if isinstance(v, torch.device):
            return {"__device__": str(v)}
        if isinstance(v, _TORCH_VALUES):
            return {"__torch__": str(v).replace("torch.", "")}
        if isinstance(v, slice):
            return {"__slice__": [self.encode(x, where) for x in (v.start, v.stop, v.step)]}
        if v is Ellipsis:
            return {"__ellipsis__": True}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"__tuple__": [self.encode(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.encode(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, (set, frozenset)):
            return {"__set__": [self.encode(x, where) for x in sorted(v, key=repr)]}
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in v):
                return {k: self.encode(x, f"{where}[{k!r}]") for k, x in v.items()}
            return {"__dict__": [[self.encode(k, where), self.encode(x, f"{where}[{k!r}]")] for k, x in v.items()]}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            name = qualified_name(type(v))
            if name not in SAFE_DATACLASSES:
                raise TypeError(f"cannot save {where}: a {name} (tncompile files hold data only: tensors, "
                                f"numbers, strings, lists, tuples, dicts and tncompile's own records)")
            fields = {f.name: self.encode(getattr(v, f.name), f"{where}.{f.name}")
                      for f in dataclasses.fields(v) if f.init}
            return {"__dataclass__": name, "fields": fields}
        raise TypeError(f"cannot save {where}: a {type(v).__module__}.{type(v).__qualname__} (tncompile files "
                        f"hold data only: tensors, numbers, strings, lists, tuples, dicts and tncompile's "
                        f"own records)")


class Decoder:
    """Inverse of :class:`Encoder`: ``tensors`` is the file's tensor table.

    ``hooks`` maps a tag (``"__module__"``) to ``(decoder, json) -> value``.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], hooks: dict[str, Callable] | None = None):
        self.tensors = tensors
        self.hooks = dict(hooks or {})
        self._params: dict[str, nn.Parameter] = {}

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise ValueError(f"the file refers to tensor {key!r}, which it does not hold (a damaged file)")
        return self.tensors[key]

    def decode(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.decode(x) for x in v]
        if not isinstance(v, dict):
            raise ValueError(f"unexpected value in the file: {type(v).__name__}")
        tag = next(iter(v), None)
        if tag is None or not tag.startswith("__"):
            return {k: self.decode(x) for k, x in v.items()}
        if tag in self.hooks:
            return self.hooks[tag](self, v)
        body = v[tag]
        if tag == "__tensor__":
            return self.tensor(body)
        if tag == "__param__":
            p = self._params.get(body)
            if p is None:  # one Parameter object per tensor: tied parameters stay tied
                p = self._params[body] = nn.Parameter(self.tensor(body), requires_grad=bool(v["requires_grad"]))
            return p
        if tag == "__tuple__":
            return tuple(self.decode(x) for x in body)
        if tag == "__set__":
            return {self.decode(x) for x in body}
        if tag == "__dict__":
            return {self.decode(k): self.decode(x) for k, x in body}
        if tag == "__size__":
            return torch.Size(body)
        if tag == "__device__":
            return torch.device(body)
        if tag == "__torch__":
            value = getattr(torch, body, None)
            if not isinstance(value, _TORCH_VALUES):
                raise UnsafeFileError(f"the file names torch.{body}, which is not a dtype, layout or memory format")
            return value
        if tag == "__slice__":
            return slice(*(self.decode(x) for x in body))
        if tag == "__ellipsis__":
            return Ellipsis
        if tag == "__dataclass__":
            if body not in SAFE_DATACLASSES:
                raise UnsafeFileError(f"the file names the record type {body}, which tncompile does not load")
            cls = resolve(body)
            return cls(**{k: self.decode(x) for k, x in v["fields"].items()})
        raise ValueError(f"unknown tag {tag!r} in the file (written by a newer tncompile?)")
