"""Small helpers on module trees, shared by the IR and its printers."""
from __future__ import annotations

from torch import nn

__all__ = ["count_params", "module_at"]


def count_params(module: nn.Module) -> int:
    """Number of distinct parameter elements (tied parameters counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def module_at(root: nn.Module, target: str) -> nn.Module | None:
    """The submodule at dotted path ``target``, or ``None`` when the path is
    missing or names a parameter, buffer or other attribute."""
    try:
        mod = root.get_submodule(target)
    except AttributeError:
        return None
    return mod if isinstance(mod, nn.Module) else None
