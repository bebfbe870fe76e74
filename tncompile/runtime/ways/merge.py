"""How a model's TT linears merge their factors: alone, in batches of their layout's peers
(thin factors or whole matrices), or on the Triton merge -- and when batching applies.

:class:`~tncompile.runtime.layers.factor_groups.FactorPeers` holds which layers batch;
the context it runs in (tracing, export, activation checkpointing, the tuned switches,
the grad mode and autocast state its factors were made under) is read here.
"""
from __future__ import annotations

import enum

import torch

from ... import tuning
from ..kernels.executor import autocast_state
from ..kernels.tracing import exporting
from . import backends
from .network import recorded_elsewhere

__all__ = ["MergeWay", "batches_apply", "triton_merges", "pad_limit", "made_under", "recorded_elsewhere",
           "merge_on_triton"]


class MergeWay(str, enum.Enum):
    """One way a layer's merged factors are made (its ``value`` is what the report prints)."""

    ALONE = "alone"                  # the layer's own chain of small products
    BATCHED = "batched"              # with its layout's peers: stacked, batched products
    TRITON = "triton merge"          # every batch of the model in one Triton launch each way


def batches_apply() -> bool:
    """Whether layers merge with their peers now: ``tuning.GROUP_FACTORS``, eager (each
    layer traces its own merge under ``torch.compile`` and ``torch.export``), and not
    inside activation checkpointing."""
    return tuning.GROUP_FACTORS and not torch.compiler.is_compiling() and not exporting() \
        and not recorded_elsewhere()


def triton_merges(batch, like: torch.Tensor) -> bool:
    """Whether ``batch`` merges on the Triton kernels (``tuning.TRITON_KERNELS``)."""
    supports = backends.active(like, "merge_supports")
    return supports is not None and supports(batch)


def pad_limit(dtypes: set) -> float:
    """How much zero padding a batch may add (elements stacked per element of its members'
    cores): ``tuning.FACTOR_PAD_LIMIT``; 1 (equal ranks only) for networks of mixed dtypes."""
    return tuning.FACTOR_PAD_LIMIT if len(dtypes) == 1 else 1.0


def grouping_settings() -> tuple:
    """The settings a model's grouping depends on (regrouped when they change)."""
    return (tuning.FACTOR_PAD_LIMIT,)


def made_under(device_type: str) -> tuple:
    """The grad mode and autocast state factors are made under: factors made under others
    are never used."""
    return torch.is_grad_enabled(), autocast_state(device_type)


def way_of(batch, like: torch.Tensor | None) -> MergeWay:
    """The way a layer in ``batch`` (``None``: none) merges its factors on tensors like ``like``."""
    if batch is None or not batches_apply():
        return MergeWay.ALONE
    return MergeWay.TRITON if like is not None and triton_merges(batch, like) else MergeWay.BATCHED


def merge_on_triton(batches: tuple, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The factors of ``batches`` (each its members' ``A`` then ``B``) from one Triton merge
    of their ``tensors`` (each batch's members' cores and gates, in order)."""
    return backends.active(tensors[0], "merge")(batches, tensors)
