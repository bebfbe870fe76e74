"""Which dense modules tncompile can compress."""
from __future__ import annotations

from torch import nn

from ..runtime.layers.experts import ExpertLinear
from ..runtime.layers.module_kinds import is_hf_conv1d

__all__ = ["is_linear", "is_embedding", "is_embedding_bag", "is_experts", "is_compressible", "kind_of"]


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_hf_conv1d(module)


def is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding)


def is_embedding_bag(module: nn.Module) -> bool:
    return isinstance(module, nn.EmbeddingBag)


def is_experts(module: nn.Module) -> bool:
    """A mixture-of-experts weight outlined by the frontend (:class:`~tncompile.runtime.layers.experts.ExpertLinear`)."""
    return isinstance(module, ExpertLinear)


def is_compressible(module: nn.Module) -> bool:
    return is_linear(module) or is_embedding(module) or is_embedding_bag(module) or is_experts(module)


def kind_of(module: nn.Module) -> str:
    """``"linear"``, ``"conv1d"``, ``"embedding"``, ``"embedding_bag"`` or ``"experts"``."""
    if is_hf_conv1d(module):
        return "conv1d"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.EmbeddingBag):
        return "embedding_bag"
    if is_experts(module):
        return "experts"
    raise TypeError(f"{type(module).__name__} is not compressible")
