"""What kind of module a module is: the dense layers a TT/TTM layer can be
built from (and their weights), modules that run a class's own forward, and
models whose parameters are FSDP2 shards."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["is_hf_conv1d", "linear_weight_of", "runs_as", "replaces_forward", "linear_on", "embedding_on",
           "runs_hooks", "is_shard", "is_sharded"]


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


def linear_on(weight: nn.Parameter, bias: nn.Parameter | None, training: bool = True) -> nn.Linear:
    """A plain ``nn.Linear`` holding these very ``Parameter`` objects (not copies:
    ties, and the optimizer the user built, still see them)."""
    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias=bias is not None, device="meta")
    lin.weight, lin.bias = weight, bias
    return lin.train(training)


def embedding_on(weight: nn.Parameter, padding_idx: int | None = None, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False,
                 training: bool = True) -> nn.Embedding:
    """A plain ``nn.Embedding`` holding this very ``Parameter`` (see :func:`linear_on`)."""
    emb = nn.Embedding(*weight.shape, padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
                       scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, device="meta")
    emb.weight = weight
    return emb.train(training)


def replaces_forward(module: nn.Module, bases: tuple[type, ...] = (nn.Linear, nn.Embedding, nn.EmbeddingBag)) -> bool:
    """A subclass of one of ``bases`` with a forward of its own (BART's learned positions
    add an offset to the ids, Gemma's embedding scales its rows)."""
    return any(isinstance(module, base) and not runs_as(module, base) for base in bases)


def runs_as(module: nn.Module, cls: type) -> bool:
    """``module`` is a ``cls`` whose forward is ``cls``'s own: an instance or a
    wrapper subclass that keeps the forward (FSDP's), not a subclass that
    replaces it (whose behaviour tncompile cannot know)."""
    return isinstance(module, cls) and type(module).forward is cls.forward


def runs_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs forward hooks (its own or global ones): a fused
    call that skips the module's own ``__call__`` would skip them."""
    from torch.nn.modules import module as module_mod

    return bool(module._forward_hooks or module._forward_pre_hooks or module_mod._global_forward_hooks
                or module_mod._global_forward_pre_hooks)


def is_shard(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 shard); a plain tensor is told apart by its type alone."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is FSDP2-sharded: any parameter a shard (a ``DTensor``), or any
    module an ``FSDPModule`` -- inside its forward FSDP2 has swapped the gathered plain
    tensors in, so the parameters alone would say no there."""
    if any(is_shard(p) for p in model.parameters()):
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
