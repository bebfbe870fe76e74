"""tncompile's Triton kernels, registered as the ``"triton"`` backend of the ops' ways
(:mod:`tncompile.runtime.ways.backends`; switched on by ``tuning.TRITON_KERNELS``)."""
from __future__ import annotations

import torch

from ..ways.backends import Backend, register
from .batched_factors import TritonFactors, merges_on_triton
from .lookup_function import TritonLookup
from .merge_factors import supports
from .device_ops import DEVICE_OPS
from .thin_pair import runs_triton, thin_pair_train

__all__ = ["TRITON", "register_triton", "MEASURED_ON"]

#: where its thin pair is a candidate of the measured choice (a GPU; never the interpreter)
MEASURED_ON = ("cuda",)


def _pair_in_autocast(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                      activation: str | None = None) -> torch.Tensor:
    """``act(x A B + bias)`` on the thin pair, in the autocast dtype inside an autocast region
    (as a linear's GEMMs would run): ``(rows, P_in) -> (rows, P_out)``."""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):   # meta (a dry run): no autocast
        dtype = torch.get_autocast_dtype(device)
        x, bias = x.to(dtype), None if bias is None else bias.to(dtype)
    return thin_pair_train(x, a, b, bias, activation)


TRITON = Backend("triton", lambda like: runs_triton(like), {
    "thin_pair": _pair_in_autocast,
    "lookup": lambda *args: TritonLookup.apply(*args),
    "lookup_supports": supports,
    "merge": lambda batches, tensors: TritonFactors.apply(batches, *tensors),
    "merge_supports": merges_on_triton,
}, measured_on=MEASURED_ON, device_ops=DEVICE_OPS)   # its thin pair a candidate of the measured choice on a GPU (never the interpreter)


def register_triton() -> None:
    """Register (again) the Triton backend."""
    register(TRITON)


register_triton()
