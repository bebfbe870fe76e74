"""Swap mode: the user's own model object, its compressed layers replaced in place.

``tncompile.compile(model, mode="swap")`` runs the same trace, passes, rank
sizing and dumps as graph mode, then puts the resulting TT / TTM layers into
the user's module tree at the paths of the layers they replace (as PEFT and
torchao do) and returns that model -- a copy unless ``inplace=True``. The
model keeps its class and its own ``forward``: a HuggingFace model keeps
``config``, ``generate`` with its KV cache, masks, every keyword argument;
dropout follows ``train()`` / ``eval()`` as written (on tncompile's kernels when
``lower_dropout`` is in the pipeline; graph-mode lowerings made in the tree:
:mod:`tncompile.swap.lowering`). ``save_pretrained`` writes an HF folder that
``from_pretrained`` (tncompile's quantization backend) and ``tncompile.load(folder,
model=TheClass)`` rebuild exactly (:mod:`tncompile.integrations.hf_folder`).

The returned object's class is a subclass of the user's class, made once per
class, with the same name, module and qualified name, that adds
:class:`SwapMixin`: the same API as :class:`~tncompile.result.compiled.CompiledModel`
(``program``, ``ratio``, ``report()``, ``tensorized_modules()``,
``to_dense()``), so ``RankController``, ``fit`` and ``TrainStep`` take it as
they take a compiled model. It pickles and deep-copies as that subclass, and
``isinstance(swapped, type(model))`` holds.

Fused mixture-of-experts parameters are swapped through the module that owns
them (:mod:`tncompile.swap.expert_params`); layer subclasses with a forward of their own
keep it, the network running under it (:mod:`tncompile.swap.subclass`).

The program and the model share the layer objects. Every pipeline run on the
program afterwards (a rank cut during training, collapsing a layer) is
followed by :class:`Resync`, which puts the program's current layers back
into the model's tree, so the two never diverge.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..runtime.kernels.denormals import call_flushing
from ..ir.program import Program
from ..frontend.layers import is_compressible, kind_of
from ..result.model_api import LATER_DUMP_DIR, CompressedModelAPI
from ..runtime.layers.module_kinds import replaces_forward
from .kinds import SWAPPED_PATHS, put_all, restore_all, swapped_paths
from .lowering import lower_into, register_for, restore_lowerings

__all__ = ["SwapMixin", "attach", "swappable_layers", "unswappable_layers", "replaces_forward", "is_swapped",
           "user_class", "Resync", "MIXIN_NAMES", "register_folder_writer"]

# what the mixin adds; a model class that has any of these already cannot take it
MIXIN_NAMES = ("program", "ratio", "report", "tensorized_modules", "to_dense")
_SUBCLASSES: dict[type, type] = {}
# writes SwapMixin.save_pretrained's folder; tncompile.serialization (which imports this
# module) registers it, so this module never imports the serialization layer back
_FOLDER_WRITER = None


def register_folder_writer(writer) -> None:
    """Set what ``save_pretrained`` of a swapped model calls: ``writer(model, directory, **kwargs)``."""
    global _FOLDER_WRITER
    _FOLDER_WRITER = writer



def _swappable(module: nn.Module) -> bool:
    """An ``nn.EmbeddingBag`` subclass with its own forward has no stand-in
    (:mod:`tncompile.swap.subclass` covers ``nn.Embedding`` and ``nn.Linear`` ones)."""
    return not (isinstance(module, nn.EmbeddingBag) and replaces_forward(module))


def swappable_layers(model: nn.Module) -> dict[str, str]:
    """``path -> kind`` of every compressible layer in ``model``'s own module tree that swap
    mode can put a network into (subclasses with their own forward included)."""
    return {name: kind_of(m) for name, m in model.named_modules()
            if name and is_compressible(m) and _swappable(m)}


def unswappable_layers(model: nn.Module) -> dict[str, str]:
    """``path -> why`` for the compressible layers swap mode keeps dense."""
    return {name: (f"a {type(m).__name__} (an nn.EmbeddingBag subclass with its own forward): swap mode "
                   "keeps it dense, mode='graph' compresses it")
            for name, m in model.named_modules() if name and is_compressible(m) and not _swappable(m)}


def is_swapped(model: Any) -> bool:
    return isinstance(model, SwapMixin)


def user_class(model: nn.Module) -> type:
    """The user's own class of ``model`` (under the swap-mode subclass, if any)."""
    return type(model).__bases__[1] if is_swapped(model) else type(model)  # subclass_of's (SwapMixin, user's)


class SwapMixin(CompressedModelAPI):
    """What a model compiled in swap mode adds to its own class (see the module docstring)."""

    _tncompile_program: Program
    transient_state = ("_factor_peers",)  # not saved: rebuilt when a file is loaded

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # each call is a fresh forward: merged factors left from the last one are not used
        # (runtime.factor_groups); under torch.compile the layers merge their own
        if not torch.compiler.is_compiling():
            peers = self.__dict__.get("_factor_peers")
            if peers is not None:
                peers.forget()
        return call_flushing(self, super().__call__, *args, **kwargs)

    @property
    def program(self) -> Program:
        """The IR the layers were compiled by (shared with this model's layers)."""
        return self.__dict__["_tncompile_program"]

    def to_dense(self) -> nn.Module:
        """The user's own class again (not this subclass), every network multiplied back into
        a dense layer of its original kind and orientation (HF ``Conv1D`` stores ``[in, out]``),
        tied heads tied to the rebuilt embedding: ``save_pretrained`` of it loads with
        ``from_pretrained`` (PEFT's ``merge_and_unload``)."""
        dense = copy.deepcopy(self)
        dense.__class__ = user_class(self)
        for key in ("_tncompile_program", LATER_DUMP_DIR, "_factor_peers", SWAPPED_PATHS):  # the binding
            dense.__dict__.pop(key, None)
        restore_all(dense, swapped_paths(self))  # each kind puts itself back (swap/kinds.py)
        restore_lowerings(dense)
        return dense

    def save_pretrained(self, save_directory, **kwargs: Any) -> None:
        """Write an HF folder that ``from_pretrained`` (after ``import tncompile``) and
        ``tncompile.load(folder, model=YourClass)`` rebuild exactly: ``model.safetensors``
        under the model's own names and ``config.json`` with the layer table as its
        ``quantization_config``. Takes HF's keywords (``is_main_process``; ``state_dict``
        is ignored: the model's own state is saved). For a dense HF folder:
        ``to_dense().save_pretrained``."""
        if _FOLDER_WRITER is None:  # tncompile.serialization registers it on import
            raise RuntimeError("tncompile.serialization is not imported")
        _FOLDER_WRITER(self, save_directory, **kwargs)

    def __reduce_ex__(self, protocol):
        # pickle / deepcopy as (rebuild the subclass of the user's class, this state)
        return _rebuild, (user_class(self),), self.__dict__


def _rebuild(base: type) -> nn.Module:
    register_for(base)  # an HF model's attention may be tncompile's, in a fresh process too
    cls = subclass_of(base)
    return cls.__new__(cls)


def subclass_of(base: type) -> type:
    """The swap-mode subclass of ``base``: same name, module and qualified name, plus :class:`SwapMixin`."""
    cls = _SUBCLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (SwapMixin, base), {"__module__": base.__module__,
                                                      "__qualname__": base.__qualname__,
                                                      "__doc__": base.__doc__})
        _SUBCLASSES[base] = cls
    return cls


class Resync:
    """Run after every pipeline on a swap-mode program: put the program's current layer at each
    swapped path back into the model (a cut or a collapse may have replaced it)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, program: Program) -> None:
        put_all(self.model, program)


def attach(model: nn.Module, program: Program, layers: dict[str, str]) -> nn.Module:
    """Swap mode's result: ``model``, its class made the swap-mode subclass of its own, holding
    the program's layers (each put by its kind: :mod:`.kinds`) and graph mode's lowerings
    (:mod:`.lowering`), and kept holding the program's current layers after every later
    pipeline run (:class:`Resync`). ``layers``: ``path -> kind`` of the layers of the
    model's own tree its program could compress (what ``compile`` traced)."""
    model.__class__ = subclass_of(type(model))
    model.__dict__["_tncompile_program"] = program  # the swap binding lives on the swapped model
    model.__dict__[SWAPPED_PATHS] = dict(layers)
    put_all(model, program)
    lower_into(model, program)
    program.listeners.append(Resync(model))
    return model
