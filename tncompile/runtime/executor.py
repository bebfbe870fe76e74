"""Planned executor: run a :class:`~tncompile.ir.plan.ContractionPlan` pairwise.

Forward: one ``tensordot`` per step (a permute, when needed, and one GEMM).
Backward: reverse mode through the same steps -- the gradient of each step's
operand is the step's output gradient contracted with the other operand --
so the backward is planned by the forward tree and costs about twice the
forward. The autograd ``Function`` saves exactly the step operands the
backward needs and nothing else.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..ir.plan import ContractionPlan, Step

__all__ = ["contract", "PlannedContraction"]


def _forward(plan: ContractionPlan, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    ops = list(operands)
    for s in plan.steps:
        ops.append(torch.tensordot(ops[s.a], ops[s.b], dims=(s.a_axes, s.b_axes)))
    return ops


def _finish(plan: ContractionPlan, result: torch.Tensor) -> torch.Tensor:
    return result if plan.out_perm is None else result.permute(plan.out_perm)


def _grad_of_operand(s: Step, g: torch.Tensor, other: torch.Tensor, which: str) -> torch.Tensor:
    """Gradient of operand ``which`` ('a' or 'b') of step ``s`` given ``g`` = dL/dC."""
    n_a_free = len(s.a_idx) - len(s.a_axes)
    if which == "a":
        # contract g's B-free axes with B's free axes; result: A-free then B's contracted axes
        b_free = [k for k in range(len(s.b_idx)) if k not in s.b_axes]
        out = torch.tensordot(g, other, dims=(list(range(n_a_free, g.dim())), b_free))
        got = [x for k, x in enumerate(s.a_idx) if k not in s.a_axes] + [s.b_idx[k] for k in sorted(s.b_axes)]
        target = s.a_idx
    else:
        a_free = [k for k in range(len(s.a_idx)) if k not in s.a_axes]
        out = torch.tensordot(other, g, dims=(a_free, list(range(n_a_free))))
        got = [s.a_idx[k] for k in sorted(s.a_axes)] + [x for k, x in enumerate(s.b_idx) if k not in s.b_axes]
        target = s.b_idx
    perm = [got.index(x) for x in target]
    return out if perm == list(range(len(perm))) else out.permute(perm)


class PlannedContraction(torch.autograd.Function):
    """Contract ``operands`` along ``plan``; backward by reverse mode over the steps."""

    @staticmethod
    def forward(ctx, plan: ContractionPlan, *operands: torch.Tensor) -> torch.Tensor:
        ops = _forward(plan, list(operands))
        ctx.plan = plan
        ctx.n_inputs = len(operands)
        ctx.save_for_backward(*ops[:-1])  # every step operand; the final result is not needed
        return _finish(plan, ops[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        plan: ContractionPlan = ctx.plan
        ops = ctx.saved_tensors
        needs = list(ctx.needs_input_grad[1:])
        n = ctx.n_inputs
        # which SSA values need gradients: inputs that require them, and results built from those
        want = needs + [False] * len(plan.steps)
        for k, s in enumerate(plan.steps):
            want[n + k] = want[s.a] or want[s.b]
        grads: list[torch.Tensor | None] = [None] * (n + len(plan.steps))
        g = grad_out
        if plan.out_perm is not None:
            inverse = [plan.out_perm.index(i) for i in range(len(plan.out_perm))]
            g = g.permute(inverse)
        grads[-1] = g
        for k in range(len(plan.steps) - 1, -1, -1):
            s = plan.steps[k]
            gc = grads[n + k]
            if gc is None:
                continue
            grads[n + k] = None  # free as we go
            if want[s.a]:
                grads[s.a] = _grad_of_operand(s, gc, ops[s.b], "a")
            if want[s.b]:
                grads[s.b] = _grad_of_operand(s, gc, ops[s.a], "b")
        return (None, *grads[:n])


def contract(plan: ContractionPlan, operands: Sequence[torch.Tensor]) -> torch.Tensor:
    """Run ``plan`` on ``operands`` (differentiable).

    Under ``torch.compile`` the steps run as plain ops (autograd derives the
    same reverse-mode backward) so the compiler can trace them.
    """
    if torch.compiler.is_compiling():
        return _finish(plan, _forward(plan, list(operands))[-1])
    return PlannedContraction.apply(plan, *operands)
