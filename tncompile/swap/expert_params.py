"""Swap mode for mixture-of-experts weights: fused 3-D parameters replaced in place.

Transformers 5.x keeps an MoE block's experts as 3-D parameters of one module
(Mixtral's ``experts.gate_up_proj`` ``(experts, 2*intermediate, hidden)`` and
``experts.down_proj``), read by that module's own ``forward`` -- a loop over
experts indexing ``self.gate_up_proj[e]``, or one grouped GEMM over the whole
tensor, depending on the experts implementation chosen. A layer cannot stand in
for a parameter, so swap mode changes the *owner*: its class becomes a subclass
(same name, module and qualified name) whose swapped names are properties that
return the dense tensor rebuilt from the :class:`~tncompile.runtime.layers.experts.TTExperts`
network stored under the same name, in the parameter's own orientation and
differentiably. The owner's ``forward`` runs unchanged, whichever implementation it
dispatches to; the parameters that remain are the networks' cores and gates.

Rebuilding costs one batched contraction per call (what graph mode does on a GPU
and under ``torch.compile``); the memory for the dense experts is transient.
"""
from __future__ import annotations

from torch import nn

from ..ir.modules import module_at
from ..runtime.layers.experts import ExpertLinear, TTExperts

__all__ = ["expert_weights", "put_experts", "restore_dense_experts"]

_OWNERS: dict[tuple[type, frozenset], type] = {}


def _split(path: str) -> tuple[str, str]:
    owner, _, leaf = path.rpartition(".")
    return owner, leaf


def expert_weights(gm: nn.Module, model: nn.Module) -> dict[str, str]:
    """``path -> "experts"`` for each fused experts parameter the trace outlined (an
    :class:`ExpertLinear` in ``gm``) that is a 3-D parameter of ``model``'s own tree."""
    found = {}
    for name, mod in gm.named_modules():
        if not name or not isinstance(mod, ExpertLinear):
            continue
        owner_path, leaf = _split(name)
        owner = module_at(model, owner_path)
        param = owner._parameters.get(leaf) if owner is not None else None
        if param is not None and param.dim() == 3:
            found[name] = "experts"
    return found


def _owner_class(base: type, leaves: frozenset) -> type:
    """``base`` with a property per name in ``leaves``: the network's dense tensor, or the
    parameter when the name holds one again (a network collapsed back to dense)."""
    cls = _OWNERS.get((base, leaves))
    if cls is None:
        def rebuilt(leaf):
            def get(self):
                network = self._modules.get(leaf)
                return network.stored_weight() if network is not None else self._parameters[leaf]
            return property(get, doc=f"{leaf}: rebuilt from its TT network (tncompile swap mode)")

        namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__,
                     "_tncompile_base": base, "_tncompile_leaves": leaves,
                     "__reduce_ex__": lambda self, protocol: (_rebuild_owner, (base, leaves), self.__dict__)}
        namespace.update({leaf: rebuilt(leaf) for leaf in leaves})
        cls = _OWNERS[(base, leaves)] = type(base.__name__, (base,), namespace)
    return cls


def _rebuild_owner(base: type, leaves: frozenset) -> nn.Module:
    cls = _owner_class(base, leaves)
    return cls.__new__(cls)


def put_experts(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` (the program's layer at ``path``) in place of the experts parameter:
    a :class:`TTExperts` network behind a property of the owner, or, for a dense
    :class:`ExpertLinear`, its weight back as the owner's parameter."""
    owner_path, leaf = _split(path)
    owner = module_at(model, owner_path)
    base = getattr(type(owner), "_tncompile_base", type(owner))
    leaves = getattr(type(owner), "_tncompile_leaves", frozenset())
    if isinstance(module, TTExperts):
        owner._parameters.pop(leaf, None)
        owner.__class__ = _owner_class(base, leaves | {leaf})
        owner._modules[leaf] = module
    elif isinstance(module, ExpertLinear):
        owner._modules.pop(leaf, None)
        owner._parameters[leaf] = module.weight
    else:
        raise TypeError(f"experts at {path!r}: expected TTExperts or ExpertLinear, got {type(module).__name__}")


def restore_dense_experts(model: nn.Module, paths: list[str]) -> None:
    """Each swapped experts parameter of ``model`` (a copy) back as a dense ``nn.Parameter`` in
    its own orientation, and each owner back to its own class (``to_dense``)."""
    for path in paths:
        owner_path, leaf = _split(path)
        owner = module_at(model, owner_path)
        network = owner._modules.pop(leaf, None)
        if isinstance(network, TTExperts):
            owner._parameters[leaf] = nn.Parameter(network.stored_weight().detach().clone())
        base = getattr(type(owner), "_tncompile_base", None)
        if base is not None:
            owner.__class__ = base
