"""How a TT feed-forward block ``second(act(first(x)))`` runs: :class:`FeedForwardWay`,
:func:`choose` and :func:`run`.

Feed-forward blocks of two TT linears, fused: ``second(act(first(x)))``.

Over many rows both linears run merge-cores-first, ``x @ A -> (.) @ B + b``,
so the block is ``act(x A1 B1 + b1) A2 B2 + b2`` and everything wide sits in
the middle: ``F`` columns (3072 in a BERT-base block) that the two linears
and the activation write and read back ~10 times per training step, while
the arithmetic around them is rank-thin. :func:`tt_feed_forward` runs that
middle as one native kernel each way (``tncompile::ffn_forward`` /
``ffn_backward``, :mod:`.native`): rows are processed a few at a time with
their hidden activation in cache, and backward recomputes it from the
rank-``r1`` tensor ``x A1`` instead of keeping two ``rows x F`` tensors.

The ``fuse_feed_forward`` pass puts calls to :func:`tt_feed_forward` in the
graph. Where the fused kernel does not apply (no native kernels, CUDA, bf16
or autocast, ``torch.compile`` tracing, few rows, or a block where merging
the cores would cost far more multiply-adds than the planned order) it runs
the two layers and the activation one after the other, as the original
model did -- on the Triton kernels (``tuning.TRITON_KERNELS``) with the
activation in the first layer's epilogue (:meth:`TTLinear.activated`): two
launches fewer per step and no ``rows x F`` activation input kept.

Where the fused kernel applies in a differentiable eager call, it is timed against the
two layers run one by one, once per shape and bucket of rows, and the faster runs
(:mod:`.measured`); elsewhere the multiply-add rule above is the prior. A fused call
records its way on both layers (``ran_as``: the report's "ran as" column).
"""
from __future__ import annotations

import enum

import torch
from torch import nn

from ... import tuning
from ..kernels.cpu_gemm import cpu_gemm
from ..kernels.plans import bucket_of
from ..kernels.tracing import exporting
from ..native import kernels_for, traced_kernels
from . import measured
from .linear import choice_cache, own_factors, record, run_alone
from .rows import ACTIVATIONS, first_cpu_use

__all__ = ["ACTIVATIONS", "FeedForwardWay", "choose", "decide", "run", "fused_kernels", "fused_macs"]




def fused_macs(first: nn.Module, second: nn.Module, rows: int) -> int:
    """Multiply-adds of the fused block's forward over ``rows`` rows: the
    four thin products (the cores' merging is negligible next to them)."""
    r1, r2 = first.layout.ranks[len(first.layout.in_modes) - 1], second.layout.ranks[len(second.layout.in_modes) - 1]
    hidden = first.out_features
    return rows * (first.in_features * r1 + r1 * hidden + hidden * r2 + r2 * second.out_features)


class FeedForwardWay(str, enum.Enum):
    """One way a TT feed-forward block runs (its ``value`` is what a report prints)."""

    FUSED = "fused native"           # eager CPU: one native kernel, the hidden activation never written
    TRACED = "fused traced ops"      # under torch.compile: the same as three opaque ops
    LAYERS = "layer by layer"        # each layer its own way, the activation between (or in a Triton epilogue)


#: the ways timed against each other where the fused kernel applies (:mod:`.measured`)
MEASURED = (FeedForwardWay.FUSED, FeedForwardWay.LAYERS)
measured.register_ways(w.value for w in MEASURED)


def choose(x: torch.Tensor, first: nn.Module, second: nn.Module, fusable: bool,
           activation: str = "gelu") -> FeedForwardWay:
    """The way :func:`run` takes for ``x`` (``fusable``: both layers TT linears without hooks)."""
    return decide(x, first, second, fusable, activation)[0]


def decide(x: torch.Tensor, first: nn.Module, second: nn.Module, fusable: bool, activation: str):
    """:func:`choose`'s way and the native ops it runs on (``None``: layer by layer). Where
    the fused kernel applies in a differentiable eager call, the faster of it and the
    layers one by one as measured (:mod:`.measured`); else the multiply-add rule."""
    ops = fused_kernels(x, first, second, fusable)
    if ops is None:
        return FeedForwardWay.LAYERS, None
    if torch.compiler.is_compiling():
        return FeedForwardWay.TRACED, ops
    if measured.applies(x, export_checked=True):  # fused_kernels returned None when exporting
        rows = x.numel() // first.in_features
        shape = tuple((tuple(m.layout.in_modes), tuple(m.layout.out_modes), tuple(m.layout.ranks), m.bias is not None)
                      for m in (first, second)) + (activation,)
        candidates = tuple(w.value for w in MEASURED)
        won = measured.fastest_of(second, "tt_feed_forward", shape, x, rows, candidates,
                                  lambda: _timer(x, first, second, activation, ops))
        if won == FeedForwardWay.LAYERS.value:
            return FeedForwardWay.LAYERS, None
    return FeedForwardWay.FUSED, ops


def _timer(like: torch.Tensor, first: nn.Module, second: nn.Module, activation: str, ops):
    """``time_way(way) -> seconds``: the block forward and backward (to its input and
    parameters, by ``torch.autograd.grad``: nothing accumulates into ``.grad``) over
    random rows as many as ``like``'s, each layer merging its own factors."""
    rows = like.numel() // first.in_features
    generator = torch.Generator(device=like.device).manual_seed(0)
    h = torch.randn(rows, first.in_features, device=like.device, dtype=like.dtype, generator=generator,
                    requires_grad=True)
    inputs = [h, *(p for m in (first, second) for p in m.parameters() if p.requires_grad)]

    def block(name: str) -> torch.Tensor:
        if name == FeedForwardWay.FUSED.value:
            return _fused(ops, activation, h, first, second, own_factors(first), own_factors(second))
        return run_alone(second, ACTIVATIONS[activation](run_alone(first, h)))
    return measured.forward_backward_timer(block, inputs, like.device)


def fused_kernels(x: torch.Tensor, first: nn.Module, second: nn.Module, fusable: bool):
    """The native ops when the block is fused for input ``x``, else ``None``
    (``fusable``: both layers are TT linears running their own forward, without hooks).
    The flop comparison is cached on ``second`` per bucket and ranks."""
    if not fusable:
        return None
    if exporting():  # one form for every row count, core ATen ops only: the layers' own
        return None
    rows = x.numel() // first.in_features if first.in_features else 0
    if rows < tuning.FUSE_MIN_ROWS:
        return None
    ops = kernels_for(x) or traced_kernels(x)
    if ops is None or first.cores[0].dtype != x.dtype or second.cores[0].dtype != x.dtype:
        return None
    bucket = bucket_of(rows)
    cache = choice_cache(second, "_fused_choice")
    key = (bucket, first.layout.ranks, second.layout.ranks)
    cheap = cache.get(key)
    if cheap is None:
        planned = first.plan_for(bucket).fwd_flops + second.plan_for(bucket).fwd_flops
        cheap = cache[key] = fused_macs(first, second, bucket) <= tuning.FUSE_FLOP_SLACK * planned
    return ops if cheap else None


def run(x: torch.Tensor, first: nn.Module, second: nn.Module, activation: str, fusable: bool,
        first_is_tt: bool) -> torch.Tensor:
    """``second(act(first(x)))`` the way :func:`choose` says; ``first_is_tt``: ``first``
    runs a TT linear's own forward (the activation then goes in its Triton epilogue
    where that runs). ``x (..., first.in_features) -> (..., second.out_features)``."""
    first_cpu_use(x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"tt_feed_forward: unknown activation {activation!r}; use one of {sorted(ACTIVATIONS)}")
    way, ops = decide(x, first, second, fusable, activation)
    if ops is None:
        if first_is_tt:   # the activation in the layer's epilogue on Triton
            return second(first.activated(x, activation))
        return second(ACTIVATIONS[activation](first(x)))
    if x.shape[-1] != first.in_features:
        raise ValueError(f"TTLinear expected last dim {first.in_features}, got shape {tuple(x.shape)}")
    a1, b1 = first.merged_factors()
    a2, b2 = second.merged_factors()
    hidden = first.out_features
    rows = x.reshape(-1, first.in_features)
    if way is FeedForwardWay.TRACED:  # the traceable ops: three opaque calls, each with its registered backward
        t = ops.thin_project(rows.contiguous(), a1[:first.in_features])
        u = ops.ffn(t, b1[:, :hidden], first.bias, a2[:hidden], activation)
        y = ops.thin_expand(u, b2[:, :second.out_features], second.bias)
        return y.reshape(*x.shape[:-1], second.out_features)
    record(first, way)
    record(second, way)
    y = _fused(ops, activation, rows, first, second, (a1, b1), (a2, b2))
    return y.reshape(*x.shape[:-1], second.out_features)


def _fused(ops, activation: str, rows: torch.Tensor, first: nn.Module, second: nn.Module, factors1, factors2):
    """``rows (M, first.in_features)`` through the fused kernel with the two layers' padded
    factors ``(A, B)``: ``(M, second.out_features)``."""
    (a1, b1), (a2, b2) = factors1, factors2
    hidden = first.out_features
    return _FusedFeedForward.apply(ops, activation, rows, a1[:first.in_features], b1[:, :hidden], first.bias,
                                   a2[:hidden], b2[:, :second.out_features], second.bias)


class _FusedFeedForward(torch.autograd.Function):
    """``x (M, N_in) -> act(x A1 B1 + b1) A2 B2 + b2 (M, N_out)``; saves
    ``x``, the factors and the two rank-thin intermediates only."""

    @staticmethod
    def forward(ctx, ops, activation, x, a1, b1, bias1, a2, b2, bias2):
        x = x.contiguous()
        t = ops.thin_project(x, a1)                           # (M, r1)
        u = ops.ffn_forward(t, b1, bias1, a2, activation)     # (M, r2): the hidden F columns stay in cache
        ctx.ops, ctx.activation = ops, activation
        ctx.save_for_backward(x, a1, t, b1, bias1, a2, u, b2)
        ctx.has_bias = (bias1 is not None, bias2 is not None)
        return ops.thin_expand(u, b2, bias2)

    @staticmethod
    def backward(ctx, grad):
        x, a1, t, b1, bias1, a2, u, b2 = ctx.saved_tensors
        ops = ctx.ops
        need = ctx.needs_input_grad  # (ops, activation, x, a1, b1, bias1, a2, b2, bias2)
        need_bias1, need_bias2 = need[5] and ctx.has_bias[0], need[8] and ctx.has_bias[1]
        du, d_b2, d_bias2 = ops.thin_expand_backward(grad, u, b2, True, need[7], need_bias2)
        d_t, d_b1, d_bias1, d_a2 = ops.ffn_backward(du, t, b1, bias1, a2, ctx.activation,
                                                    need[2] or need[3], need[4], need_bias1, need[6])
        d_x = ops.thin_expand(d_t, a1.t(), None) if need[2] else None
        d_a1 = cpu_gemm(x.t(), d_t) if need[3] else None  # x.T read row by row: the fast layout for MKL
        return (None, None, d_x, d_a1, d_b1 if need[4] else None, d_bias1 if need_bias1 else None,
                d_a2 if need[6] else None, d_b2 if need[7] else None, d_bias2 if need_bias2 else None)
