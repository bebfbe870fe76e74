"""How a TT linear runs a call: its ways, as data, the one function that chooses, and the runners.

A :class:`~tncompile.runtime.TTLinear` computes ``x W^T + b`` one of :class:`LinearWay`'s
ways, all equal in value; which one depends on the context (export, autograd,
``torch.compile``, the device, the tuned switches), on the rows of the call and, among
the ways that all apply, on what was measured fastest on this device
(:mod:`.measured`). :func:`choose` is the decision, readable without running the layer:
the report's "ran as" column, tests and users ask it. :func:`run` is the layer's forward:
it runs what the decision says and records what it ran (``layer.ran_as``, the last eager
call's way).
"""
from __future__ import annotations

import enum
import math
from typing import Callable

import torch

from ... import tuning
from ...formats.factorization import tt_factors
from ..kernels.executor import autocast_state, contract, is_merge_first, run_dtype, thin_pair, without_autocast
from ..kernels.tracing import exporting
from ..native import native_ops
from ..kernels.plans import bucket_of
from ..kernels.tt_chain import chain_available, chain_kernels, tt_chain
from . import backends, measured
from .rows import ACTIVATIONS, as_rows, check_input_dtype, drop_boundary, factor_macs, shaped_output, through_factors

__all__ = ["LinearWay", "choose", "choose_call", "choose_rows", "decide_call", "decide_rows", "run", "run_activated",
           "run_alone", "own_factors",
           "inference_macs", "record", "choice_cache", "register_whole_rule", "whole_matrices_faster"]


class LinearWay(str, enum.Enum):
    """One way a TT linear runs a call (its ``value`` is what the report prints)."""

    EXPORTED = "exported"                     # torch.export / ONNX: x A B + b, factors merged in the graph
    INFERENCE_FACTORS = "inference factors"   # no autograd: through the kept merged factors
    TRITON_PAIR = "triton pair"               # tncompile's Triton thin pair (tuning.TRITON_KERNELS)
    NATIVE_CHAIN = "native chain"             # a few rows: one native call through every core
    WHOLE_MATRIX = "whole matrix"             # merged with its layout's peers into W: one GEMM each way
    THIN_PAIR = "thin pair"                   # merged with its peers into A, B: two thin GEMMs
    PLANNED = "planned contraction"           # the planned pairwise order over the cores


#: the ways that contract the rows of a differentiable eager call, all equal in value: the
#: measured choice picks among those that apply (:mod:`.measured`)
ROW_WAYS = (LinearWay.NATIVE_CHAIN, LinearWay.THIN_PAIR, LinearWay.WHOLE_MATRIX, LinearWay.PLANNED)
measured.register_ways(w.value for w in ROW_WAYS)


# ---------------------------------------------------------------- the decision
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
            and x.shape[-1:] == (lay.in_features,) and rows:  # as network.keeps_merged_forms, inlined: every call
        factors = layer.inference_factors()
        if through_factors_at(layer, rows, factors):
            return LinearWay.INFERENCE_FACTORS, factors
    return None, None


def decide_rows(layer, like: torch.Tensor, rows: int, settle_merged: bool = True, export_checked: bool = False):
    """:func:`choose_rows`'s way, with what running it takes: the native chain's ops.

    In a differentiable eager call, the fastest of the row ways that apply as measured for
    this layer's shape, bucket of rows, dtype and device (:mod:`.measured`: timed once,
    then kept); where nothing may be measured and nothing is known, the cost model's prior.
    ``export_checked``: the caller (the layer's forward) knows ``torch.export`` is not tracing."""
    if backends.active(like, "thin_pair") is not None:
        return LinearWay.TRITON_PAIR, None
    if rows and measured.applies(like, export_checked):
        cache = layer.__dict__.get("_measured_choice")  # the hot path: no getattr fallback once made
        if cache is None:
            cache = choice_cache(layer, "_measured_choice")
        # a dict lookup per call (hot at one row): the settings a winner depends on, read directly
        local = (rows, layer.layout.ranks, like.dtype, like.device, torch.is_autocast_enabled(like.device.type),
                 measured.GENERATION[0], tuning.CHAIN_ROWS, tuning.WHOLE_MATRICES)
        won = cache.get(local)
        if won is not None:  # a chain winner had the native ops for this dtype, device and autocast
            return won, (native_ops() if won is LinearWay.NATIVE_CHAIN else None)
        won, native = _measured_way(layer, like, rows, local)
        if won is not None:
            cache[local] = won
            return won, (native if won is LinearWay.NATIVE_CHAIN else None)
    ops = chain_kernels(like, layer.layout, layer.plan_for, rows, choice_cache(layer, "_chain_choice"))
    plan = layer.plan_for(rows)
    grouped = layer.__dict__.get("_factor_peers") is not None and tuning.GROUP_FACTORS \
        and not torch.compiler.is_compiling()
    return _prior(layer, like, plan, ops, grouped, settle_merged)


def _measured_way(layer, like: torch.Tensor, rows: int, local: tuple):
    """The measured winner among the row ways that apply for ``rows`` rows (``None`` where
    none is known and none may be timed now: the prior runs, and the next call asks again,
    its key kept per ``local`` settings), and the native chain's ops where it applies."""
    keys = choice_cache(layer, "_measured_keys")  # plain data only: a layer is deep-copied and pickled
    got = keys.get(local)
    native = chain_available(like, rows)
    if got is None:
        lay = layer.layout
        padded_in, padded_out = math.prod(lay.in_modes), math.prod(lay.out_modes)
        ways = [LinearWay.PLANNED, LinearWay.THIN_PAIR]
        if backends.candidate(like, "thin_pair") is not None:   # a backend's pair, timed like the rest
            ways.append(LinearWay.TRITON_PAIR)
        # W holds no more than the rows in and out, and whole matrices are switched on
        if tuning.WHOLE_MATRICES and padded_in * padded_out <= rows * (padded_in + padded_out):
            ways.append(LinearWay.WHOLE_MATRIX)
        if native is not None:
            ways.insert(0, LinearWay.NATIVE_CHAIN)
        candidates = tuple(w.value for w in ways)
        needs_grad = any(p.requires_grad for p in layer.network_tensors())
        shape = (tuple(lay.in_modes), tuple(lay.out_modes), tuple(lay.ranks), layer.bias is not None, needs_grad)
        got = keys[local] = (measured.key_of("tt_linear", shape, like, bucket_of(rows), candidates), candidates,
                             needs_grad)
    key, candidates, needs_grad = got
    won = measured.winner(key, candidates, lambda: _timer(layer, like, rows, native, needs_grad), like)
    return (None if won is None else LinearWay(won)), native


def _timer(layer, like: torch.Tensor, rows: int, native, needs_grad: bool):
    """``time_way(way) -> seconds``: a forward (and, where the layer trains, a backward by
    ``torch.autograd.grad``, which accumulates nothing into ``.grad``) of ``rows`` random
    rows the way named, the layer merging its own factors (no peers' batch is touched)."""
    lay = layer.layout
    # a generator of its own: measuring never moves the caller's random stream (dropout, sampling)
    generator = torch.Generator(device=like.device).manual_seed(0)
    h = torch.randn(rows, *lay.in_modes, device=like.device, dtype=like.dtype, generator=generator)
    bias = None if layer.bias is None else torch.zeros(math.prod(lay.out_modes), device=like.device,
                                                        dtype=layer.bias.dtype)
    params = [p for p in layer.network_tensors() if p.requires_grad] if needs_grad else []
    return measured.forward_backward_timer(lambda name: run_rows(layer, LinearWay(name), h, bias, native, alone=True),
                                           params, like.device)


def _prior(layer, like, plan, ops, grouped: bool, settle_merged: bool):
    """The cost model's way: the native chain at a few rows, a merged pair where the plan
    merges cores first (a whole matrix where estimated faster), else the plan."""
    if ops is not None:
        return LinearWay.NATIVE_CHAIN, ops
    if grouped and _runs_as_pair(layer, plan):
        whole = settle_merged and _runs_whole(layer, plan, like.device)
        return (LinearWay.WHOLE_MATRIX if whole else LinearWay.THIN_PAIR), None
    return LinearWay.PLANNED, None


def through_factors_at(layer, rows: int, factors) -> bool:
    """Whether an inference forward over ``rows`` rows multiplies by the merged factors
    (not costlier than ``tuning.INFERENCE_MERGE_SLACK`` x the planned contraction)."""
    return factor_macs(factors) * rows <= tuning.INFERENCE_MERGE_SLACK * layer.plan_for(rows).fwd_flops


def inference_macs(layer, rows: int) -> int:
    """Multiply-adds of an inference forward (no autograd) over ``rows`` rows, as ``layer``
    runs it: through its merged factors or its planned contraction."""
    factors = layer.inference_factors()
    if layer.merge_in_inference and through_factors_at(layer, rows, factors):
        return factor_macs(factors) * rows
    return layer.plan_for(rows).fwd_flops


# ---------------------------------------------------------------- running it
def run(layer, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s forward: ``x (..., in_features) -> (..., out_features)``, the way
    :func:`choose` says."""
    lay = layer.layout
    way, factors = decide_call(layer, x) if isinstance(x, torch.Tensor) else (None, None)  # (bad input: below)
    if way is LinearWay.EXPORTED:
        return _exported(layer, x)
    if way is LinearWay.INFERENCE_FACTORS:
        check_input_dtype(layer, x)
        record(layer, way)
        return through_factors(x, factors, layer.bias)
    h, bias, lead = as_rows(layer, x, layer.bias, lay.in_features, lay.in_modes, lay.out_features, lay.padded_out)
    return shaped_output(contract_rows(layer, h, bias), lead, lay.out_features, lay.padded_out)


def run_activated(layer, x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(layer(x))`` for ``activation`` in :data:`.rows.ACTIVATIONS`: on a registered
    backend's thin pair (Triton) in its epilogue (the activation's input is never
    written); otherwise the layer, then the activation."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; use one of {sorted(ACTIVATIONS)}")
    lay = layer.layout
    if exporting() or backends.active(x, "thin_pair") is None:
        return ACTIVATIONS[activation](layer(x))
    h, bias, lead = as_rows(layer, x, layer.bias, lay.in_features, lay.in_modes, lay.out_features, lay.padded_out)
    y = _triton_pair(h.reshape(h.shape[0], -1), layer.merged_factors(), bias, activation)
    return shaped_output(y, lead, lay.out_features, lay.padded_out)


def contract_rows(layer, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``h (rows, *in_modes)`` through ``layer``'s network, the way :func:`decide_rows` says:
    ``(rows, padded_out)``."""
    rows = h.shape[0]
    way, ops = decide_rows(layer, h, rows, export_checked=True)  # run() returned before this when exporting
    record(layer, way)
    return run_rows(layer, way, h, bias, ops)


def run_alone(layer, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, ``(..., in_features) -> (..., out_features)``, its rows the way
    :func:`decide_rows` says, merging its own factors (no peer's batch is touched, nothing
    is recorded): a block's measurement running its layers one by one (:mod:`.measured`)."""
    lay = layer.layout
    h, bias, lead = as_rows(layer, x, layer.bias, lay.in_features, lay.in_modes, lay.out_features, lay.padded_out)
    way, ops = decide_rows(layer, h, h.shape[0], export_checked=True)
    return shaped_output(run_rows(layer, way, h, bias, ops, alone=True), lead, lay.out_features, lay.padded_out)


def run_rows(layer, way: LinearWay, h: torch.Tensor, bias: torch.Tensor | None, ops=None,
             alone: bool = False) -> torch.Tensor:
    """``h (rows, *in_modes)`` through ``layer``'s network the row way ``way`` (``ops``:
    the native chain's, for :attr:`LinearWay.NATIVE_CHAIN`): ``(rows, padded_out)``. A
    layer merged with its peers takes its factors from their batch: as a whole matrix or a
    thin pair, whichever the batch was made as (its first layer to ask decides); ``alone``:
    it merges its own (a measurement), recording nothing."""
    rows = h.shape[0]
    if way is LinearWay.TRITON_PAIR:
        return _triton_pair(h.reshape(rows, -1), layer.merged_factors(), bias)
    if way is LinearWay.NATIVE_CHAIN:
        ops = ops if ops is not None else chain_available(h, rows)
        return tt_chain(ops, len(layer.layout.in_modes), h, bias, list(layer.cores._parameters.values()),
                        list(layer.gates._parameters.values()))
    if way in (LinearWay.WHOLE_MATRIX, LinearWay.THIN_PAIR):
        whole = way is LinearWay.WHOLE_MATRIX
        peers = None if alone else layer.__dict__.get("_factor_peers")
        got = peers.factors(layer, whole=whole, strict=False) if peers is not None else None
        if got is None:
            a, b = own_factors(layer)
            got = (a @ b,) if whole else (a, b)
        if len(got) == 1:
            if not alone:
                record(layer, LinearWay.WHOLE_MATRIX)
            h, w = h.reshape(rows, got[0].shape[0]), got[0]
            return torch.addmm(bias, h, w) if bias is not None else torch.mm(h, w)
        if not alone:
            record(layer, LinearWay.THIN_PAIR)
        a, b = got
        return thin_pair(h.reshape(rows, a.shape[0]), a, b, bias)
    return contract(layer.plan_for(rows), [h, *drop_boundary(layer.scaled_cores())], bias)


def own_factors(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s thin factors ``(A, B)`` merged from its own gated cores, in the cores'
    dtype (small products, exact), then cast once each to autocast's dtype where one is in
    force -- not each core at each product of the merge, forward and backward."""
    state = autocast_state(layer.cores[0].device.type)
    with without_autocast(state):
        a, b = tt_factors(layer.scaled_cores(), len(layer.layout.in_modes))
    cast = run_dtype(a, state)
    return (a, b) if cast is None else (a.to(cast), b.to(cast))


def _exported(layer, x: torch.Tensor) -> torch.Tensor:
    """Under ``torch.export`` (and ONNX's exporter): ``x @ A @ B + bias`` with the factors
    merged from the cores in the graph -- core ATen ops only, one form for every
    row count (an ONNX runtime folds the merge into constants when it loads the model)."""
    a, b = layer.merged_factors()
    a, b = a[: layer.in_features], b[:, : layer.out_features]
    whole = a.shape[1] * (layer.in_features + layer.out_features) >= layer.in_features * layer.out_features
    return through_factors(x, (a @ b, None) if whole else (a, b), layer.bias)


def _triton_pair(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor],
                 bias: torch.Tensor | None, activation: str | None = None) -> torch.Tensor:
    """``act(x A B + bias)`` through the registered backend's thin pair (Triton, under
    ``tuning.TRITON_KERNELS``): ``(rows, P_in) -> (rows, P_out)``."""
    return backends.runner_for(x, "thin_pair")(x, factors[0], factors[1], bias, activation)


# ---------------------------------------------------------------- the prior's pieces
def _runs_whole(layer, plan, device: torch.device) -> bool:
    """Whether ``layer``'s batch, when this layer makes it, merges into whole matrices (one
    GEMM over the rows each way instead of two): where the registered rule
    (:func:`whole_matrices_faster`, :mod:`tncompile.planning.speed_model`) estimates it
    faster on ``device``. Cached per bucket, ranks, device, batch and the ``tuning``
    settings it depends on.

    Never while a CUDA graph is captured: the estimate's fixed costs are an eager step's
    (the host's dispatch); replayed, a kernel costs a few microseconds, and the whole
    matrices' extra multiply-adds lost there (H100, the six-encoder at batch 1: 8.8 ms
    captured against 7.9 with thin products, 56 against 64 ms eager)."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    peers = layer.__dict__["_factor_peers"]
    cache = choice_cache(layer, "_whole_choice")
    key = (plan.rows, layer.layout.ranks, device, peers.generation, tuning.DEVICE_SPEED, tuning.WHOLE_MATRICES)
    got = cache.get(key)
    if got is None:
        batch = peers.batch_of(layer)
        got = cache[key] = batch is not None and whole_matrices_faster(layer.layout, plan.rows, device, batch)
    return got


def _runs_as_pair(layer, plan) -> bool:
    """Whether ``plan`` is merge-cores-first (``x A`` then ``(x A) B``), so the layer can run
    it from its merged factors (cached per bucket and ranks)."""
    cache = choice_cache(layer, "_pair_choice")
    key = (plan.rows, layer.layout.ranks)
    got = cache.get(key)
    if got is None:
        got = cache[key] = is_merge_first(plan)
    return got


#: ``rule(layout, rows, device, batch) -> bool``: whether a batch merges into whole
#: matrices; registered by :mod:`tncompile.planning.speed_model`, which knows the devices'
#: speeds (the runtime may not import it). Without one: never.
_WHOLE_RULE: list[Callable] = []


def register_whole_rule(rule: Callable) -> None:
    """Set the rule :func:`whole_matrices_faster` asks (replacing any earlier one)."""
    _WHOLE_RULE[:] = [rule]


def whole_matrices_faster(layout, rows: int, device: torch.device, batch) -> bool:
    """Whether ``batch``'s layers, over ``rows`` rows on ``device``, are estimated faster
    multiplying by their whole matrices than by two thin factors (the registered rule)."""
    return bool(_WHOLE_RULE) and bool(_WHOLE_RULE[0](layout, rows, device, batch))


# ---------------------------------------------------------------- what ran
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
