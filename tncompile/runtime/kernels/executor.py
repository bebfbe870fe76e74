"""Planned executor: run a :class:`~tncompile.runtime.kernels.plans.ContractionPlan` pairwise.

Forward: one ``tensordot`` per step (a permute, when needed, and one GEMM).
Backward: reverse mode through the same steps -- the gradient of each step's
operand is the step's output gradient contracted with the other operand --
so the backward is planned by the forward tree and costs about twice the
forward. The autograd ``Function`` saves exactly the step operands the
backward needs and nothing else.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import torch

from .gemms import (GENERATED_CODE_NAMESPACE, column_sums, expand_grads, finish, gemm_bias, gemm_for,
                    grad_with_bias, pairwise)
from .plan_program import program_for
from .plans import ContractionPlan

__all__ = ["contract", "PlannedContraction", "pairwise", "generated_code", "generated_code_dump", "is_merge_first",
           "thin_pair"]


def fuses_bias(plan: ContractionPlan) -> bool:
    """Whether the last step yields ``(rows, outputs...)`` so a bias can ride in its GEMM."""
    return plan.bias_fusable


def _forward(plan: ContractionPlan, operands: list[torch.Tensor],
             bias: torch.Tensor | None = None) -> list[torch.Tensor]:
    """All SSA values; ``bias`` (only when :func:`fuses_bias`) joins the last GEMM."""
    ops = list(operands)
    last = len(plan.steps) - 1
    for k, s in enumerate(plan.steps):
        ops.append(pairwise(ops[s.a], s.a_axes, ops[s.b], s.b_axes, bias if k == last else None))
    return ops


def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The autocast setting in force for ``device_type`` (saved by forward);
    disabled for device types autocast does not know (e.g. ``meta``)."""
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except RuntimeError:
        return device_type, False, torch.float32


def without_autocast(state: tuple[str, bool, torch.dtype]):
    """A context with autocast off where ``state`` (:func:`autocast_state`) has it on; else
    nothing to enter (no ~10 us context, and no autocast for device types it cannot set
    up: fake CUDA tensors in a dry run on a machine without a GPU)."""
    device_type, enabled, _ = state
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


def run_dtype(t: torch.Tensor, state: tuple[str, bool, torch.dtype] | None = None) -> torch.dtype | None:
    """The dtype products with ``t`` run in under the autocast in force (``state``, else
    read now), where that is not ``t``'s own (fp32 tensors under bf16 / fp16 autocast),
    else ``None``."""
    _, enabled, dtype = autocast_state(t.device.type) if state is None else state
    return dtype if enabled and t.dtype == torch.float32 and dtype != torch.float32 else None


def same_autocast(state: tuple[str, bool, torch.dtype]):
    """Re-enter in backward the autocast state forward ran under (as
    ``torch.amp.custom_bwd`` does), so saved bf16 and fp32 tensors mix as in forward."""
    device_type, enabled, dtype = state
    if not enabled:
        try:
            active = torch.is_autocast_enabled(device_type)
        except RuntimeError:  # a device type autocast does not know (meta): never active
            active = False
        if not active:
            return contextlib.nullcontext()  # already the same: skip the context's ~10 us
    # no cast cache: a cached cast would outlive a captured graph's replay (PyTorch's CUDA-graph notes)
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled, cache_enabled=False)


def generated_code(plan: ContractionPlan) -> str:
    """The Python the executor runs for ``plan``: its forward and its backward
    (for every input needing a gradient, with a bias)."""
    program = program_for(plan, GENERATED_CODE_NAMESPACE)
    if program is None:
        raise ValueError("this plan was saved without its index sizes (an older tncompile); "
                         "re-plan it (module.plan_bucket(bucket)) to get generated code")
    return program.source()


def generated_code_dump(modules: Iterable[tuple[str, torch.nn.Module]]) -> str:
    """The generated code of every planned contraction among ``modules``
    (``(name, module)`` pairs), one block per layer and bucket, as one Python
    file; ``""`` when nothing is planned. TTM lookups (gathered products, not
    pairwise plans) and plans saved without their sizes are skipped."""
    blocks = []
    for name, module in modules:
        plans = module.__dict__.get("_plans") or {}
        for bucket, plan in sorted(plans.items()):
            if isinstance(plan, ContractionPlan) and plan.sizes is not None:
                blocks.append(f"# ===== {name}: rows <= {bucket}, order {plan.order()}, "
                              f"strategy {plan.strategy}\n{generated_code(plan)}")
    return "\n\n".join(blocks)


class PlannedContraction(torch.autograd.Function):
    """Contract ``operands`` along ``plan``; backward by reverse mode over the steps.

    Runs the plan's generated straight-line code (:mod:`.plan_program`);
    plans saved without their sizes run through the generic step loop."""

    @staticmethod
    def forward(ctx, plan: ContractionPlan, bias: torch.Tensor | None, *operands: torch.Tensor) -> torch.Tensor:
        program = program_for(plan, GENERATED_CODE_NAMESPACE)
        fused = bias if plan.bias_fusable else None
        if program is not None:
            ops = program.forward(operands, fused, gemm_for(operands[0]))
        else:
            ops = _forward(plan, list(operands), fused)
        ctx.program = program
        ctx.autocast = autocast_state(operands[0].device.type)
        ctx.plan = plan
        ctx.n_inputs = len(operands)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(*ops[:-1])  # every step operand; the final result is not needed
        out = finish(plan, ops[-1])
        if bias is not None and fused is None:  # added here, not by autograd: no extra graph nodes
            out = out + bias.reshape(out.shape[1:])
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        with same_autocast(ctx.autocast):
            return PlannedContraction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: torch.Tensor):
        plan: ContractionPlan = ctx.plan
        ops = ctx.saved_tensors
        wants_bias = ctx.has_bias and ctx.needs_input_grad[1]
        if ctx.program is not None:
            run = ctx.program.backward(tuple(ctx.needs_input_grad[2:]), wants_bias)
            grads, g_bias = run(ops, grad_out, gemm_for(grad_out))
            return (None, g_bias, *grads)
        n = ctx.n_inputs
        # which SSA values need gradients: inputs that require them, and results built from those
        want = list(ctx.needs_input_grad[2:]) + [False] * len(plan.steps)
        for k, s in enumerate(plan.steps):
            want[n + k] = want[s.a] or want[s.b]
        grads: list[torch.Tensor | None] = [None] * (n + len(plan.steps))
        g = grad_out
        if plan.out_perm is not None:
            inverse = [plan.out_perm.index(i) for i in range(len(plan.out_perm))]
            g = g.permute(inverse)
        grads[-1] = g
        g_bias = None
        for k in range(len(plan.steps) - 1, -1, -1):
            s = plan.steps[k]
            gc = grads[n + k]
            if gc is None:
                continue
            grads[n + k] = None  # free as we go
            if want[s.a]:
                g_a = pairwise(gc, s.grad_a_c_axes, ops[s.b], s.grad_a_b_axes)
                grads[s.a] = g_a if s.grad_a_perm is None else g_a.permute(s.grad_a_perm)
            if want[s.b]:
                if k == len(plan.steps) - 1 and wants_bias and plan.bias_fusable:
                    g_b, g_bias = grad_with_bias(ops[s.a], s.grad_b_a_axes, gc, s.grad_b_c_axes)
                else:
                    g_b = pairwise(ops[s.a], s.grad_b_a_axes, gc, s.grad_b_c_axes)
                grads[s.b] = g_b if s.grad_b_perm is None else g_b.permute(s.grad_b_perm)
        if wants_bias and g_bias is None:
            g_bias = column_sums(grad_out)
        return (None, g_bias, *grads[:n])


def is_merge_first(plan: ContractionPlan) -> bool:
    """Whether ``plan`` touches the rows in exactly two steps, ``x A`` with ``A`` all the
    input cores merged, then ``(x A) B`` with ``B`` all the output cores merged, giving
    ``(rows, out modes...)`` in order -- so :func:`thin_pair` with the network's merged
    factors runs the same products."""
    batch, steps = plan.batch, plan.steps
    if batch is None or plan.out_perm is not None or not steps or not plan.inputs:
        return False
    row_steps = [k for k, s in enumerate(steps) if batch in s.c_idx]
    if len(row_steps) != 2 or row_steps[1] != len(steps) - 1:
        return False
    first, second = steps[row_steps[0]], steps[row_steps[1]]
    in_modes = tuple(x for x in plan.inputs[0] if x != batch)
    out_modes = tuple(x for x in plan.output if x != batch)
    if first.a != 0 or first.a_idx != (batch, *in_modes):
        return False
    if len(first.b_idx) != len(in_modes) + 1 or first.b_idx[:-1] != in_modes:
        return False
    bond = first.b_idx[-1]
    if first.c_idx != (batch, bond):
        return False
    return (second.a == len(plan.inputs) + row_steps[0] and second.a_idx == (batch, bond)
            and second.b_idx == (bond, *out_modes) and second.c_idx == plan.output == (batch, *out_modes))


class _ThinPair(torch.autograd.Function):
    """``x A B + bias`` with the factors given: a merge-cores-first plan's two row-wide
    steps, on the same GEMMs as the plan's generated code."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None):
        mm = gemm_for(x)
        ctx.autocast = autocast_state(x.device.type)
        cast = run_dtype(x, ctx.autocast)
        if cast is not None:  # under autocast: the rows and A cast once, kept so for backward
            x, a = x.to(cast), a.to(cast)
        t = mm(x, a)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, a, t, b)
        return gemm_bias(t, b, bias) if bias is not None else mm(t, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, a, t, b = ctx.saved_tensors
        need_x, need_a, need_b, need_bias = ctx.needs_input_grad
        with same_autocast(ctx.autocast):
            mm = gemm_for(grad)
            g_t, g_b, g_bias = expand_grads(t, b, grad, need_x or need_a, need_b, need_bias and ctx.has_bias)
            g_x = mm(g_t, a.t()) if need_x else None
            g_a = mm(x.t(), g_t) if need_a else None
        return g_x, g_a, g_b, g_bias


def thin_pair(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ a @ b + bias``, differentiable, as a merge-cores-first plan runs it.

    Shapes: ``x (rows, P_in)``, ``a (P_in, r)``, ``b (r, P_out)``, ``bias (P_out,)`` ->
    ``(rows, P_out)``.
    """
    return _ThinPair.apply(x, a, b, bias)


def contract(plan: ContractionPlan, operands: Sequence[torch.Tensor],
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``plan`` on ``operands`` (differentiable); ``bias`` is added to the
    flattened output (inside the last GEMM when the plan allows).

    Under ``torch.compile`` the steps run as plain ops (autograd derives the
    same reverse-mode backward) so the compiler can trace them.
    """
    if not torch.compiler.is_compiling():
        return PlannedContraction.apply(plan, bias, *operands)
    fused = bias if bias is not None and fuses_bias(plan) else None
    out = finish(plan, _forward(plan, list(operands), fused)[-1])
    if bias is not None and fused is None:
        out = out + bias.reshape(out.shape[1:])
    return out


