"""Cutting switched-off ranks out of TT / TTM layers and out of the optimizer's state.

Rank adaptation switches ranks off by driving their gate entries to zero. The
reference CoMERA code then *masks* them, so the model stays as slow as before.
Here the ranks are removed for real: the ``truncate_ranks`` pass slices every
core touching the bond and the gate vector, and records the new ranks in the
layer's layout (:mod:`tncompile.passes.truncate_ranks`); ``replan`` plans the
layer again. This module slices the optimizer's per-parameter state to match.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..passes.truncate_ranks import Cut, cut_ranks

__all__ = ["Cut", "cut_ranks", "remap_optimizer", "check_optimizer", "ELEMENTWISE_OPTIMIZERS"]

# the cut itself is a model edit, so it is a pass (``truncate_ranks``); re-exported here
# beside the optimizer remapping that follows it

# Optimizers whose per-parameter state tensors all have the parameter's shape
# (plus scalar step counters), so slicing them is exact.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
     "Rprop", "ASGD") if hasattr(torch.optim, name))

OPTIMIZER_STATE_MODES = ("slice", "reset")


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside what a training library wraps it in (accelerate's
    ``AcceleratedOptimizer``, any depth: its ``.optimizer``), whose state a cut slices."""
    while (optimizer is not None and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS)
           and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)):
        optimizer = optimizer.optimizer
    return optimizer


def check_optimizer(optimizer: torch.optim.Optimizer | None, mode: str) -> None:
    """Raise ``TypeError`` if ``optimizer``'s state cannot be sliced under ``mode``."""
    if mode not in OPTIMIZER_STATE_MODES:
        raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATE_MODES}, got {mode!r}")
    if optimizer is None or mode == "reset":
        return
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(
            f"RankController cannot slice the state of {type(optimizer).__name__}: rank truncation "
            f"needs per-element optimizer state ({names}). Use one of those, or pass "
            f"optimizer_state='reset' to drop the state of truncated parameters.")


def remap_optimizer(optimizer: torch.optim.Optimizer | None, cuts: Sequence[Cut], mode: str = "slice") -> None:
    """Point ``optimizer`` at the new parameters and slice (or reset) their state
    (LBFGS: its flat curvature history over all parameters is dropped).

    A cut whose ``new`` is ``None`` removes the parameter from its group.
    """
    if optimizer is None or not cuts:
        return
    by_old = {id(c.old): c for c in cuts}
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            cut = by_old.get(id(p))
            if cut is None:
                params.append(p)
            elif cut.new is not None:
                params.append(cut.new)
        # in place: optimizers that keep their own reference to the list (LBFGS's
        # ``_params``) must see the new parameters too, or they stop training them
        group["params"][:] = params
    if isinstance(optimizer, torch.optim.LBFGS):
        # its state is one flat history over all parameters: no longer the right length
        optimizer.state.clear()
        optimizer._numel_cache = None  # its cached total size of the parameters
        return
    for cut in cuts:
        state = optimizer.state.pop(cut.old, None)
        if not state or cut.new is None or mode == "reset":
            continue
        new_state = {}
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == cut.old.shape and value.dim() > 0:
                new_state[name] = cut.apply(value)
            elif isinstance(value, torch.Tensor) and value.numel() > 1:
                raise TypeError(f"cannot slice optimizer state {name!r} of shape {tuple(value.shape)} "
                                f"for a parameter of shape {tuple(cut.old.shape)}; use "
                                "optimizer_state='reset'")
            else:
                new_state[name] = value
        optimizer.state[cut.new] = new_state
