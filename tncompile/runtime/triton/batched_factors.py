"""Merged factors of several batches of TT networks at once on the Triton merge
(:mod:`.merge_factors`): :class:`TritonFactors`, the Triton form of
:class:`~tncompile.runtime.kernels.factor_batch.BatchedFactors`."""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ..kernels.factor_batch import FactorBatch, network_grads, stack_or_zeros
from .merge_factors import joint_plan, merge_backward, merge_forward, merge_plan, plan_of, supports

__all__ = ["TritonFactors", "merge_key", "merges_on_triton"]


def merge_key(batch: FactorBatch) -> int:
    """The Triton merge's plan key for ``batch`` (made once per batch)."""
    key = batch.__dict__.get("_triton_merge_key")
    if key is None:
        key = batch.__dict__["_triton_merge_key"] = merge_plan(
            batch.n, batch.n_in, batch.params.padded[: batch.d], batch.params.placement, batch.params.size)[0]
    return key


def merges_on_triton(batch: FactorBatch) -> bool:
    """Whether the Triton merge takes ``batch``'s networks (their core count and split)."""
    return supports(batch.n_in, batch.d)


class TritonFactors(torch.autograd.Function):
    """:class:`BatchedFactors` (thin factors only) of several batches at once on the Triton
    merge (:mod:`tncompile.runtime.triton.merge_factors`, a :class:`JointPlan`): each
    batch's cores and gates stacked into one joint workspace, then each step of both chains
    of every network of every batch in one launch -- a model's families of layers merge
    in a copy per batch and 2 launches forward, a copy per batch and 3 launches backward
    (networks of up to 3 + 3 cores), where PyTorch's ops take ~20 and ~30 per batch.

    Inputs: the batches, then each batch's tensors (:func:`~tncompile.runtime.kernels.factor_batch.network_params` of its members, in
    order). Outputs: per batch, its members' ``A`` then their ``B``."""

    @staticmethod
    def forward(ctx, batches: tuple[FactorBatch, ...], *tensors: Tensor):
        key, joint = joint_plan([merge_key(batch) for batch in batches])
        work = tensors[0].new_empty(joint.work_size)
        outputs, start = [], 0
        for batch, plan, at in zip(batches, joint.parts, joint.work_at):
            own = work[at: at + plan.work_size]
            count = batch.n * (2 * batch.d - 1)
            batch.params.stack_into(own, tensors[start: start + count])
            start += count
        merge_forward(work, key)
        for batch, plan, at in zip(batches, joint.parts, joint.work_at):
            a, b = plan.factors(work[at: at + plan.work_size])
            outputs += [*batch.a.split([a]), *batch.b.split([b])]
        ctx.set_materialize_grads(False)
        ctx.batches, ctx.key = batches, key
        ctx.save_for_backward(work)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        batches, joint = ctx.batches, plan_of(ctx.key)
        (work,) = ctx.saved_tensors
        grad = work.new_empty(joint.grad_size)
        ends = list(itertools.accumulate(2 * batch.n for batch in batches))
        per_batch = [grads[end - 2 * batch.n: end] for batch, end in zip(batches, ends)]   # its A's, then its B's
        for batch, plan, at, mine in zip(batches, joint.parts, joint.grad_at, per_batch):
            incoming = grad[at: at + plan.incoming]
            if all(g is None for g in mine):   # a batch none of whose factors were used
                incoming.zero_()
            elif batch.a.equal and batch.b.equal and all(g is not None for g in mine):
                torch.cat([g.reshape(-1) for g in mine], out=incoming)
            else:
                da = stack_or_zeros(mine[: batch.n], batch.a, work)
                db = stack_or_zeros(mine[batch.n:], batch.b, work)
                torch.cat([da.reshape(-1), db.reshape(-1)], out=incoming)
        merge_backward(grad, work, ctx.key)
        out = [None]
        for batch, plan, at, mine in zip(batches, joint.parts, joint.grad_at, per_batch):
            out += network_grads(batch, plan.network_grads(grad[at: at + plan.grad_size]), mine)
        return tuple(out)


