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
classes in :data:`.tables.DATACLASSES` (tncompile's own data records), by their
constructor; dtypes and other torch values from :data:`.tables.TORCH_VALUES`;
anything else is refused. Every malformed value raises
:class:`~tncompile.errors.ModelFileError` naming where it is in the file.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ModelFileError, UnsafeFileError
from .tables import DATACLASSES, TORCH_VALUES, dataclass_of

__all__ = ["Encoder", "Decoder", "ModelFileError", "UnsafeFileError", "SAFE_DATACLASSES", "qualified_name", "resolve"]

# tncompile's own records, the only dataclasses a file may name (:data:`.tables.DATACLASSES`)
SAFE_DATACLASSES = frozenset(DATACLASSES)

_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def qualified_name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def resolve(name: str) -> Any:
    """Import ``a.b.C`` (module ``a.b``, attribute path ``C``). Only for names that
    tncompile itself chose (saving, ``trust=True`` loads): never for a name read
    from a file that has not been checked against :mod:`.tables`."""
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


_DEVICE = re.compile(r"(cpu|cuda|meta|mps|xpu|hpu)(:[0-9]{1,4})?\Z")
MAX_DEPTH = 64          # nesting a file's values may have (a module tree, a graph's args)
MAX_INT = 2**63         # ints beyond int64 are not sizes, ranks or counts of anything


def _fail(where: str, what: str) -> ModelFileError:
    return ModelFileError(f"{where}: {what}")


class Decoder:
    """Inverse of :class:`Encoder`: ``tensors`` is the file's tensor table.

    Builds only the values listed in the module docstring. Every value is
    checked for its type and shape before it is used; a wrong one raises
    :class:`ModelFileError` naming where in the file it is (``where``), and a
    name outside the tables raises :class:`UnsafeFileError`.
    ``hooks`` maps a tag (``"__module__"``) to ``(decoder, json, where) -> value``.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], hooks: dict[str, Callable] | None = None):
        self.tensors = tensors
        self.hooks = dict(hooks or {})
        self._params: dict[str, nn.Parameter] = {}
        self._depth = 0

    def tensor(self, key: Any, where: str = "the file") -> torch.Tensor:
        if not isinstance(key, str) or key not in self.tensors:
            raise _fail(where, f"refers to tensor {key!r}, which the file does not hold (a damaged file)")
        return self.tensors[key]

    def decode(self, v: Any, where: str = "the file") -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _fail(where, f"values nested more than {MAX_DEPTH} deep")
            return self._decode(v, where)
        finally:
            self._depth -= 1

    def _decode(self, v: Any, where: str) -> Any:
        if v is None or isinstance(v, (bool, str, float)):
            return v
        if isinstance(v, int):
            if abs(v) > MAX_INT:
                raise _fail(where, f"the integer {v} is out of range")
            return v
        if isinstance(v, list):
            return [self.decode(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if not isinstance(v, dict):
            raise _fail(where, f"unexpected value of type {type(v).__name__}")
        tag = next(iter(v), None)
        if tag is None or not tag.startswith("__"):
            return {k: self.decode(x, f"{where}[{k!r}]") for k, x in v.items()}
        if tag in self.hooks:
            return self.hooks[tag](self, v, where)
        body = v[tag]
        if tag == "__tensor__":
            return self.tensor(body, where)
        if tag == "__param__":
            requires_grad = v.get("requires_grad")
            if not isinstance(requires_grad, bool):
                raise _fail(where, "a parameter's requires_grad must be true or false")
            p = self._params.get(body)
            if p is None:  # one Parameter object per tensor: tied parameters stay tied
                t = self.tensor(body, where)
                if requires_grad and not (t.is_floating_point() or t.is_complex()):
                    raise _fail(where, f"a parameter of dtype {t.dtype} cannot require gradients")
                p = self._params[body] = nn.Parameter(t, requires_grad=requires_grad)
            return p
        if tag in ("__tuple__", "__set__", "__size__", "__slice__", "__dict__") and not isinstance(body, list):
            raise _fail(where, f"{tag} must hold a list")
        if tag == "__tuple__":
            return tuple(self.decode(x, f"{where}[{i}]") for i, x in enumerate(body))
        if tag == "__set__":
            out = set()
            for i, x in enumerate(body):
                item = self.decode(x, f"{where}[{i}]")
                if not isinstance(item, (str, int, float, bool, tuple, type(None))):
                    raise _fail(where, f"a set holds a {type(item).__name__}")
                out.add(item)
            return out
        if tag == "__dict__":
            out = {}
            for i, pair in enumerate(body):
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise _fail(f"{where}[{i}]", "a dict entry must be a [key, value] pair")
                key = self.decode(pair[0], f"{where}[{i}].key")
                if not isinstance(key, (str, int, float, bool, tuple, type(None))):
                    raise _fail(f"{where}[{i}]", f"a dict key is a {type(key).__name__}")
                out[key] = self.decode(pair[1], f"{where}[{key!r}]")
            return out
        if tag == "__size__":
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_INT for x in body):
                raise _fail(where, "a torch.Size holds something other than non-negative ints")
            return torch.Size(body)
        if tag == "__device__":
            if not (isinstance(body, str) and _DEVICE.match(body)):
                raise _fail(where, f"{body!r} is not a device")
            return torch.device(body)
        if tag == "__torch__":
            value = TORCH_VALUES.get(body) if isinstance(body, str) else None
            if value is None:
                raise UnsafeFileError(f"{where}: the file names torch.{body}, which is not a dtype, layout "
                                      f"or memory format tncompile loads")
            return value
        if tag == "__slice__":
            if len(body) != 3:
                raise _fail(where, "a slice must have start, stop and step")
            parts = [self.decode(x, where) for x in body]
            if not all(x is None or (isinstance(x, int) and not isinstance(x, bool)) for x in parts):
                raise _fail(where, "a slice's bounds must be ints or null")
            return slice(*parts)
        if tag == "__ellipsis__":
            return Ellipsis
        if tag == "__dataclass__":
            cls = dataclass_of(body) if isinstance(body, str) else None
            if cls is None:
                raise UnsafeFileError(f"{where}: the file names the record type {body!r}, which tncompile "
                                      f"does not load")
            fields_ = v.get("fields")
            if not isinstance(fields_, dict):
                raise _fail(where, f"a {body} record without its fields")
            known = {f.name for f in dataclasses.fields(cls) if f.init}
            unknown = set(fields_) - known
            if unknown:
                raise _fail(where, f"a {body} record with unknown fields {sorted(unknown)}")
            values = {k: self.decode(x, f"{where}.{k}") for k, x in fields_.items()}
            try:
                return cls(**values)
            except (TypeError, ValueError) as e:
                raise _fail(where, f"cannot rebuild a {body} from these fields ({e})") from e
        raise _fail(where, f"unknown tag {tag!r} (written by a newer tncompile?)")
