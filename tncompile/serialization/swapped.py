"""Saving and loading a swap-mode model (:mod:`tncompile.swap`).

A swap-mode file is a format-2 file whose manifest has one more section,
``"swap"``: the exact class name of the user's model, ``path -> kind`` of its
swapped layers, and its state outside the tncompile layers (by name, as
``state_dict`` names it). The program is stored as in graph mode; its
tensors are the model's own objects, so each is written once.

Loading needs the dense model to load onto (a file holds no code, so it
cannot build an HF model itself): ``tncompile.load(path, model=fresh)``
checks that ``fresh`` is of exactly the saved class and has a layer of the
saved kind at every swapped path, puts the file's layers at those paths,
loads the rest of the state into ``fresh``, lets the program's graph share
``fresh``'s modules and tensors, and gives ``fresh`` the swap-mode API.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ModelFileError
from ..ir.program import Program, module_at
from ..swap_lowering import lower_into
from ..swap_experts import is_expert_parameter
from ..swap import Resync, is_swapped, subclass_of, swap_into, swappable_layers, user_class
from .codec import Decoder, Encoder, qualified_name
from .node_checks import is_module_path

__all__ = ["encode_swap", "attach_swap", "ModelMismatchError"]


class ModelMismatchError(ValueError):
    """The dense model given to load a swap-mode file onto is not the one it was saved from."""

_KINDS = ("linear", "conv1d", "embedding", "embedding_bag", "experts")


def _tncompile_owned(model: nn.Module, layers: dict[str, str]) -> set[str]:
    """State names that belong to the swapped layers (stored with the program instead)."""
    owned = set()
    for path in layers:
        layer = module_at(model, path)  # None: experts kept as the owner's dense parameter
        for name in (layer.state_dict(keep_vars=True) if layer is not None else ()):
            owned.add(f"{path}.{name}")
    return owned


def encode_swap(enc: Encoder, model: nn.Module) -> dict[str, Any]:
    """The ``"swap"`` section of a swap-mode model's manifest."""
    program: Program = model.program
    layers = dict(program.swap_layers)
    owned = _tncompile_owned(model, layers)
    state = {name: enc.encode(t, f"state {name}") for name, t in model.state_dict(keep_vars=True).items()
             if name not in owned}
    return {"class": qualified_name(user_class(model)), "layers": layers, "state": state}


def attach_swap(program: Program, data: Any, dec: Decoder, model: Any, path) -> nn.Module:
    """Put the loaded ``program``'s layers into ``model`` (see the module docstring)."""
    if not isinstance(data, dict) or set(data) != {"class", "layers", "state"}:
        raise ModelFileError(f"{path}: malformed swap section")
    if not isinstance(model, nn.Module):
        raise ModelMismatchError(f"{path} holds a swap-mode model (HF models compile to swap mode by default): "
                                 f"pass the dense model to load it onto, of class {data['class']}, e.g. "
                                 "tncompile.load(path, model=YourModel(config))")
    if is_swapped(model):
        raise ModelMismatchError("tncompile.load(model=...): the model is already compiled; pass a fresh dense model")
    if qualified_name(type(model)) != data["class"]:
        raise ModelMismatchError(f"{path} was saved from a {data['class']}, the model given is a "
                         f"{qualified_name(type(model))}")
    layers = data["layers"]
    if not isinstance(layers, dict) or not all(is_module_path(p) and k in _KINDS for p, k in layers.items()):
        raise ModelFileError(f"{path}: the swap section's layers must map module paths to layer kinds")
    present = swappable_layers(model)
    present.update({p: "experts" for p, k in layers.items() if k == "experts" and is_expert_parameter(model, p)})
    wrong = {p: (k, present.get(p)) for p, k in layers.items() if present.get(p) != k}
    if wrong:
        p, (want, got) = next(iter(wrong.items()))
        raise ModelMismatchError(f"{path}: the model given has {got or 'no compressible layer'} at {p!r}, the file a "
                         f"{want}: build the same architecture (same config) to load it onto")
    state = data["state"]
    if not isinstance(state, dict):
        raise ModelFileError(f"{path}: the swap section's state must be a dict")
    tensors = {name: dec.decode(v, f"{path}: state {name}") for name, v in state.items()}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ModelFileError(f"{path}: the swap section's state holds something other than tensors")
    program.swap_layers = dict(layers)
    swap_into(model, program)
    missing, unexpected = _load_rest(model, tensors, layers, path)
    if unexpected or missing:
        raise ModelMismatchError(f"{path}: the model given does not match the file's state (missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}): build the same "
                         "architecture (same config) to load it onto")
    _share(program, model)
    model.__class__ = subclass_of(type(model))
    model.__dict__["_tncompile_program"] = program
    lower_into(model, program)
    program.listeners.append(Resync(model))
    return model


def _load_rest(model: nn.Module, tensors: dict[str, torch.Tensor], layers: dict[str, str], path):
    owned = _tncompile_owned(model, layers)
    try:
        result = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a shape mismatch
        raise ModelMismatchError(f"{path}: the model given does not fit the file's state ({e})") from e
    missing = [k for k in result.missing_keys if k not in owned]
    return missing, list(result.unexpected_keys)


def _share(program: Program, model: nn.Module) -> None:
    """Let the program's graph hold ``model``'s own modules and tensors wherever the paths
    agree, so that training the model trains what the program counts and cuts."""
    gm = program.graph_module
    for name, mod in list(gm.named_modules()):
        if not name or name in program.swap_layers:
            continue
        theirs = module_at(model, name)
        if theirs is not None and type(theirs) is type(mod) and theirs is not mod:
            gm.set_submodule(name, theirs)
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers(remove_duplicate=False)))
    for owner_path, owner in list(gm.named_modules()):
        prefix = f"{owner_path}." if owner_path else ""
        for table in (owner._parameters, owner._buffers):
            for leaf, t in list(table.items()):
                mine = own.get(prefix + leaf)
                if mine is not None and mine is not t and mine.shape == t.shape:
                    table[leaf] = mine
