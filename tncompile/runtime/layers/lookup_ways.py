"""How a TTM embedding looks up a call's ids: its ways, as data, and the one function that chooses.

A :class:`~tncompile.runtime.layers.tt_layers.TTMEmbedding` returns the rows of its table
one of :class:`LookupWay`'s ways, all equal in value. :func:`choose` is the decision for
ids in the current context; the layer runs what it says and records it (``layer.ran_as``,
the last eager call's way), and the report prints it beside the TT linears' ways
(:mod:`.linear_ways`).
"""
from __future__ import annotations

import enum

import torch

from ... import tuning
from ..kernels.tracing import exporting
from ..triton import runs_triton
from ..triton.merge_factors import supports

__all__ = ["LookupWay", "choose", "choose_split", "choose_split_at"]


class LookupWay(str, enum.Enum):
    """One way a TTM embedding looks up ids (its ``value`` is what the report prints)."""

    EXPORTED = "exported"                  # torch.export / ONNX: half tables merged in the graph, gathers + bmm
    TRACED = "traced lookup"               # under torch.compile: the lookup as traceable ops
    TRITON_LOOKUP = "triton lookup"        # tncompile's Triton gather from the two half tables
    ONE_TABLE = "one table"                # a single core: the table itself, indexed
    GATHERED_PRODUCT = "gathered product"  # the two half tables, rows gathered and multiplied per id


def choose(layer, ids: torch.Tensor) -> LookupWay:
    """The way ``layer`` looks up ``ids`` in the current context (reads the distinct ids:
    a host sync, as the lookup itself)."""
    if exporting():
        return LookupWay.EXPORTED
    if torch.compiler.is_compiling() and len(layer.layout.row_modes) > 1:
        return LookupWay.TRACED
    rows = int(torch.unique(ids.reshape(-1)).numel())
    return choose_split(layer, choose_split_at(layer, rows))


def choose_split_at(layer, rows: int) -> int:
    """Where the network is split into two half tables for ``rows`` distinct ids (its
    plan's split; 0: a single core)."""
    return layer.plan_for(rows).split if len(layer.layout.row_modes) > 1 else 0


def choose_split(layer, split: int) -> LookupWay:
    """The way of an eager lookup split at ``split`` (:func:`choose_split_at`)."""
    if tuning.TRITON_KERNELS and split and runs_triton(layer.cores[0]) \
            and supports(split, len(layer.layout.row_modes)):
        return LookupWay.TRITON_LOOKUP
    return LookupWay.ONE_TABLE if len(layer.layout.row_modes) == 1 else LookupWay.GATHERED_PRODUCT
