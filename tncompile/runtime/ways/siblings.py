"""How several TT linears applied to one input run: through one pass over it (:class:`SiblingsWay`).

Attention's query, key and value projections (and any other TT linears a model applies
to the same tensor) each start by projecting the input onto their rank:
``t_i = x A_i``, then expand ``y_i = t_i B_i + b_i`` (a TT linear's network merged
into two thin factors, :meth:`~tncompile.runtime.TTLinear.merged_factors`). Run one by
one, a training step reads ``x`` once per layer forward, once per layer again for the
``A_i`` gradients, and writes one ``dx`` per layer that autograd then sums. Here the
``A_i`` sit side by side: one thin product ``t = x [A_1 .. A_n]`` forward; backward one
``dx = dt [A_1 .. A_n]^T`` and one pass over ``x`` for all the ``A_i`` gradients, on
the native CPU kernels.

It applies to :class:`~tncompile.runtime.TTLinear` layers without hooks, on CPU
float32/float64 outside ``torch.compile`` and autocast, from
``tuning.FUSE_MIN_ROWS`` rows on, where the merged factors cost at most
``tuning.FUSE_FLOP_SLACK`` times the layers' planned contractions; everywhere else
each layer runs its own forward. Where it applies in a differentiable eager call, one pass
is timed against the layers one by one, once per shape and bucket of rows, and the faster
runs (:mod:`.measured`). The layers stay where they are in the module tree; a call through
one pass records its way on each of them (``ran_as``).
"""
from __future__ import annotations

import enum
from typing import Sequence

import torch
from torch import nn

from ... import tuning
from ..kernels.plans import bucket_of
from ..kernels.tracing import exporting
from ..native import kernels_for
from . import measured
from .linear import choice_cache, own_factors, record, run_alone
from .rows import first_cpu_use

__all__ = ["SiblingsWay", "choose", "decide", "run", "sibling_kernels"]


def _factor_rank(layer: nn.Module) -> int:
    return layer.layout.ranks[len(layer.layout.in_modes) - 1]


class SiblingsWay(str, enum.Enum):
    """One way several TT linears on one input run (its ``value`` is what a report prints)."""

    ONE_PASS = "one pass"            # eager CPU: x [A_1 .. A_n] once, one dx, one pass for the A gradients
    EACH = "each layer"              # each layer its own way


#: the ways timed against each other where one pass applies (:mod:`.measured`)
MEASURED = (SiblingsWay.ONE_PASS, SiblingsWay.EACH)
measured.register_ways(w.value for w in MEASURED)


def choose(x: torch.Tensor, layers: Sequence[nn.Module], fusable: bool) -> SiblingsWay:
    """The way :func:`run` takes (``fusable``: every layer a TT linear without hooks)."""
    return decide(x, layers, fusable)[0]


def decide(x: torch.Tensor, layers: Sequence[nn.Module], fusable: bool):
    """:func:`choose`'s way and the native ops of one pass (``None``: each layer). Where one
    pass applies in a differentiable eager call, the faster of it and the layers one by
    one as measured (:mod:`.measured`); else the multiply-add rule."""
    ops = sibling_kernels(x, layers, fusable)
    if ops is None:
        return SiblingsWay.EACH, None
    if measured.applies(x, export_checked=True):  # sibling_kernels returned None when exporting
        layers = list(layers)
        rows = x.numel() // layers[0].in_features
        shape = tuple((tuple(m.layout.in_modes), tuple(m.layout.out_modes), tuple(m.layout.ranks), m.bias is not None)
                      for m in layers)
        candidates = tuple(w.value for w in MEASURED)
        won = measured.fastest_of(layers[0], "tt_siblings", shape, x, rows, candidates,
                                  lambda: _timer(x, layers, ops))
        if won == SiblingsWay.EACH.value:
            return SiblingsWay.EACH, None
    return SiblingsWay.ONE_PASS, ops


def _timer(like: torch.Tensor, layers: list[nn.Module], ops):
    """``time_way(way) -> seconds``: every layer's forward and the backward (to the input
    and parameters, by ``torch.autograd.grad``: nothing accumulates into ``.grad``) over
    random rows as many as ``like``'s, each layer merging its own factors."""
    width = layers[0].in_features
    generator = torch.Generator(device=like.device).manual_seed(0)
    h = torch.randn(like.numel() // width, width, device=like.device, dtype=like.dtype, generator=generator,
                    requires_grad=True)
    inputs = [h, *(p for m in layers for p in m.parameters() if p.requires_grad)]

    def each(name: str) -> list[torch.Tensor]:
        if name == SiblingsWay.ONE_PASS.value:
            return list(_one_pass(ops, h, layers, [own_factors(m) for m in layers]))
        return [run_alone(m, h) for m in layers]
    return measured.forward_backward_timer(each, inputs, like.device)


def sibling_kernels(x: torch.Tensor, layers: Sequence[nn.Module], fusable: bool):
    """The native ops when ``layers`` run through one pass over ``x``, else ``None``
    (``fusable``: every layer a TT linear running its own forward, without hooks). The
    flop comparison is cached per layer and bucket."""
    if len(layers) < 2 or exporting() or not fusable:
        return None
    width = layers[0].in_features
    if any(m.in_features != width for m in layers) or x.shape[-1:] != (width,):
        return None
    rows = x.numel() // width if width else 0
    ops = kernels_for(x)
    if rows < tuning.FUSE_MIN_ROWS or ops is None or any(m.cores[0].dtype != x.dtype for m in layers):
        return None
    bucket = bucket_of(rows)
    for m in layers:
        cache = choice_cache(m, "_sibling_choice")
        key = (bucket, m.layout.ranks)
        cheap = cache.get(key)
        if cheap is None:
            merged = bucket * _factor_rank(m) * (m.in_features + m.out_features)
            cheap = cache[key] = merged <= tuning.FUSE_FLOP_SLACK * m.plan_for(bucket).fwd_flops
        if not cheap:
            return None
    return ops


def run(x: torch.Tensor, layers: Sequence[nn.Module], fusable: bool) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)`` the way :func:`choose` says.

    Shapes: ``x (..., in_features)`` -> one ``(..., layer.out_features)`` per layer.
    """
    layers = list(layers)
    first_cpu_use(x)
    way, ops = decide(x, layers, fusable)
    if ops is None:
        return tuple(layer(x) for layer in layers)
    for m in layers:
        record(m, way)
    outs = _one_pass(ops, x.reshape(-1, layers[0].in_features), layers, [m.merged_factors() for m in layers])
    return tuple(y.reshape(*x.shape[:-1], m.out_features) for y, m in zip(outs, layers))


def _one_pass(ops, rows: torch.Tensor, layers: list[nn.Module], factors) -> tuple[torch.Tensor, ...]:
    """``rows (M, in_features)`` through every layer in one pass, with their padded factors
    ``(A, B)``: one ``(M, layer.out_features)`` per layer."""
    width = layers[0].in_features
    a = torch.cat([f[0][:width] for f in factors], dim=1)
    expands = [f[1][:, : m.out_features] for f, m in zip(factors, layers)]
    return _SiblingLinears.apply(ops, len(layers), rows, a, *expands, *[m.bias for m in layers])


class _SiblingLinears(torch.autograd.Function):
    """``x (M, N) -> (x A B_i + b_i)_i`` with ``A = [A_1 .. A_n] (N, R)``; saves ``x``,
    ``A``, the ``B_i`` and the rank-thin ``t = x A`` only."""

    @staticmethod
    def forward(ctx, ops, n, x, a, *rest):
        expands, biases = rest[:n], rest[n:]
        x = x.contiguous()
        t = ops.thin_project(x, a)  # (M, R): one pass over x for every layer
        bounds, start = [], 0
        for b in expands:
            bounds.append((start, start + b.shape[0]))
            start += b.shape[0]
        ctx.ops, ctx.n, ctx.bounds = ops, n, bounds
        ctx.has_bias = [bias is not None for bias in biases]
        ctx.save_for_backward(x, a, t, *expands)
        return tuple(ops.thin_expand(t[:, lo:hi], b, bias) for (lo, hi), b, bias in zip(bounds, expands, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, a, t, *expands = ctx.saved_tensors
        ops, n = ctx.ops, ctx.n
        need = ctx.needs_input_grad  # (ops, n, x, a, *expands, *biases)
        d_t = t.new_zeros(t.shape)
        d_expands, d_biases = [None] * n, [None] * n
        for i, ((lo, hi), b, g) in enumerate(zip(ctx.bounds, expands, grads)):
            if g is None:
                continue
            need_bias = need[4 + n + i] and ctx.has_bias[i]
            dt_i, d_b, d_bias = ops.thin_expand_backward(g.contiguous(), t[:, lo:hi], b, True, need[4 + i], need_bias)
            d_t[:, lo:hi] = dt_i
            d_expands[i], d_biases[i] = (d_b if need[4 + i] else None), (d_bias if need_bias else None)
        d_x = ops.thin_expand(d_t, a.t(), None) if need[2] else None          # one dx for every layer
        d_a = None
        if need[3]:  # [A_1 .. A_n] gradients: x.T dt, one pass over x (the kernel's t.T x, transposed)
            zeros = x.new_zeros(()).expand(d_t.shape[1], x.shape[1])
            d_a = ops.thin_expand_backward(x, d_t, zeros, False, True, False)[1].t()
        return (None, None, d_x, d_a, *d_expands, *d_biases)
