"""Typed, bounded fields of a model file's manifest: each accepts exactly one JSON type,
within bounds or from a fixed set, and raises ``ModelFileError`` naming where it is."""
from __future__ import annotations

import math
import re
from typing import Any

from ..errors import ModelFileError, is_int, is_real

__all__ = ["exact_keys", "module_path", "choice", "boolean", "integer", "number", "names", "MAX_NAME", "PATH"]

MAX_NAME = 512
#: a module or tensor path: dotted Python identifiers or indices, as ``named_modules`` writes them
PATH = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")


def exact_keys(data: Any, keys: set[str], at: str) -> dict:
    """``data``, an object with exactly ``keys``."""
    if not isinstance(data, dict) or set(data) != keys:
        got = sorted(map(str, data))[:12] if isinstance(data, dict) else type(data).__name__
        raise ModelFileError(f"{at}: must be an object with exactly {sorted(keys)}, got {got}")
    return data


def module_path(value: Any, at: str) -> str:
    """A dotted path (``encoder.layer.0.query``), at most :data:`MAX_NAME` characters."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or not PATH.match(value):
        raise ModelFileError(f"{at}: {value!r:.80} is not a module path")
    return value


def choice(value: Any, choices: tuple, at: str) -> Any:
    """One of ``choices`` (strings, compared exactly)."""
    if not isinstance(value, str) or value not in choices:
        raise ModelFileError(f"{at}: {value!r:.80} is not one of {list(choices)}")
    return value


def boolean(value: Any, at: str) -> bool:
    if not isinstance(value, bool):
        raise ModelFileError(f"{at}: must be true or false, got {value!r:.80}")
    return value


def integer(value: Any, low: int, high: int, at: str) -> int:
    """An int in ``[low, high]`` (never a bool)."""
    if not is_int(value) or not low <= value <= high:
        raise ModelFileError(f"{at}: {value!r:.80} is not an int in [{low}, {high}]")
    return value


def number(value: Any, low: float, high: float, at: str) -> float:
    """A finite number in ``[low, high]``."""
    if not is_real(value) or not math.isfinite(value) or not low <= value <= high:
        raise ModelFileError(f"{at}: {value!r:.80} is not a number in [{low}, {high}]")
    return float(value)


def names(data: Any, count: int | None, at: str, limit: int = 100_000) -> list[str]:
    """A list of ``count`` (any number up to ``limit`` when ``None``) dotted names."""
    ok = isinstance(data, list) and (len(data) == count if count is not None else len(data) <= limit)
    if not ok:
        raise ModelFileError(f"{at}: must be a list of {count if count is not None else f'at most {limit}'} names")
    return [module_path(n, f"{at}[{i}]") for i, n in enumerate(data)]

