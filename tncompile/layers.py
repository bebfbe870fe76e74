"""Which dense modules tncompile can compress."""
from __future__ import annotations

from torch import nn

from .runtime.module_kinds import is_hf_conv1d

__all__ = ["is_linear", "is_embedding", "is_compressible", "kind_of"]


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_hf_conv1d(module)


def is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding)


def is_compressible(module: nn.Module) -> bool:
    return is_linear(module) or is_embedding(module)


def kind_of(module: nn.Module) -> str:
    """``"linear"``, ``"conv1d"`` or ``"embedding"``."""
    if is_hf_conv1d(module):
        return "conv1d"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    raise TypeError(f"{type(module).__name__} is not compressible")
