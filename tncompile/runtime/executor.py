"""Planned executor: run a :class:`~tncompile.runtime.plans.ContractionPlan` pairwise.

Forward: one ``tensordot`` per step (a permute, when needed, and one GEMM).
Backward: reverse mode through the same steps -- the gradient of each step's
operand is the step's output gradient contracted with the other operand --
so the backward is planned by the forward tree and costs about twice the
forward. The autograd ``Function`` saves exactly the step operands the
backward needs and nothing else.
"""
from __future__ import annotations

import contextlib
import math
from functools import lru_cache
from typing import Iterable, Sequence

import torch

from .. import tuning
from .cpu_gemm import cpu_gemm
from .native import kernels_for, traceable_kernels
from .plan_program import program_for
from .plans import ContractionPlan

__all__ = ["contract", "PlannedContraction", "pairwise", "generated_code", "generated_code_dump", "is_merge_first",
           "thin_pair"]


def _compute_layout(ndim: int, axes: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """Where an operand's contracted ``axes`` sit: ``"lead"``, ``"trail"`` or
    ``"other"`` (with the permutation that makes them lead)."""
    k = len(axes)
    if axes == tuple(range(k)):
        return "lead", ()
    if axes == tuple(range(ndim - k, ndim)):
        return "trail", ()
    return "other", tuple(axes) + tuple(d for d in range(ndim) if d not in axes)


_layout = lru_cache(maxsize=None)(_compute_layout)


def _as_matrix(t: torch.Tensor, axes: tuple[int, ...], contracted_first: bool) -> torch.Tensor:
    """``t`` as a 2-D matrix ``(contracted, free)`` if ``contracted_first`` else
    ``(free, contracted)``, as a free view (possibly transposed) whenever the
    contracted axes are already the leading or trailing axes of a contiguous
    tensor; otherwise one permuted copy."""
    where, perm = (_compute_layout if torch.compiler.is_compiling() else _layout)(t.dim(), axes)
    shape = t.shape
    size_k = size_free = 1  # explicit sizes, not -1: an empty batch must reshape too
    for d, n in enumerate(shape):
        if d in axes:
            size_k *= n
        else:
            size_free *= n
    if where == "other" or not t.is_contiguous():
        if where != "other":
            perm = tuple(axes) + tuple(d for d in range(t.dim()) if d not in axes)
        m = t.permute(perm).reshape(size_k, size_free)   # (contracted, free), one copy
        return m if contracted_first else m.t()
    if where == "lead":
        m = t.reshape(size_k, size_free)
        return m if contracted_first else m.t()
    m = t.reshape(size_free, size_k)
    return m.t() if contracted_first else m


def pairwise(a: torch.Tensor, a_axes: Sequence[int], b: torch.Tensor, b_axes: Sequence[int],
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``tensordot(a, b, (a_axes, b_axes))`` -- result axes: a's free then b's free --
    with one GEMM on views wherever the layouts allow (no operand copies).
    ``bias`` (shape: b's free size) is added inside the GEMM (``addmm``)."""
    a_axes, b_axes = tuple(a_axes), tuple(b_axes)
    a_free = [n for d, n in enumerate(a.shape) if d not in a_axes]
    b_free = [n for d, n in enumerate(b.shape) if d not in b_axes]
    left = _as_matrix(a, a_axes, contracted_first=False)
    right = _as_matrix(b, b_axes, contracted_first=True)
    if bias is not None:
        out = _gemm_bias(left, right, bias)
    elif left.device.type == "cpu":
        out = _CpuGemm.apply(left, right) if torch.compiler.is_compiling() else cpu_gemm(left, right)
    else:
        out = left @ right
    return out.reshape(*a_free, *b_free)


class _CpuGemm(torch.autograd.Function):
    """``left @ right`` whose gradients are :func:`cpu_gemm` products too. Under
    ``torch.compile`` the planned steps run as plain ops and autograd derives the
    backward; through this function (traced forward and backward alike) the
    gradient GEMMs get the layouts and native thin kernels the eager executor
    uses, instead of ``mm`` on transposed views."""

    @staticmethod
    def forward(ctx, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(left, right)
        return cpu_gemm(left, right)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        left, right = ctx.saved_tensors
        d_left = cpu_gemm(grad, right.t()) if ctx.needs_input_grad[0] else None
        d_right = cpu_gemm(left.t(), grad) if ctx.needs_input_grad[1] else None
        return d_left, d_right


def _gemm_bias(left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``left @ right + bias``. ``addmm`` first copies the broadcast bias into
    the whole ``M x N`` output (on CPU, a full extra pass over the layer's
    output). When the contracted size ``K`` is small -- the last GEMM of a
    merged-cores plan, ``K`` = a rank -- the bias rides as one more rank
    instead: ``[left, 1] @ [right; bias]``, copying only ``M x (K+1)``."""
    m, k = left.shape
    n = right.shape[1]
    if k <= tuning.THIN_RANK < n and m * n >= tuning.THIN_OUTPUT and left.dtype == right.dtype == bias.dtype:
        native = kernels_for(left) or traceable_kernels(left)
        if native is not None:  # the bias initializes the accumulators: no extra pass, no copy
            return native.thin_expand(left, right, bias)
    if left.device.type != "cpu" or 4 * k >= n or m * n < tuning.BIG_OUTPUT:
        return torch.addmm(bias, left, right)
    ones = left.new_ones(m, 1)
    return torch.cat([left, ones], 1) @ torch.cat([right, bias.to(right.dtype).unsqueeze(0)], 0)


def _column_sums(grad: torch.Tensor) -> torch.Tensor:
    """``grad (rows, outputs...)`` summed over the rows, flattened: a bias's
    gradient (zeros for an empty batch)."""
    return grad.reshape(grad.shape[0], math.prod(grad.shape[1:])).sum(0)


def _grad_with_bias(a: torch.Tensor, a_axes: Sequence[int], grad: torch.Tensor,
                    grad_axes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The last step's right-operand gradient ``A.T @ G`` and the fused bias's
    gradient ``1.T @ G`` from one GEMM over ``G``: ``[A, 1].T @ G``.

    Only for a bias-fused plan's last step, where ``a``'s contracted ``a_axes``
    are exactly the rows, so ``A`` is ``(rows, K)`` and ``grad`` is ``(rows, outputs...)``.
    Reading the layer's output gradient once instead of twice (GEMM, then a
    column sum) saves a full pass over it. Returns ``(g_b (K..., outputs...), g_bias (outputs,))``.
    """
    rows = grad.shape[0]
    if grad.numel() < tuning.BIG_OUTPUT or tuple(grad_axes) != (0,):  # small: the concatenation costs more
        return pairwise(a, a_axes, grad, grad_axes), _column_sums(grad)
    left = _as_matrix(a, tuple(a_axes), contracted_first=True)           # (rows, K)
    k_shape = [n for d, n in enumerate(a.shape) if d not in tuple(a_axes)]
    k = left.shape[1]
    extended = torch.cat([left, left.new_ones(rows, 1)], 1)               # (rows, K+1)
    g_mat = grad.reshape(rows, math.prod(grad.shape[1:]))
    both = cpu_gemm(extended.t(), g_mat) if g_mat.device.type == "cpu" else extended.t() @ g_mat
    return both[:k].reshape(*k_shape, *grad.shape[1:]), both[k]


def _expand_grads(t: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, want_t: bool, want_w: bool,
                  want_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """All gradients of a bias-fused last step ``y = t @ w (+ bias)``:
    ``(grad @ w.T, t.T @ grad, grad's column sums)``, each only if wanted.

    ``t (rows, K)``, ``w (K, N)``, ``grad (rows, N)``. With a thin ``K`` on
    CPU the native kernel computes all three in one pass over ``grad`` (read
    once instead of twice: it is the layer's largest tensor); elsewhere two
    GEMMs as :func:`_grad_with_bias` does.
    """
    rows, k = t.shape
    n = w.shape[1]
    if k <= tuning.THIN_RANK < n and rows * n >= tuning.THIN_OUTPUT and t.dtype == w.dtype == grad.dtype:
        native = kernels_for(grad)
        if native is not None:
            g_t, g_w, g_bias = native.thin_expand_backward(grad, t, w, want_t, want_w, want_bias)
            return (g_t if want_t else None), (g_w if want_w else None), (g_bias if want_bias else None)
    mm = _gemm_for(grad)
    g_t = mm(grad, w.t()) if want_t else None
    g_w = g_bias = None
    if want_w and want_bias and grad.device.type == "cpu" and grad.numel() >= tuning.BIG_OUTPUT:
        g_w, g_bias = _grad_with_bias(t, (0,), grad, (0,))  # [t, 1].T @ grad: one pass for both
    else:  # small: two plain calls cost less than building [t, 1]
        if want_w:
            g_w = mm(t.t(), grad)
        if want_bias:
            g_bias = grad.sum(0)
    return g_t, g_w, g_bias


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


def _finish(plan: ContractionPlan, result: torch.Tensor) -> torch.Tensor:
    return result if plan.out_perm is None else result.permute(plan.out_perm)


def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The autocast setting in force for ``device_type`` (saved by forward);
    disabled for device types autocast does not know (e.g. ``meta``)."""
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except RuntimeError:
        return device_type, False, torch.float32


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


_GENERATED_CODE_NAMESPACE = {"_gemm_bias": _gemm_bias, "_grad_with_bias": _grad_with_bias,
                             "_expand_grads": _expand_grads, "_column_sums": _column_sums, "torch": torch}


def generated_code(plan: ContractionPlan) -> str:
    """The Python the executor runs for ``plan``: its forward and its backward
    (for every input needing a gradient, with a bias)."""
    program = program_for(plan, _GENERATED_CODE_NAMESPACE)
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


def _gemm_for(t: torch.Tensor):
    return cpu_gemm if t.device.type == "cpu" else torch.mm


class PlannedContraction(torch.autograd.Function):
    """Contract ``operands`` along ``plan``; backward by reverse mode over the steps.

    Runs the plan's generated straight-line code (:mod:`.plan_program`);
    plans saved without their sizes run through the generic step loop."""

    @staticmethod
    def forward(ctx, plan: ContractionPlan, bias: torch.Tensor | None, *operands: torch.Tensor) -> torch.Tensor:
        program = program_for(plan, _GENERATED_CODE_NAMESPACE)
        fused = bias if plan.bias_fusable else None
        if program is not None:
            ops = program.forward(operands, fused, _gemm_for(operands[0]))
        else:
            ops = _forward(plan, list(operands), fused)
        ctx.program = program
        ctx.autocast = autocast_state(operands[0].device.type)
        ctx.plan = plan
        ctx.n_inputs = len(operands)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(*ops[:-1])  # every step operand; the final result is not needed
        out = _finish(plan, ops[-1])
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
            grads, g_bias = run(ops, grad_out, _gemm_for(grad_out))
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
                    g_b, g_bias = _grad_with_bias(ops[s.a], s.grad_b_a_axes, gc, s.grad_b_c_axes)
                else:
                    g_b = pairwise(ops[s.a], s.grad_b_a_axes, gc, s.grad_b_c_axes)
                grads[s.b] = g_b if s.grad_b_perm is None else g_b.permute(s.grad_b_perm)
        if wants_bias and g_bias is None:
            g_bias = _column_sums(grad_out)
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
        mm = _gemm_for(x)
        t = mm(x, a)
        ctx.has_bias = bias is not None
        ctx.autocast = autocast_state(x.device.type)
        ctx.save_for_backward(x, a, t, b)
        return _gemm_bias(t, b, bias) if bias is not None else mm(t, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, a, t, b = ctx.saved_tensors
        need_x, need_a, need_b, need_bias = ctx.needs_input_grad
        with same_autocast(ctx.autocast):
            mm = _gemm_for(grad)
            g_t, g_b, g_bias = _expand_grads(t, b, grad, need_x or need_a, need_b, need_bias and ctx.has_bias)
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
    same reverse-mode backward) so the compiler can trace them, or, with
    ``tuning.TRACE_CONTRACTION_AS_ONE_OP``, as one opaque custom op each way
    (:mod:`.traced_contract`).
    """
    if not torch.compiler.is_compiling():
        return PlannedContraction.apply(plan, bias, *operands)
    if plan.sizes is not None and tuning.TRACE_CONTRACTION_AS_ONE_OP:  # one opaque op each way
        # a plan fetched while tracing (TNModule.plan_for) carries its registry key
        return traced_contract(list(operands), bias, plan._traced_key)[0]
    fused = bias if bias is not None and fuses_bias(plan) else None
    out = _finish(plan, _forward(plan, list(operands), fused)[-1])
    if bias is not None and fused is None:
        out = out + bias.reshape(out.shape[1:])
    return out


# the traced form of contract() builds on the names above (it imports them from here)
from .traced_contract import traced_contract  # noqa: E402
