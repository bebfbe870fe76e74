"""How a TT linear runs a call: its ways, as data, and the one function that chooses.

A :class:`~tncompile.runtime.layers.tt_layers.TTLinear` computes ``x W^T + b`` one of
:class:`LinearWay`'s ways, all equal in value; which one depends on the context (export,
autograd, ``torch.compile``, the device, the tuned switches) and on the rows of the call.
:func:`choose` is the decision, readable without running the layer: the report's "ran as"
column, tests and users ask it; the layer runs what it says and records what it ran
(``layer.ran_as``, the last eager call's way).
"""
from __future__ import annotations

import enum

import torch

from ... import tuning
from ..kernels.tracing import exporting
from ..kernels.tt_chain import chain_kernels
from ..triton import runs_triton

__all__ = ["LinearWay", "choose", "choose_call", "choose_rows", "decide_call", "decide_rows", "record", "choice_cache"]


class LinearWay(str, enum.Enum):
    """One way a TT linear runs a call (its ``value`` is what the report prints)."""

    EXPORTED = "exported"                     # torch.export / ONNX: x A B + b, factors merged in the graph
    INFERENCE_FACTORS = "inference factors"   # no autograd: through the kept merged factors
    TRITON_PAIR = "triton pair"               # tncompile's Triton thin pair (tuning.TRITON_KERNELS)
    NATIVE_CHAIN = "native chain"             # a few rows: one native call through every core
    WHOLE_MATRIX = "whole matrix"             # merged with its layout's peers into W: one GEMM each way
    THIN_PAIR = "thin pair"                   # merged with its peers into A, B: two thin GEMMs
    PLANNED = "planned contraction"           # the planned pairwise order over the cores


def choose(layer, x: torch.Tensor) -> LinearWay:
    """The way ``layer`` runs on ``x (..., in_features)`` in the current context."""
    return choose_call(layer, x) or choose_rows(layer, x, x.numel() // max(layer.layout.in_features, 1))


def choose_call(layer, x: torch.Tensor) -> LinearWay | None:
    """The way of the whole call where one applies before the rows are contracted (export,
    an inference merge), else ``None``: the layer contracts the rows (:func:`choose_rows`)."""
    return decide_call(layer, x)[0]


def choose_rows(layer, like: torch.Tensor, rows: int, settle_merged: bool = True) -> LinearWay:
    """The way ``layer`` contracts ``rows`` rows of tensors like ``like`` (its dtype, device)
    through its network, once neither export nor an inference merge applies. A layer merged
    with its layout's peers runs as the batch was made (a whole matrix or a thin pair:
    estimated here when ``settle_merged``; the running layer leaves it to the batch)."""
    return decide_rows(layer, like, rows, settle_merged)[0]


def decide_call(layer, x: torch.Tensor):
    """:func:`choose_call`'s way, with what running it takes: the inference factors."""
    if exporting():
        return LinearWay.EXPORTED, None
    lay = layer.layout
    rows = x.numel() // max(lay.in_features, 1)
    if layer.merge_in_inference and not torch.is_grad_enabled() and not torch.compiler.is_compiling() \
            and x.shape[-1:] == (lay.in_features,) and rows:
        factors = layer.inference_factors()
        if layer._through_factors_at(rows, factors):
            return LinearWay.INFERENCE_FACTORS, factors
    return None, None


def decide_rows(layer, like: torch.Tensor, rows: int, settle_merged: bool = True):
    """:func:`choose_rows`'s way, with what running it takes: the native chain's ops."""
    if tuning.TRITON_KERNELS and runs_triton(like):
        return LinearWay.TRITON_PAIR, None
    ops = chain_kernels(like, layer.layout, layer.plan_for, rows, choice_cache(layer, "_chain_choice"))
    if ops is not None:
        return LinearWay.NATIVE_CHAIN, ops
    plan = layer.plan_for(rows)
    if layer.__dict__.get("_factor_peers") is not None and layer._runs_as_pair(plan):
        whole = settle_merged and layer._runs_whole(plan, like.device)
        return (LinearWay.WHOLE_MATRIX if whole else LinearWay.THIN_PAIR), None
    return LinearWay.PLANNED, None


def choice_cache(module: torch.nn.Module, name: str) -> dict:
    """``module``'s dict of cached kernel choices named ``name`` (made on first use). Read
    with ``getattr`` and stored as an attribute: torch 2.11's Dynamo cannot trace
    ``module.__dict__.setdefault``, and these lookups run inside ``torch.compile``."""
    cache = getattr(module, name, None)
    if cache is None:
        cache = {}
        setattr(module, name, cache)
    return cache


def record(layer, way: enum.Enum) -> None:
    """Note on ``layer`` the way its call ran (eager calls only: a traced graph is code
    run later, and an attribute write there is a side effect the tracer would replay)."""
    if not torch.compiler.is_compiling():
        layer.__dict__["ran_as"] = way
