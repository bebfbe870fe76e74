"""``layer.weight`` of a TT / TTM layer: the dense matrix on call, its metadata without it."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["NetworkMatrix"]


class NetworkMatrix:
    """What ``weight`` is on a compressed layer.

    ``layer.weight()`` makes the dense matrix the network stands for (from the cores and
    gates, on every call, differentiable). ``device``, ``dtype`` and ``shape`` answer
    without making it: what tools that look at ``module.weight`` to place or size things
    read (PEFT puts an adapter on its base layer's device and dtype). There is no
    ``data`` and no in-place method: code written for a dense layer's weight fails loudly
    on a compressed layer instead of writing into a temporary copy.
    """

    __slots__ = ("_layer", "_make", "_shape")

    def __init__(self, layer: torch.nn.Module, make: Callable[[], torch.Tensor], shape: tuple[int, int]):
        self._layer = layer
        self._make = make
        self._shape = shape

    def __call__(self) -> torch.Tensor:
        return self._make()

    def _first_core(self) -> torch.Tensor:
        return next(iter(self._layer.cores._parameters.values()))

    @property
    def device(self) -> torch.device:
        return self._first_core().device

    @property
    def dtype(self) -> torch.dtype:
        return self._first_core().dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    def __repr__(self) -> str:
        return (f"NetworkMatrix(shape={tuple(self._shape)}, dtype={self.dtype}, device={self.device}): "
                "call it for the dense matrix")
