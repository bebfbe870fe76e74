"""``CollapsedLayer``: what rank adaptation leaves of a layer it removed."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["CollapsedLayer"]

KINDS = ("linear", "embedding", "embedding_bag", "experts")


class CollapsedLayer(nn.Module):
    """What is left of a layer whose every rank on some bond was switched off.

    Its matrix is zero, so a linear becomes its bias alone (zeros without a
    bias) and an embedding returns zeros.

    Shapes
    ------
    linear: ``(..., in_features) -> (..., out_features)``;
    embedding: ids ``(...) -> (..., out_features)``;
    embedding_bag: ids ``(B, N)``, or ``(N,)`` and offsets -> ``(B, out_features)``;
    experts: ``x (rows, in_features), offs -> (rows, out_features)``.
    """

    def __init__(self, kind: str, out_features: int, dense_params: int, bias: nn.Parameter | None,
                 dtype: torch.dtype, device: torch.device | None = None, reason: str = "",
                 include_last_offset: bool = False):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.out_features, self.dense_params, self.reason = kind, out_features, dense_params, reason
        self.include_last_offset = include_last_offset
        self.bias = bias
        self.register_buffer("_like", torch.empty(0, dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor, *extra) -> torch.Tensor:  # experts' and bags' offsets
        if self.kind == "embedding_bag":  # one row per bag
            offsets = extra[0] if extra else None
            lead = (x.shape[0],) if x.dim() == 2 else (offsets.shape[0] - int(self.include_last_offset),)
        else:
            lead = x.shape if self.kind == "embedding" else x.shape[:-1]
        out = torch.zeros(*lead, self.out_features, dtype=self._like.dtype, device=x.device)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"{self.kind}, out_features={self.out_features}, bias={self.bias is not None}"
