"""Calling a model with inputs given as a tensor, a tuple or a mapping."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["call_model"]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)`` for a tensor, ``model(*inputs)`` for a tuple or list,
    ``model(**inputs)`` for a mapping (a dict, a tokenizer's ``BatchEncoding``)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)
