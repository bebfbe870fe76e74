"""``truncate_ranks``: cut switched-off ranks out of TT / TTM layers, for real.

Every core touching a cut bond is sliced, the bond's gate vector shrinks, and
the layer's layout records the new ranks; the cores and gates become new
``nn.Parameter`` objects. Each replaced parameter is described by a
:class:`Cut`, so that the caller (the rank controller) can slice the
optimizer's state the same way. The layer's plans are then stale: run
``replan`` after it (the controller runs both through one pipeline).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..ir.program import Program
from ..runtime.layers import TNModule
from .infra.base import Pass, register_pass

__all__ = ["Cut", "cut_ranks", "TruncateRanks", "require_layers"]


def require_layers(program: Program, names, pass_name: str) -> None:
    """For a pass's ``requires``: every name in ``names`` is a TT/TTM layer of ``program``."""
    known = {node.target for node, m in program.modules() if isinstance(m, TNModule)}
    missing = sorted(set(names) - known)
    if missing:
        raise ValueError(f"{pass_name}: no TT/TTM layer named {missing[:3]} in the program")


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
            t = _take(t, dim, idx.to(t.device))
        return t.contiguous()


def _take(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """``t``'s positions ``idx`` along ``dim``: ``idx (k,)`` the same for every
    slice, or ``idx (n, k)`` per slice ``t[i]`` of the leading dim (experts)."""
    if idx.dim() == 1:
        return t.index_select(dim, idx)
    shape = [1] * t.dim()
    shape[0], shape[dim] = idx.shape
    full = list(t.shape)
    full[dim] = idx.shape[1]
    return t.gather(dim, idx.reshape(shape).expand(full))


def cut_ranks(module: TNModule, keep: Sequence[torch.Tensor]) -> list[Cut]:
    """Keep only ranks ``keep[k]`` (sorted index tensors) of every internal bond ``k``.

    For a layer of stacked networks (:class:`~tncompile.runtime.layers.experts.TTExperts`,
    cores ``(experts, r, n, r)``) ``keep[k]`` may be ``(experts, k)``: each
    expert's own kept positions, in the order they are to be stored (a
    permutation of one expert's bond leaves its matrix unchanged).

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
    stacked = getattr(module, "stacked", 0)  # leading dims of stacked networks (experts)
    for k, (idx, r) in enumerate(zip(keep, layout.ranks)):
        if idx.dim() not in (1, 1 + stacked) or (idx.dim() == 2 and idx.shape[0] != layout.copies):
            raise ValueError(f"bond {k}: expected kept indices of shape (k,)"
                             f"{f' or ({layout.copies}, k)' if stacked else ''}, got {tuple(idx.shape)}")
        if idx.shape[-1] == 0:
            raise ValueError(f"bond {k} would keep no rank; a layer must keep rank >= 1 "
                             "(collapse it instead)")
        if int(idx.max()) >= r or int(idx.min()) < 0:
            raise ValueError(f"bond {k} index out of range for rank {r}")
    changed = [idx.shape[-1] != r for idx, r in zip(keep, layout.ranks)]
    if not any(changed):
        return []
    cuts: list[Cut] = []
    cores = list(module.cores._parameters.items())
    last = len(cores) - 1
    for k, (key, core) in enumerate(cores):
        index: dict[int, torch.Tensor] = {}
        if k > 0 and changed[k - 1]:
            index[stacked] = keep[k - 1]
        if k < last and changed[k]:
            index[core.dim() - 1] = keep[k]
        if index:
            cut = _replace(module.cores, key, core, index)
            cuts.append(cut)
    for k, (key, gate) in enumerate(list(module.gates._parameters.items())):
        if changed[k]:
            cuts.append(_replace(module.gates, key, gate, {stacked: keep[k]}))
    module.layout = dataclasses.replace(layout, ranks=tuple(int(i.shape[-1]) for i in keep))
    return cuts


def _replace(plist: nn.ParameterList, key: str, old: nn.Parameter, index: dict[int, torch.Tensor]) -> Cut:
    cut = Cut(old, None, index)
    with torch.no_grad():
        new = nn.Parameter(cut.apply(old.detach()), requires_grad=old.requires_grad)
    plist._parameters[key] = new
    cut.new = new
    return cut


@register_pass
class TruncateRanks(Pass):
    """Keep only the given ranks of each named layer's bonds.

    Parameters
    ----------
    keep : dict
        ``layer name -> [kept rank indices of bond 1, bond 2, ...]`` (sorted
        ``LongTensor``\\ s; the name as in ``compiled.tensorized_modules()``).

    After it runs, :attr:`cuts` lists every replaced parameter and
    :attr:`truncated` maps each changed layer to ``(old ranks, new ranks)``.
    """

    name = "truncate_ranks"

    def __init__(self, keep: dict[str, Sequence[torch.Tensor]] | None = None):
        self.keep = dict(keep or {})
        self.cuts: list[Cut] = []
        self.truncated: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def requires(self, program: Program) -> None:
        require_layers(program, self.keep, self.name)

    def run(self, program: Program) -> Program:
        self.cuts, self.truncated = [], {}
        modules = {node.target: m for node, m in program.modules()}
        for name, keep in self.keep.items():
            module = modules[name]
            old = tuple(module.layout.ranks)
            cuts = cut_ranks(module, keep)
            if cuts:
                self.cuts += cuts
                self.truncated[name] = (old, tuple(module.layout.ranks))
                self.matches["layer-truncated"] += 1
        return program
