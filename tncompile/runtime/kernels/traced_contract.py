"""A planned TT contraction as one ``torch.library`` custom op, for tracers.

Eagerly, :class:`~tncompile.runtime.kernels.executor.PlannedContraction` runs a plan's
generated code (one GEMM a step) inside an autograd Function. Traced by
``torch.compile``, the same steps would reach inductor as ~10 small GEMMs,
reshapes and permuted copies per layer, each a kernel to generate and compile.
``tncompile::traced_contract`` is the whole contraction as one opaque call:
its fake kernel gives the output's and intermediates' shapes from the plan,
and its backward is one more opaque call (``traced_contract_backward``) that
runs the plan's generated backward on the saved intermediates. A plan is
named by an integer key in a process-wide registry (:func:`register`, done
for every plan a layer fetches while traced).
"""
from __future__ import annotations

from math import prod

import torch
from torch import Tensor

from .gemms import GENERATED_CODE_NAMESPACE, finish, gemm_for
from ..native.traced import empty_grad, separate_outputs
from .plan_program import program_for
from .plans import ContractionPlan

__all__ = ["traced_contract", "register"]

_PLANS: dict[int, ContractionPlan] = {}


def register(plan: ContractionPlan) -> ContractionPlan:
    """Put ``plan`` in the registry (eagerly, before tracing reads it) and note its
    key on it, so traced code reads the key as an attribute of a constant."""
    key = id(plan)
    _PLANS[key] = plan
    object.__setattr__(plan, "_traced_key", key)
    return plan


def _shapes(plan: ContractionPlan, operands) -> tuple[list[int], list[list[int]]]:
    """Output shape and the step intermediates' shapes, for the rows of ``operands``."""
    rows = 1
    for idx, t in zip(plan.inputs, operands):
        if plan.batch is not None and plan.batch in idx:
            rows = t.shape[idx.index(plan.batch)]
            break

    def shape(idx):
        return [rows if x == plan.batch else plan.sizes[x] for x in idx]
    return shape(plan.output), [shape(s.c_idx) for s in plan.steps[:-1]]


@torch.library.custom_op("tncompile::traced_contract", mutates_args=())
def traced_contract(operands: list[Tensor], bias: Tensor | None, plan: int) -> list[Tensor]:
    """``[output, *step intermediates]`` of the registered plan ``plan`` on ``operands``."""
    p = _PLANS[plan]
    fused = bias if p.bias_fusable else None
    ops = program_for(p, GENERATED_CODE_NAMESPACE).forward(tuple(operands), fused, gemm_for(operands[0]))
    out = finish(p, ops[-1])
    if bias is not None and fused is None:
        out = out + bias.reshape(out.shape[1:])
    n = len(operands)
    return separate_outputs([out.contiguous(), *(t.contiguous() for t in ops[n:-1])], tuple(operands))


@traced_contract.register_fake
def _(operands, bias, plan):
    out, steps = _shapes(_PLANS[plan], operands)
    first = operands[0]
    return [first.new_empty(out), *(first.new_empty(s) for s in steps)]


@torch.library.custom_op("tncompile::traced_contract_backward", mutates_args=())
def traced_contract_backward(grad: Tensor, saved: list[Tensor], plan: int, want: list[bool],
                             want_bias: bool) -> list[Tensor]:
    """Gradients of the operands (empty where not wanted), then the bias's (empty if not wanted)."""
    p = _PLANS[plan]
    run = program_for(p, GENERATED_CODE_NAMESPACE).backward(tuple(want), want_bias)
    grads, g_bias = run(tuple(saved), grad.contiguous(), gemm_for(grad))
    outs = [g.contiguous() if w and g is not None else empty_grad(grad) for g, w in zip(grads, want)]
    outs.append(g_bias.contiguous() if want_bias and g_bias is not None else empty_grad(grad))
    return separate_outputs(outs, (grad, *saved))


@traced_contract_backward.register_fake
def _(grad, saved, plan, want, want_bias):
    p = _PLANS[plan]
    n = len(p.inputs)
    out = [grad.new_empty(saved[i].shape) if want[i] else empty_grad(grad) for i in range(n)]
    out.append(grad.new_empty((prod(_shapes(p, saved[:n])[0][1:]),)) if want_bias else empty_grad(grad))
    return out


def _setup(ctx, inputs, output):
    operands, bias, plan = inputs
    ctx.n, ctx.plan, ctx.has_bias = len(operands), plan, bias is not None
    ctx.save_for_backward(*operands, *output[1:])


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    need_ops = ctx.needs_input_grad[0]
    want = list(need_ops) if isinstance(need_ops, (list, tuple)) else [bool(need_ops)] * ctx.n
    want_bias = bool(ctx.has_bias and ctx.needs_input_grad[1])
    got = traced_contract_backward(grads[0], saved, ctx.plan, want, want_bias)
    return [g if w else None for g, w in zip(got[:-1], want)], (got[-1] if want_bias else None), None


traced_contract.register_autograd(_backward, setup_context=_setup)
