"""Small helpers on module trees, shared by the IR, its printers, the frontend and the passes."""
from __future__ import annotations

import torch
from torch import fx, nn

__all__ = ["count_params", "module_at", "rehome_reads"]


def count_params(module: nn.Module) -> int:
    """Number of distinct parameter elements (tied parameters counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def module_at(root: nn.Module, target: str) -> nn.Module | None:
    """The submodule at dotted path ``target``, or ``None`` when the path is
    missing or names a parameter, buffer or other attribute. Walks ``_modules``
    (not attributes: a swap-mode experts owner shadows its network's name with a
    property returning the rebuilt tensor, :mod:`tncompile.swap.expert_params`)."""
    mod = root
    for part in target.split(".") if target else ():
        mod = mod._modules.get(part) if isinstance(mod, nn.Module) else None
        if mod is None:
            return None
    return mod


def rehome_reads(gm: fx.GraphModule, path: str, keep: tuple[str, ...] = ("weight", "bias")) -> None:
    """Move the tensors the graph reads of the module at ``path`` (a scale
    buffer, ...) other than ``keep`` to the graph module's root, so that the
    module can be replaced by a layer that does not hold them."""
    for node in gm.graph.nodes:
        owner, _, leaf = str(node.target).rpartition(".")
        if node.op != "get_attr" or owner != path or leaf in keep:
            continue
        holder = gm.get_submodule(path)
        value = getattr(holder, leaf)
        name = f"{path}.{leaf}".replace(".", "_")
        while hasattr(gm, name):
            name += "_"
        if isinstance(value, nn.Parameter):
            gm.register_parameter(name, value)
        elif isinstance(value, torch.Tensor):
            gm.register_buffer(name, value, persistent=leaf not in holder._non_persistent_buffers_set)
        else:
            setattr(gm, name, value)
        node.target = name
