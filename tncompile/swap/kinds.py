"""How each kind of swapped layer is put into the user's model and taken back out: an
ordered list, first match wins, each kind with its test, ``put`` and ``restore`` (PEFT's
dispatcher list and ``_unload_and_optionally_merge``).

:func:`attach` puts a compiled program's layers into the model (and keeps them there after
every later pipeline run); :func:`restore_all` is ``to_dense``'s one loop over a copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..ir.program import Program, module_at
from ..runtime.layers import TNModule, TTMTiedLinear
from ..runtime.layers.factor_links import link_factor_groups
from ..runtime.layers.module_kinds import replaces_forward
from .expert_params import put_experts, restore_dense_experts
from .subclass import is_stand_in, network_of, put_stand_in, restore_subclass

__all__ = ["SwapKind", "KINDS", "put_all", "restore_all", "kind_for_put", "kind_for_restore", "swapped_paths",
           "SWAPPED_PATHS"]

#: where a swapped model keeps ``path -> kind`` of the layers it swaps (the swap binding's map)
SWAPPED_PATHS = "_tncompile_swap_layers"


def swapped_paths(model: nn.Module) -> dict[str, str]:
    """``path -> kind`` of the compressible layers of a swap-mode ``model``'s own tree, the
    ones its program could compress and put back (see :func:`put_all`)."""
    return model.__dict__[SWAPPED_PATHS]


@dataclass(frozen=True)
class SwapKind:
    """One kind of swapped layer.

    ``puts(kind, current)``: whether this kind puts the program's layer in place of
    ``current`` (the model's module at the path; ``kind``: the path's entry in
    :func:`swapped_paths`). ``put(model, path, current, network)`` puts it.
    ``restores(kind, module)``: whether this kind restores ``module`` (a dense copy's
    module at the path). ``restore(dense, path, kind, module, rebuilt)`` puts the dense
    layer back; ``rebuilt`` maps each network's ``id`` to its dense module (a tied head
    reads its embedding's).
    """

    name: str
    puts: Callable[[str, nn.Module], bool]
    put: Callable[[nn.Module, str, nn.Module, nn.Module], None] | None
    restores: Callable[[str, nn.Module | None], bool]
    restore: Callable[[nn.Module, str, str, nn.Module, dict], None]


def _network(module: nn.Module | None) -> nn.Module | None:
    """The network a swapped path runs: a stand-in's inner network, or the module itself."""
    return network_of(module) if is_stand_in(module) else module


def _tied(module: nn.Module | None) -> bool:
    return isinstance(_network(module), TTMTiedLinear)


def dense_of(layer: TNModule, kind: str) -> nn.Module:
    """``layer`` multiplied back into a dense module of the original ``kind`` (HF ``Conv1D``
    stores ``[in, out]``)."""
    dense = layer.to_dense_module()
    if kind != "conv1d":
        return dense
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415 - only a GPT-2-style model gets here
    conv = Conv1D(dense.out_features, dense.in_features).to(device=dense.weight.device, dtype=dense.weight.dtype)
    with torch.no_grad():
        conv.weight.copy_(dense.weight.t())
        if dense.bias is not None:
            conv.bias.copy_(dense.bias)
    return conv


def _restore_experts(dense: nn.Module, path: str, kind: str, module: nn.Module, rebuilt: dict) -> None:
    restore_dense_experts(dense, [path])


def _restore_stand_in(dense: nn.Module, path: str, kind: str, module: nn.Module, rebuilt: dict) -> None:
    network = network_of(module)
    layer = dense_of(network, kind)
    rebuilt[id(network)] = restore_subclass(module, layer.weight, getattr(layer, "bias", None))


def _restore_plain(dense: nn.Module, path: str, kind: str, module: nn.Module, rebuilt: dict) -> None:
    if id(module) not in rebuilt:
        rebuilt[id(module)] = dense_of(module, kind)
    dense.set_submodule(path, rebuilt[id(module)])


def _restore_tied(dense: nn.Module, path: str, kind: str, module: nn.Module, rebuilt: dict) -> None:
    head = _network(module)
    dense_head = head.to_dense_head(rebuilt.get(id(head.embedding)))
    if head is module:
        dense.set_submodule(path, dense_head)
    else:  # a head subclass with its own forward, tied to the embedding
        restore_subclass(module, dense_head.weight, dense_head.bias)


#: first match wins; restored in this order (a tied head after the embedding it reads)
KINDS: list[SwapKind] = [
    SwapKind("experts", lambda kind, current: kind == "experts",
             lambda model, path, current, network: put_experts(model, path, network),
             lambda kind, module: kind == "experts", _restore_experts),
    SwapKind("layer subclass", lambda kind, current: is_stand_in(current) or replaces_forward(current),
             lambda model, path, current, network: put_stand_in(model, path, current, network),
             lambda kind, module: network_of(module) is not None and not _tied(module), _restore_stand_in),
    SwapKind("layer", lambda kind, current: True, lambda model, path, current, network: model.set_submodule(path, network),
             lambda kind, module: isinstance(module, TNModule) and not _tied(module), _restore_plain),
    SwapKind("tied head", lambda kind, current: False, None, lambda kind, module: _tied(module), _restore_tied),
]


def kind_for_put(kind: str, current: nn.Module) -> SwapKind:
    """The first kind that puts a layer in place of ``current``."""
    return next(k for k in KINDS if k.put is not None and k.puts(kind, current))


def kind_for_restore(kind: str, module: nn.Module | None) -> SwapKind | None:
    """The first kind that restores ``module``, or ``None`` (nothing swapped there: a layer
    left dense, a collapsed one)."""
    return next((k for k in KINDS if k.restores(kind, module)), None)


def put_all(model: nn.Module, program: Program) -> None:
    """Set every swapped path of ``model`` to the program's module at that path, each by its
    kind; then link the layers that merge their factors together."""
    for path, kind in swapped_paths(model).items():
        network = module_at(program.graph_module, path)
        current = module_at(model, path)
        if network is None or current is network or network_of(current) is network \
                or getattr(current, "base_layer", None) is network:  # an adapter (PEFT LoRA) wraps it
            continue
        kind_for_put(kind, current).put(model, path, current, network)
    model.__dict__["_factor_peers"] = link_factor_groups(model)  # one layout's layers merge factors together


def restore_all(dense: nn.Module, swap_layers: dict[str, str]) -> None:
    """Every swapped path of ``dense`` (a copy) back to a dense layer of its kind, in
    :data:`KINDS`' order: one loop."""
    found = []
    for path, kind in swap_layers.items():
        module = module_at(dense, path) if kind != "experts" else None
        swap_kind = kind_for_restore(kind, module)
        if swap_kind is not None:
            found.append((KINDS.index(swap_kind), path, kind, module, swap_kind))
    rebuilt: dict[int, nn.Module] = {}
    for _, path, kind, module, swap_kind in sorted(found, key=lambda entry: entry[0]):
        swap_kind.restore(dense, path, kind, module, rebuilt)
