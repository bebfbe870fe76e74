"""Make a model compiled on the meta device real: :func:`materialize`.

A model too large to build densely is built on the meta device (``with torch.device("meta")``),
compiled there with ``init="random"``, and only then given memory: ``to_empty(device=...)``,
then every module's ``reset_parameters()`` -- the PyTorch / FSDP2 convention. TT and TTM
layers draw their cores so that the matrix they stand for has the variance of the dense
layer's init (:meth:`~tncompile.runtime.layers.tn_module.TNModule.reset_parameters`); a
HuggingFace model's other modules get the model's own ``_init_weights`` (its
``initializer_range``, its rotary and position buffers), and the compressed layers that
variance too. No dense-sized tensor is made at any point.

Everything that could stop the work is checked before anything changes: a module whose
parameters nothing can initialize, or a buffer that exists only on the meta device with
nothing to compute it, is named with the fix, and the model is left as it was.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..runtime.layers import TNModule
from ..runtime.layers.derived import advance_weights_epoch
from .compiled import CompiledModel

__all__ = ["materialize"]

_GRAPH_HINT = ("; in graph mode the tracer keeps a module's buffers but not the module (nor its "
               "reset_parameters()): compile(..., mode='swap') keeps your modules in place")


def materialize(model: nn.Module, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                seed: int | None = None) -> nn.Module:
    """Give a model built (and compiled) on the meta device memory on ``device`` and a sound
    initialization; returns ``model`` (changed in place).

    Parameters
    ----------
    model : nn.Module
        What :func:`tncompile.compile` returned for a model on the meta device (graph or swap
        mode), or any module whose parameters are on the meta device; also one already
        sharded by FSDP2's ``fully_shard`` (every rank draws its shards of the same values).
    device : torch.device or str
        Where the parameters and buffers go.
    dtype : torch.dtype, optional
        Floating parameters and buffers are cast to it after initialization (e.g.
        ``torch.bfloat16``); default: as built.
    seed : int, optional
        Draw from ``torch.manual_seed(seed)`` without moving the caller's random streams;
        default: the current global stream.

    Returns
    -------
    nn.Module
        ``model``: TT/TTM cores drawn so that each network's matrix has the variance of its
        dense layer's init (a HuggingFace model's ``initializer_range``, else PyTorch's
        default), gates at one, every other module initialized by the HF model's
        ``_init_weights`` or its own ``reset_parameters()``; buffers that were real keep
        their values.

    Raises
    ------
    ValueError
        Naming each module that has parameters and no ``reset_parameters()`` (outside a
        HuggingFace model), or each buffer that lives only on the meta device with nothing
        to compute it -- before anything changes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"materialize expects an nn.Module, got {type(model).__name__}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("materialize(device='meta') would leave the model without memory; pass the device "
                         "to train on, e.g. 'cpu' or 'cuda'")
    hf = _hf_model(model)
    _check_initializable(model, hf)
    real_buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
    with _seeded(seed, device):
        model.to_empty(device=device)
        with torch.no_grad():
            for name, value in real_buffers.items():
                _buffer_of(model, name).copy_(value)
        _initialize(model, hf)
    if dtype is not None:
        model.to(dtype)
    advance_weights_epoch()
    return model


def _hf_model(model: nn.Module):
    """The HuggingFace ``PreTrainedModel`` whose ``_init_weights`` initializes ``model``'s
    dense modules (``model`` itself in swap mode), else ``None``."""
    return model if callable(getattr(model, "initialize_weights", None)) and hasattr(model, "config") \
        and callable(getattr(model, "_init_weights", None)) else None


def _init_std(hf) -> float | None:
    """The standard deviation a HuggingFace config gives its linears and embeddings."""
    config = hf.config
    for key in ("initializer_range", "init_std"):
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return 0.02


def _check_initializable(model: nn.Module, hf) -> None:
    """Raise (before any change) where initialization would leave memory unset."""
    if hf is not None:
        return   # the model's own _init_weights knows its modules and buffers
    networks = {id(sub) for m in model.modules() if isinstance(m, TNModule) for sub in m.modules()}
    bare = [f"{name}.{leaf}" if name else leaf for name, m in model.named_modules()
            if id(m) not in networks and not callable(getattr(m, "reset_parameters", None))
            for leaf, _ in m.named_parameters(recurse=False)]
    if bare:
        raise ValueError(f"materialize: nothing initializes the parameter{'s' if len(bare) > 1 else ''} "
                         f"{_listed(bare)}: {'its module has' if len(bare) == 1 else 'their modules have'} no "
                         "reset_parameters(), and to_empty() leaves memory as it finds it; give the module a "
                         "reset_parameters() (the PyTorch / FSDP2 convention), or build those parameters off the "
                         "meta device. The model was not changed.")
    owners = dict(model.named_modules())
    meta = [name for name, b in model.named_buffers() if b.is_meta
            and not callable(getattr(owners.get(name.rpartition(".")[0]), "reset_parameters", None))]
    if meta:
        one = len(meta) == 1
        raise ValueError(f"materialize: the buffer{'' if one else 's'} {_listed(meta)} "
                         f"{'exists' if one else 'exist'} only on the meta device and no reset_parameters() computes "
                         f"{'it' if one else 'them'}; give the owning module a "
                         "reset_parameters() that fills its buffers (the PyTorch / FSDP2 convention)"
                         f"{_GRAPH_HINT if isinstance(model, CompiledModel) else ''}. The model was not changed.")


def _listed(names: list[str], most: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _buffer_of(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return model.get_submodule(owner)._buffers[leaf] if owner else model._buffers[leaf]


def _initialize(model: nn.Module, hf) -> None:
    """Every module's initialization, TT/TTM layers at their dense layer's variance."""
    variance = _init_std(hf) ** 2 if hf is not None else None
    done: set[int] = set()
    for module in model.modules():
        if isinstance(module, TNModule):
            module.reset_parameters(variance)
            done.add(id(module))
    for module in model.modules():
        if id(module) not in done and callable(getattr(module, "reset_parameters", None)) \
                and (any(True for _ in module.parameters(recurse=False))
                     or any(True for _ in module.buffers(recurse=False))):
            module.reset_parameters()
    if hf is not None:
        for module in [hf, *hf.modules()]:   # after to_empty nothing is initialized: clear HF's flags
            module.__dict__.pop("_is_hf_initialized", None)
        hf.initialize_weights()   # dense modules and buffers; TT/TTM layers are not HF's types: untouched


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    if seed is None:
        yield
        return
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
