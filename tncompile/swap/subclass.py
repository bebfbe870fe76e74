"""Swap mode for ``nn.Embedding`` / ``nn.Linear`` subclasses with a forward of their own.

Many models subclass a layer to change what goes in or out of it: BART's learned
positions add an offset to the ids, Gemma's and BART's scaled embeddings multiply
the rows by a constant. Replacing such a module by a plain TT / TTM layer would drop
that code. Swap mode instead keeps the user's object and runs its own ``forward``
with the *base* layer's computation done by the network: the object's class becomes
a subclass (same name, module and qualified name) that puts a stand-in between the
user's class and ``nn.Embedding`` / ``nn.Linear`` in the method order, so the
``super().forward(...)`` the user's code calls runs the network stored under
:data:`NETWORK`.

The dense ``weight`` is gone. ``self.weight`` then reads as a :class:`NetworkWeight`:
the dense weight's ``shape``, ``dtype`` and ``device`` (what such forwards read: the
dtype to cast a scale to, the device to make positions on), and nothing else -- a
forward that multiplies by ``self.weight`` itself fails loudly (``TypeError``) rather
than computing with something that is not the weight. A linear's ``bias`` is the
network's.
"""
from __future__ import annotations

import torch
from torch import nn

from ..runtime.layers import TNModule

__all__ = ["NETWORK", "NetworkWeight", "is_stand_in", "network_of", "put_stand_in", "restore_subclass"]

NETWORK = "tncompile_network"  # the child module that holds the network
_CLASSES: dict[type, type] = {}


class NetworkWeight:
    """``self.weight`` of a swapped layer subclass: the dense weight's shape, dtype and device.

    Anything else (its values, arithmetic, passing it to an op) raises with the fix."""

    def __init__(self, network: TNModule, shape: tuple[int, ...]):
        self._network, self.shape = network, torch.Size(shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._network.cores[0].dtype

    @property
    def device(self) -> torch.device:
        return self._network.cores[0].device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __getattr__(self, name: str):
        raise AttributeError(
            f"weight.{name}: in swap mode this layer's weight is a TT network ({type(self._network).__name__}); "
            "only its shape, dtype and device can be read. Its forward uses the weight itself: compile the "
            "model with mode='graph', or exclude the layer (exclude_modules=[...])")


class _EmbeddingStandIn(nn.Embedding):
    """What ``super().forward`` reaches in a swapped ``nn.Embedding`` subclass: the network."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Embedding's own name
        return self._modules[NETWORK](input)


class _LinearStandIn(nn.Linear):
    """What ``super().forward`` reaches in a swapped ``nn.Linear`` subclass: the network."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own name
        return self._modules[NETWORK](input)


def _weight(self) -> NetworkWeight:
    network = self._modules[NETWORK]
    if isinstance(self, nn.Embedding):
        return NetworkWeight(network, (self.num_embeddings, self.embedding_dim))
    return NetworkWeight(network, (self.out_features, self.in_features))


def _bias(self):
    return self._modules[NETWORK].bias


def _stand_in_class(user_cls: type) -> type:
    cls = _CLASSES.get(user_cls)
    if cls is None:
        linear = issubclass(user_cls, nn.Linear)
        namespace = {"__module__": user_cls.__module__, "__qualname__": user_cls.__qualname__,
                     "__doc__": user_cls.__doc__, "_tncompile_user_class": user_cls,
                     "weight": property(_weight, doc="the dense weight's shape, dtype and device (a TT network)"),
                     "__reduce_ex__": lambda self, protocol: (_rebuild, (user_cls,), self.__dict__)}
        if linear:
            namespace["bias"] = property(_bias, doc="the network's bias")
        cls = _CLASSES[user_cls] = type(user_cls.__name__, (user_cls, _LinearStandIn if linear else _EmbeddingStandIn),
                                        namespace)
    return cls


def _rebuild(user_cls: type) -> nn.Module:
    cls = _stand_in_class(user_cls)
    return cls.__new__(cls)


def is_stand_in(module: nn.Module | None) -> bool:
    return module is not None and "_tncompile_user_class" in type(module).__dict__


def network_of(module: nn.Module | None) -> nn.Module | None:
    """The network inside a swapped layer subclass, else ``None``."""
    return module._modules.get(NETWORK) if is_stand_in(module) else None


def put_stand_in(model: nn.Module, path: str, current: nn.Module, network: nn.Module) -> None:
    """Run ``network`` (the program's layer at ``path``) inside the user's subclass instance
    ``current``; a dense ``network`` (a collapsed layer) gives the instance its weight back."""
    if not isinstance(network, TNModule):
        if is_stand_in(current):
            model.set_submodule(path, restore_subclass(current, network.weight, getattr(network, "bias", None)))
        return  # an untouched subclass keeps its own weight
    if is_stand_in(current):
        current._modules[NETWORK] = network
        return
    swapped = _stand_in_class(type(current)).__new__(_stand_in_class(type(current)))
    swapped.__dict__.update(current.__dict__)
    drop = ("weight", "bias") if isinstance(current, nn.Linear) else ("weight",)
    swapped.__dict__["_parameters"] = {k: v for k, v in current._parameters.items() if k not in drop}
    swapped.__dict__["_buffers"] = dict(current._buffers)
    swapped.__dict__["_non_persistent_buffers_set"] = set(current._non_persistent_buffers_set)
    swapped.__dict__["_modules"] = {**current._modules, NETWORK: network}
    model.set_submodule(path, swapped)


def restore_subclass(stand_in: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """The user's own subclass again (in place of ``stand_in``, which is changed), with
    ``weight`` (and a linear's ``bias``) as its parameters."""
    stand_in._modules.pop(NETWORK, None)
    stand_in.__class__ = type(stand_in).__dict__["_tncompile_user_class"]
    stand_in._parameters["weight"] = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
    if isinstance(stand_in, nn.Linear):
        stand_in._parameters["bias"] = (None if bias is None else
                                        bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias))
    return stand_in
