"""``FastDropout``: ``nn.Dropout`` running tncompile's dropout (:mod:`..ways.dropout`: the
native Philox kernel on CPU, one traceable op under ``torch.compile``, PyTorch's elsewhere)."""
from __future__ import annotations

import torch
from torch import nn

from ..ways.dropout import dropout

__all__ = ["FastDropout", "dropout"]


class FastDropout(nn.Dropout):
    """``nn.Dropout`` that runs :func:`dropout` (same ``p``, ``inplace``,
    train/eval behaviour and state)."""

    @classmethod
    def from_dropout(cls, module: nn.Dropout) -> "FastDropout":
        new = cls(module.p, module.inplace)
        new.train(module.training)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return dropout(input, self.p, self.training, self.inplace)
