"""A TTM embedding's lookup on tncompile's Triton kernels, as one autograd function."""
from __future__ import annotations

import math

import torch

from .merge_factors import merge_backward, merge_forward, merge_plan, plan_of
from .ttm_lookup import lookup_table, ttm_gather, ttm_scatter_

__all__ = ["TritonLookup"]


class TritonLookup(torch.autograd.Function):
    """A TTM embedding's rows on tncompile's Triton kernels (``tuning.TRITON_KERNELS``): the
    two halves merged from the cores and gates in one launch (:mod:`.merge_factors`,
    the cores read as TT cores ``(r, m n, r')``), the rows gathered from them in one
    (:mod:`.ttm_lookup`); backward: the halves' gradients scattered in one launch,
    the cores' and gates' in three more. Inputs: the layer, ids ``(T,)``, the split, then
    its cores and gates. Output ``(T, padded_cols)``; ids equal to ``padding_idx`` send no
    gradient."""

    @staticmethod
    def forward(ctx, layer, ids: torch.Tensor, split: int, *tensors: torch.Tensor):
        lay = layer.layout
        d = len(lay.row_modes)
        shapes = [(c.shape[0], c.shape[1] * c.shape[2], c.shape[3]) for c in tensors[:d]]
        sizes = [t.numel() for t in tensors]
        key, plan = merge_plan(1, split, shapes, [(sum(sizes[:p]), sum(sizes)) for p in range(len(sizes))], sum(sizes))
        work = tensors[0].new_empty(plan.work_size)
        torch.cat([t.reshape(-1) for t in tensors], out=work[: sum(sizes)])
        merge_forward(work, key)
        a, b = (f[0] for f in plan.factors(work))
        table = lookup_table(lay.row_modes, lay.col_modes, split, ids)
        halves = (math.prod(lay.col_modes[:split]), math.prod(lay.col_modes[split:]))
        ctx.save_for_backward(work, ids)
        ctx.info = (key, table, split, halves, layer.padding_idx, [t.shape for t in tensors])
        return ttm_gather(a, b, ids, table, split, *halves)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        work, ids = ctx.saved_tensors
        key, table, split, halves, padding_idx, shapes = ctx.info
        plan = plan_of(key)
        grads = work.new_empty(plan.grad_size)
        grads[: plan.incoming].zero_()
        da, db = (g[0] for g in plan.factor_grads(grads))     # one network: the views' first
        a, b = (f[0] for f in plan.factors(work))
        ttm_scatter_(da, db, a, b, ids, table, grad.contiguous(), split, *halves, padding_idx)
        merge_backward(grads, work, key)
        return (None, None, None, *(g[0].view(shape) for g, shape in zip(plan.network_grads(grads), shapes)))
