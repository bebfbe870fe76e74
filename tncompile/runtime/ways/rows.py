"""What every way of multiplying rows by a network's matrix shares: the input's checks,
padding the features to the modes' product, cropping the output's padding, and the
product through merged factors."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu_allocator import _state as _ALLOCATOR_STATE
from ..kernels.cpu_allocator import ensure_retained

__all__ = ["ACTIVATIONS", "as_rows", "check_input_dtype", "drop_boundary", "factor_macs", "first_cpu_use", "shaped_output",
           "through_factors"]

#: the activations a fused block or a thin pair's epilogue takes, as PyTorch computes them
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
}


def first_cpu_use(x: torch.Tensor) -> None:
    """On a layer's CPU forward outside a trace: make sure the allocator keeps
    freed memory (:func:`.cpu_allocator.ensure_retained`; once per process, opt-out
    by environment variable). Costs a dict lookup after the first time."""
    if not torch.compiler.is_compiling() and not _ALLOCATOR_STATE["checked"] and x.device.type == "cpu":
        ensure_retained()


def check_input_dtype(module: nn.Module, x: torch.Tensor) -> None:
    """Raise ``TypeError`` when ``x``'s dtype is not the layer's (as ``nn.Linear`` does,
    but saying which layer and the fix); autocast regions mix dtypes on purpose."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{type(module).__name__}: the input must be a Tensor, got {type(x).__name__}")
    dtype = next(iter(module.cores._parameters.values())).dtype if hasattr(module, "cores") else None
    if dtype is None or x.dtype == dtype or torch.is_autocast_enabled(x.device.type):
        return
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{type(module).__name__}: the input is {x.dtype}; it takes floating-point inputs "
                        f"of the layer's dtype: x.to({dtype})")
    raise TypeError(f"{type(module).__name__}: the input is {x.dtype} but the layer's cores are {dtype}; "
                    f"cast the input (x.to({dtype})) or the model (compiled.to({x.dtype}))")


def as_rows(module: nn.Module, x: torch.Tensor, bias, in_dim: int, in_modes: tuple[int, ...], out_dim: int,
            padded_out: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Size]:
    """A call's input as the rows a network contracts: ``x (..., in_dim)`` checked (dtype,
    last dim), its features padded to the modes' product -> ``(h, bias, lead)``: ``h (rows,
    *in_modes)``, ``bias`` padded to ``padded_out`` (or ``None``), ``lead = x.shape[:-1]``.
    The product's ``(rows, padded_out)`` elements go back through :func:`shaped_output`."""
    check_input_dtype(module, x)
    if x.shape[-1] != in_dim:
        raise ValueError(f"{type(module).__name__} expected last dim {in_dim}, got shape {tuple(x.shape)}")
    first_cpu_use(x)
    lead = x.shape[:-1]
    rows = x.numel() // in_dim if in_dim else 0
    padded_in = math.prod(in_modes)
    if padded_in != in_dim:
        h = F.pad(x.reshape(rows, in_dim), (0, padded_in - in_dim)).reshape(rows, *in_modes)
    else:
        h = x.reshape(rows, *in_modes)  # one view, not two: each is an autograd node
    if bias is not None and padded_out != out_dim:
        bias = F.pad(bias, (0, padded_out - out_dim))
    return h, bias, lead


def shaped_output(y: torch.Tensor, lead: torch.Size, out_dim: int, padded_out: int) -> torch.Tensor:
    """The product ``y`` (``rows x padded_out`` elements) of :func:`as_rows`'s rows as the
    call's output ``(*lead, out_dim)``, the output padding cropped."""
    if padded_out != out_dim:
        return y.reshape(-1, padded_out)[:, :out_dim].reshape(*lead, out_dim)
    return y.reshape(*lead, out_dim)


def drop_boundary(cores: list[torch.Tensor]) -> list[torch.Tensor]:
    """Cores without their size-1 boundary bonds (first core's left, last core's right)."""
    cores = list(cores)
    cores[0] = cores[0].squeeze(0)
    cores[-1] = cores[-1].squeeze(-1)
    return cores


def factor_macs(factors: tuple[torch.Tensor, torch.Tensor | None]) -> int:
    """Multiply-adds per row through a linear's inference factors ``(A, B)`` or ``(W.T, None)``."""
    a, b = factors
    return a.shape[0] * a.shape[1] + (b.shape[0] * b.shape[1] if b is not None else 0)


def through_factors(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor | None],
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ A @ B + bias`` (``x @ W.T + bias`` for a whole matrix): ``(..., in) -> (..., out)``."""
    a, b = factors
    lead = x.shape[:-1]
    h = x.reshape(-1, x.shape[-1])
    if b is not None:
        h = h @ a
        a = b
    y = torch.addmm(bias, h, a) if bias is not None else h @ a
    return y.reshape(*lead, y.shape[-1])
