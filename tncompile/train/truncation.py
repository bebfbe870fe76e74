"""Cutting switched-off ranks out of TT / TTM layers and out of the optimizer's state.

Rank adaptation switches ranks off by driving their gate entries to zero. The
reference CoMERA code then *masks* them, so the model stays as slow as before.
Here the ranks are removed for real: every core touching the bond is sliced,
the gate vector shrinks, the layer's layout records the new ranks, and the
optimizer's per-parameter state is sliced to match. The layer's plans are then
stale; the ``replan`` pass (run by :class:`~tncompile.train.RankController`
through the pipeline) plans them again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..runtime.tt_layers import TNModule

__all__ = ["Cut", "cut_ranks", "remap_optimizer", "check_optimizer", "ELEMENTWISE_OPTIMIZERS"]

# Optimizers whose per-parameter state tensors all have the parameter's shape
# (plus scalar step counters), so slicing them is exact.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
     "Rprop", "ASGD") if hasattr(torch.optim, name))

OPTIMIZER_STATE_MODES = ("slice", "reset")


@dataclass
class Cut:
    """One parameter replaced by a slice of itself.

    Attributes
    ----------
    old, new : nn.Parameter
        The parameter before and after; ``new`` is ``None`` when the
        parameter was dropped (its layer collapsed).
    index : dict of int -> LongTensor
        Kept positions along each sliced dimension of ``old``.
    """

    old: nn.Parameter
    new: nn.Parameter | None
    index: dict[int, torch.Tensor]

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """Slice ``t`` (shaped like ``old``) the way ``old`` was sliced."""
        for dim, idx in self.index.items():
            t = t.index_select(dim, idx.to(t.device))
        return t.contiguous()


def cut_ranks(module: TNModule, keep: Sequence[torch.Tensor]) -> list[Cut]:
    """Keep only ranks ``keep[k]`` (sorted index tensors) of every internal bond ``k``.

    The cores and gates are replaced by new ``nn.Parameter`` objects holding
    the kept slices and the layout's ranks are updated. The cached plans are
    left stale: run the ``replan`` pass (or ``tncompile.passes.replan_module``)
    before the next forward.

    Returns the :class:`Cut` of every replaced parameter (unchanged ones are
    left alone and not listed).
    """
    layout = module.layout
    if len(keep) != len(layout.ranks):
        raise ValueError(f"expected {len(layout.ranks)} index sets, got {len(keep)}")
    keep = [k.to(torch.long).cpu() for k in keep]
    for k, (idx, r) in enumerate(zip(keep, layout.ranks)):
        if idx.numel() == 0:
            raise ValueError(f"bond {k} would keep no rank; a layer must keep rank >= 1 "
                             "(collapse it instead)")
        if int(idx.max()) >= r or int(idx.min()) < 0:
            raise ValueError(f"bond {k} index out of range for rank {r}")
    changed = [idx.numel() != r for idx, r in zip(keep, layout.ranks)]
    if not any(changed):
        return []
    cuts: list[Cut] = []
    cores = list(module.cores._parameters.items())
    last = len(cores) - 1
    for k, (key, core) in enumerate(cores):
        index: dict[int, torch.Tensor] = {}
        if k > 0 and changed[k - 1]:
            index[0] = keep[k - 1]
        if k < last and changed[k]:
            index[core.dim() - 1] = keep[k]
        if index:
            cut = _replace(module.cores, key, core, index)
            cuts.append(cut)
    for k, (key, gate) in enumerate(list(module.gates._parameters.items())):
        if changed[k]:
            cuts.append(_replace(module.gates, key, gate, {0: keep[k]}))
    module.layout = dataclasses.replace(layout, ranks=tuple(int(i.numel()) for i in keep))
    return cuts


def _replace(plist: nn.ParameterList, key: str, old: nn.Parameter, index: dict[int, torch.Tensor]) -> Cut:
    cut = Cut(old, None, index)
    with torch.no_grad():
        new = nn.Parameter(cut.apply(old.detach()), requires_grad=old.requires_grad)
    plist._parameters[key] = new
    cut.new = new
    return cut


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
    """Point ``optimizer`` at the new parameters and slice (or reset) their state.

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
        group["params"] = params
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
