"""What kind of module a module is: the dense layers a TT/TTM layer can be
built from (and their weights), and modules that run a class's own forward."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["is_hf_conv1d", "linear_weight_of", "runs_as"]


def is_hf_conv1d(module: nn.Module) -> bool:
    """HuggingFace's ``Conv1D`` (GPT-2): a linear layer with weight ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def linear_weight_of(module: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` weight of an ``nn.Linear`` or a HuggingFace ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return module.weight
    if is_hf_conv1d(module):
        return module.weight.t()  # HF Conv1D stores [in, out]
    raise TypeError(f"{type(module).__name__} is not a linear layer")


def runs_as(module: nn.Module, cls: type) -> bool:
    """``module`` is a ``cls`` whose forward is ``cls``'s own: an instance or a
    wrapper subclass that keeps the forward (FSDP's), not a subclass that
    replaces it (whose behaviour tncompile cannot know)."""
    return isinstance(module, cls) and type(module).forward is cls.forward
