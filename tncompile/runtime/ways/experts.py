"""How a layer of TT experts runs rows sorted by expert: its ways and the choice.

On CPU in eager code each expert's block of rows goes through its own network (planned
per row count); elsewhere (a GPU, ``torch.compile``) every expert's dense matrix is
merged and one grouped product runs over all blocks.
"""
from __future__ import annotations

import enum

import torch
from torch import Tensor

from ..kernels.executor import contract
from ..kernels.grouped import group_bounds, grouped_mm
from .linear import record
from .rows import as_rows, check_input_dtype, drop_boundary, shaped_output

__all__ = ["ExpertsWay", "choose", "run"]


class ExpertsWay(str, enum.Enum):
    """One way a layer of TT experts runs a call (its ``value`` is what the report prints)."""

    GROUPED = "grouped product"      # every expert's matrix merged, one grouped GEMM over the blocks
    PER_EXPERT = "per expert"        # each expert's block through its own network


def choose(layer, x: Tensor) -> ExpertsWay:
    """The way ``layer`` runs ``x (rows, in_features)`` in the current context."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return ExpertsWay.GROUPED
    return ExpertsWay.PER_EXPERT


def run(layer, x: Tensor, offs: Tensor) -> Tensor:
    """``layer``'s forward: ``x (rows, in_features)`` sorted by expert, ``offs`` each
    expert's end row -> ``(rows, out_features)``."""
    if x.dim() != 2 or x.shape[-1] != layer.in_features:
        raise ValueError(f"TTExperts expected x of shape (rows, {layer.in_features}), got {tuple(x.shape)}")
    check_input_dtype(layer, x)
    way = choose(layer, x)
    record(layer, way)
    if way is ExpertsWay.GROUPED:
        return grouped_mm(x, layer.weight().transpose(-2, -1), offs)
    return _per_expert(layer, x, offs)


def _per_expert(layer, x: Tensor, offs: Tensor) -> Tensor:
    """Each expert's rows through its own network (planned per row count)."""
    lay = layer.layout
    per_expert = [c.unbind(0) for c in layer.scaled_cores()]
    pieces, done = [], 0
    for e, (start, end) in enumerate(group_bounds(offs)):
        if end <= start:
            continue
        cores = drop_boundary([c[e] for c in per_expert])
        h, _, lead = as_rows(layer, x[start:end], None, lay.in_features, lay.in_modes, lay.out_features,
                             lay.padded_out)
        y = contract(layer.plan_for(h.shape[0]), [h, *cores], None)
        pieces.append(shaped_output(y, lead, lay.out_features, lay.padded_out))
        done = end
    if done < x.shape[0] or not pieces:  # rows past the last expert's block (none in a plain MoE block)
        pieces.append(x.new_zeros(x.shape[0] - done, layer.out_features))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
