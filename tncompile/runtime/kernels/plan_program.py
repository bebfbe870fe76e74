"""Straight-line Python for a contraction plan, generated once and cached on it.

A plan fixes every step's operands, contracted axes and index sizes; only
the number of rows (the batch index) varies within a bucket. The generic
executor re-derives each step's matrix views from the shapes on every call,
about 14 us of Python per step; the generated code has the views as constants,
so a step is a reshape or two and one GEMM. At a few rows, where a TT layer's
cost is all overhead, that is most of the layer's time.

The code is readable (``print(program.source())``), shows up by name in
tracebacks, and is what runs. Example, the forward of a 3-core network::

    def forward(ops, bias, mm):
        o0, o1, o2, o3 = ops
        rows = o0.shape[0]
        o4 = mm(o0.reshape(rows * 8, 8), o1.reshape(8, 40)).reshape(rows, 8, 5, 8)
        ...
"""
from __future__ import annotations

import linecache
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .plans import ContractionPlan

__all__ = ["PlanProgram", "program_for"]

Indices = tuple[str, ...]


class _Writer:
    """Expressions for matrices and shapes of one plan's operands."""

    def __init__(self, sizes: dict[str, int], batch: str | None):
        self.sizes, self.batch = sizes, batch

    def size(self, names: Sequence[str]) -> str:
        static = math.prod(self.sizes[n] for n in names if n != self.batch)
        if self.batch is not None and self.batch in names:
            return "rows" if static == 1 else f"rows * {static}"
        return str(static)

    def shape(self, idx: Indices) -> str:
        return "(" + ", ".join(self.size([x]) for x in idx) + ("," if len(idx) == 1 else "") + ")"

    def matrix(self, var: str, idx: Indices, axes: Sequence[int], contracted_first: bool) -> str:
        """``var`` as ``(contracted, free)`` if ``contracted_first`` else ``(free, contracted)``:
        a view when the contracted axes lead or trail, else one permuted copy."""
        nd, k, axes = len(idx), len(axes), tuple(axes)
        contracted = self.size([idx[a] for a in axes])
        free = self.size([idx[d] for d in range(nd) if d not in axes])
        if axes == tuple(range(k)):
            expr = var if nd == 2 and k == 1 else f"{var}.reshape({contracted}, {free})"
            transpose = not contracted_first
        elif axes == tuple(range(nd - k, nd)):
            expr = var if nd == 2 and k == 1 else f"{var}.reshape({free}, {contracted})"
            transpose = contracted_first
        else:
            perm = ", ".join(str(a) for a in axes + tuple(d for d in range(nd) if d not in axes))
            expr = f"{var}.permute({perm}).reshape({contracted}, {free})"
            transpose = not contracted_first
        return expr + ".t()" if transpose else expr

    def result(self, gemm: str, idx: Indices) -> str:
        """A GEMM's 2-D result reshaped to ``idx`` (no reshape when it already is 2-D)."""
        return gemm if len(idx) == 2 else f"{gemm}.reshape{self.shape(idx)}"


def _free(idx: Indices, axes: Sequence[int]) -> Indices:
    return tuple(x for d, x in enumerate(idx) if d not in tuple(axes))


def _rows_line(plan: ContractionPlan, names: Sequence[str], idxs: Sequence[Indices]) -> list[str]:
    for name, idx in zip(names, idxs):
        if plan.batch is not None and plan.batch in idx:
            return [f"    rows = {name}.shape[{idx.index(plan.batch)}]"]
    return []


def _forward_source(plan: ContractionPlan, w: _Writer) -> str:
    n = len(plan.inputs)
    idx: list[Indices] = list(plan.inputs) + [s.c_idx for s in plan.steps]
    lines = ["def forward(ops, bias, mm):",
             f"    {', '.join(f'o{i}' for i in range(n))}{',' if n == 1 else ''} = ops"]
    lines += _rows_line(plan, [f"o{i}" for i in range(n)], plan.inputs)
    for k, s in enumerate(plan.steps):
        left = w.matrix(f"o{s.a}", s.a_idx, s.a_axes, contracted_first=False)
        right = w.matrix(f"o{s.b}", s.b_idx, s.b_axes, contracted_first=True)
        lines.append(f"    # {' '.join(s.a_idx)} . {' '.join(s.b_idx)} -> {' '.join(s.c_idx)}")
        if k == len(plan.steps) - 1 and plan.bias_fusable:
            lines.append("    if bias is None:")
            lines.append(f"        o{n + k} = {w.result(f'mm({left}, {right})', s.c_idx)}")
            lines.append("    else:")
            lines.append(f"        o{n + k} = {w.result(f'_gemm_bias({left}, {right}, bias)', s.c_idx)}")
        else:
            lines.append(f"    o{n + k} = {w.result(f'mm({left}, {right})', s.c_idx)}")
    lines.append(f"    return [{', '.join(f'o{i}' for i in range(len(idx)))}]")
    return "\n".join(lines) + "\n"


def _is_expand(plan: ContractionPlan, s) -> bool:
    """Whether a bias-fused last step is ``(rows, K) @ (K, outputs...)`` with one
    contracted index: its three gradients then come from one call
    (``_expand_grads``: one pass over the output gradient where kernels allow)."""
    return (plan.bias_fusable and plan.batch is not None and len(s.a_idx) == 2
            and s.a_idx[0] == plan.batch and tuple(s.a_axes) == (1,) and tuple(s.b_axes) == (0,)
            and s.c_idx[0] == plan.batch)


def _expand_grads_lines(s, c: int, w: _Writer, want_a: bool, want_b: bool, wants_bias: bool) -> list[str]:
    left = w.matrix(f"o{s.a}", s.a_idx, s.a_axes, contracted_first=False)                 # (rows, K)
    right = w.matrix(f"o{s.b}", s.b_idx, s.b_axes, contracted_first=True)                 # (K, N)
    grad = w.matrix(f"g{c}", s.c_idx, tuple(range(1, len(s.c_idx))), contracted_first=False)  # (rows, N)
    names = [f"g{s.a}" if want_a else "_", f"g{s.b}" if want_b else "_", "g_bias" if wants_bias else "_"]
    lines = [f"    {', '.join(names)} = _expand_grads({left}, {right}, {grad}, {want_a}, {want_b}, {wants_bias})"]
    if want_a:
        got = _free(s.c_idx, s.grad_a_c_axes) + _free(s.b_idx, s.grad_a_b_axes)
        perm = "" if s.grad_a_perm is None else f".permute({', '.join(map(str, s.grad_a_perm))})"
        if len(got) != 2 or perm:
            lines.append(f"    g{s.a} = g{s.a}.reshape{w.shape(got)}{perm}")
    if want_b:
        got = _free(s.a_idx, s.grad_b_a_axes) + _free(s.c_idx, s.grad_b_c_axes)
        perm = "" if s.grad_b_perm is None else f".permute({', '.join(map(str, s.grad_b_perm))})"
        if len(got) != 2 or perm:
            lines.append(f"    g{s.b} = g{s.b}.reshape{w.shape(got)}{perm}")
    return lines


def _backward_source(plan: ContractionPlan, w: _Writer, want_inputs: tuple[bool, ...],
                     wants_bias: bool) -> str:
    n, last = len(plan.inputs), len(plan.steps) - 1
    want = list(want_inputs) + [False] * len(plan.steps)
    for k, s in enumerate(plan.steps):
        want[n + k] = want[s.a] or want[s.b]
    saved = n + len(plan.steps) - 1
    lines = ["def backward(ops, grad_out, mm):",
             f"    {', '.join(f'o{i}' for i in range(saved))}{',' if saved == 1 else ''} = ops"]
    lines += _rows_line(plan, [f"o{i}" for i in range(n)], plan.inputs)
    if plan.out_perm is not None:
        inverse = [plan.out_perm.index(i) for i in range(len(plan.out_perm))]
        lines.append(f"    g{saved} = grad_out.permute({', '.join(map(str, inverse))})")
    else:
        lines.append(f"    g{saved} = grad_out")
    bias_done = False
    for k in range(last, -1, -1):
        s, c = plan.steps[k], n + k
        if not want[c]:
            continue
        lines.append(f"    # d({' '.join(s.a_idx)} . {' '.join(s.b_idx)})")
        if k == last and _is_expand(plan, s):
            lines += _expand_grads_lines(s, c, w, want[s.a], want[s.b], wants_bias)
            bias_done = wants_bias
            continue
        if want[s.a]:
            left = w.matrix(f"g{c}", s.c_idx, s.grad_a_c_axes, contracted_first=False)
            right = w.matrix(f"o{s.b}", s.b_idx, s.grad_a_b_axes, contracted_first=True)
            got = _free(s.c_idx, s.grad_a_c_axes) + _free(s.b_idx, s.grad_a_b_axes)
            expr = w.result(f"mm({left}, {right})", got)
            if s.grad_a_perm is not None:
                expr += f".permute({', '.join(map(str, s.grad_a_perm))})"
            lines.append(f"    g{s.a} = {expr}")
        if want[s.b]:
            perm = "" if s.grad_b_perm is None else f".permute({', '.join(map(str, s.grad_b_perm))})"
            if k == last and wants_bias and plan.bias_fusable:
                lines.append(f"    g{s.b}, g_bias = _grad_with_bias(o{s.a}, {tuple(s.grad_b_a_axes)}, "
                             f"g{c}, {tuple(s.grad_b_c_axes)})")
                if perm:
                    lines.append(f"    g{s.b} = g{s.b}{perm}")
                bias_done = True
            else:
                left = w.matrix(f"o{s.a}", s.a_idx, s.grad_b_a_axes, contracted_first=False)
                right = w.matrix(f"g{c}", s.c_idx, s.grad_b_c_axes, contracted_first=True)
                got = _free(s.a_idx, s.grad_b_a_axes) + _free(s.c_idx, s.grad_b_c_axes)
                lines.append(f"    g{s.b} = {w.result(f'mm({left}, {right})', got)}{perm}")
        if c != saved:
            lines.append(f"    del g{c}")
    if wants_bias and not bias_done:
        lines.append("    g_bias = _column_sums(grad_out)")
    grads = ", ".join(f"g{i}" if want[i] else "None" for i in range(n))
    lines.append(f"    return ({grads}{',' if n == 1 else ''}), {'g_bias' if wants_bias else 'None'}")
    return "\n".join(lines) + "\n"


def _compile(source: str, name: str, namespace: dict) -> Callable:
    filename = f"<tncompile {name} {abs(hash(source)):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = dict(namespace)
    exec(compile(source, filename, "exec"), scope)
    return scope[name]


@dataclass
class PlanProgram:
    """Generated forward and backward functions of one plan.

    ``forward(ops, bias, mm) -> every SSA value`` (inputs, then each step's
    result); ``backward(want, wants_bias)`` returns (generating it on first
    use) ``f(saved, grad_out, mm) -> (input grads, bias grad)`` for one
    pattern of inputs that need gradients. ``mm`` is the GEMM to use.
    """

    plan: ContractionPlan
    namespace: dict
    forward_source: str
    forward: Callable
    _backward: dict = field(default_factory=dict)

    def backward(self, want: tuple[bool, ...], wants_bias: bool) -> Callable:
        key = (want, wants_bias)
        fn = self._backward.get(key)
        if fn is None:
            source = self.backward_source(want, wants_bias)
            fn = self._backward[key] = _compile(source, "backward", self.namespace)
        return fn

    def backward_source(self, want: tuple[bool, ...], wants_bias: bool) -> str:
        writer = _Writer(self.plan.sizes, self.plan.batch)
        return _backward_source(self.plan, writer, tuple(want), wants_bias)

    def source(self, want: tuple[bool, ...] | None = None, wants_bias: bool = True) -> str:
        """Forward and backward source (backward for ``want``, default: every input)."""
        want = tuple(want) if want is not None else (True,) * len(self.plan.inputs)
        return self.forward_source + "\n\n" + self.backward_source(want, wants_bias)


def program_for(plan: ContractionPlan, namespace: dict) -> PlanProgram | None:
    """The plan's cached program (generated on first use); ``None`` for a plan
    saved before plans recorded their sizes (the generic executor runs it)."""
    program = plan.__dict__.get("_program")
    if program is None:
        if plan.sizes is None:
            return None
        source = _forward_source(plan, _Writer(plan.sizes, plan.batch))
        program = PlanProgram(plan, namespace, source, _compile(source, "forward", namespace))
        plan.__dict__["_program"] = program
    return program
