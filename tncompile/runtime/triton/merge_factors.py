"""The merged factors of a batch of same-layout TT networks in a few Triton launches, gates folded in.

A TT linear runs ``x A B``: ``A (M, R)`` merges its input cores, ``B (R, N)`` its output
cores, each core but the last scaled along its right bond by its rank gate
(:func:`~tncompile.formats.factorization.tt_factors`). The layers of a model that share their
modes merge together (:mod:`tncompile.runtime.layers.factor_groups`); through PyTorch ops a
batch costs ~20 kernels forward and ~30 backward (a stack per core and gate, a product per
gate, a batched product per core, sums). Here it costs 3 forward and 4 backward for
networks of 3 + 3 cores (a copy each way, then the launches below).

Every step of both chains is one small matrix product per network, ``OUT = (L g) R g'``, a
gate optionally scaling ``L``'s contracted dimension and one scaling ``OUT``'s rows or
columns; all operands live in two flat workspaces, the batch's stacked cores and gates
first. One launch runs one step of every network on both sides (a table of tasks, one row
each, in :class:`MergePlan`); one more finishes the gates' gradients. A :class:`JointPlan`
runs several batches -- a model's families of layers -- in the same launches, their
workspaces laid end to end and each task made once per network with absolute offsets. With ``P_k`` the
running product of the first ``k + 1`` input cores and ``Q_k`` that of the output cores
from ``k`` on:

* forward: ``P_k = (P_{k-1} G_k) g_k`` (``P_0 = G_0 g_0``, read from the core), and
  ``Q_k = (G_k g_k) Q_{k+1}`` (``Q_{d-1} = G_{d-1}``); ``A = P_{n_in-1}``, ``B = Q_{n_in}``;
* backward, from ``dA`` and ``dB``: ``dP_{k-1} = (dP_k g_k) G_k^T`` and
  ``dQ_{k+1} = g_k G_k^T dQ_k``, one launch per step, each launch also making the
  gradients ``E_k`` of the gated cores whose ``dP_k`` / ``dQ_k`` is ready (``P_{k-1}^T dP_k``,
  ``dQ_k Q_{k+1}^T``); then ``dG_k = E_k g_k`` and ``dg_k = sum(G_k E_k)`` over all but the
  bond, every core in one launch (column sums in one program each: deterministic, no atomics).

``tncompile::merge_factors_`` and ``tncompile::merge_factors_backward_`` are
``torch.library`` custom ops that fill caller-allocated workspaces (fake kernels: nothing
to compute), so a dry run on fake tensors and CUDA-graph capture see the same calls. Runs
compiled on CUDA, through Triton's interpreter on the CPU under ``TRITON_INTERPRET=1``, and
through the same task table in PyTorch ops otherwise (:func:`_run_tasks_torch`: what
tests compare against, and what runs without Triton). Products accumulate in float32
(float64 for float64 networks).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .device_ops import direct
from .thin_pair import interpreting, triton_available

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

__all__ = ["MergePlan", "JointPlan", "merge_plan", "joint_plan", "plan_of", "merge_forward", "merge_backward", "merge_forward_op",
           "merge_backward_op", "supports"]

#: task table columns (int64): left, right, out (offset, per-network stride, row stride,
#: column stride each); the product's M, K, N; a gate on the contracted dim (offset or -1,
#: per-network stride, period); a gate on the output (offset or -1, per-network stride,
#: period, axis: 0 rows, 1 columns); which workspace left and right are in (0: the first
#: a launch is given, 1: the second); 1 where the task copies left (gated) instead of multiplying
FIELDS = 25
BLOCK = 32


@dataclass(frozen=True)
class Operand:
    """A 2-D operand of network ``m`` at ``offset + m * stride``, element ``(i, j)`` at
    ``+ i * row + j * col`` in its workspace."""
    offset: int
    stride: int
    row: int
    col: int

    def t(self) -> "Operand":
        return Operand(self.offset, self.stride, self.col, self.row)


def _task(left: Operand, right: Operand, out: Operand, m: int, k: int, n: int,
          gate_k: tuple[int, int, int] | None = None, gate_out: tuple[int, int, int, int] | None = None,
          buffers: tuple[int, int] = (0, 0), copy: bool = False) -> list[int]:
    gk = gate_k or (-1, 0, 1)
    go = gate_out or (-1, 0, 1, 0)
    return [left.offset, left.stride, left.row, left.col, right.offset, right.stride, right.row, right.col,
            out.offset, out.stride, out.row, out.col, m, k, n, *gk, *go, *buffers, int(copy)]


class _Regions:
    """Consecutive per-network blocks of a workspace: ``add(size)`` -> offset (block of ``n * size``)."""

    def __init__(self, n: int, start: int = 0):
        self.n, self.end = n, start

    def add(self, size: int) -> int:
        offset = self.end
        self.end += self.n * size
        return offset


class MergePlan:
    """Where each tensor of one batch's merge lives, and the task table of each launch.

    Parameters
    ----------
    n : int
        Networks in the batch.
    n_in : int
        Input cores (``A`` merges cores ``0 .. n_in - 1``); at least one on each side
        (:func:`supports`; a side of one core is copied out, gated).
    cores : list of (r_prev, s, r_next)
        Each core's (padded) shape.
    placement : list of (offset, stride)
        Where the stacked cores, then the ``d - 1`` gates, lie in the forward workspace:
        network ``m``'s core ``k`` at ``offset + m * stride``, contiguous.
    params : int
        Elements the stacked cores and gates take at the workspace's start.
    """

    def __init__(self, n: int, n_in: int, cores: Sequence[tuple[int, int, int]],
                 placement: Sequence[tuple[int, int]], params: int):
        d = len(cores)
        self.n, self.n_in, self.d = n, n_in, d
        self.cores = [tuple(c) for c in cores]
        self.m = math.prod(c[1] for c in cores[:n_in])
        self.n_out = math.prod(c[1] for c in cores[n_in:])
        self.r = cores[n_in - 1][2]
        self.core_at = [Operand(off, st, 0, 0) for off, st in placement[:d]]
        self.gate_at = [(off, st) for off, st in placement[d:]]
        self._forward_workspace(params)
        self._backward_workspace()
        steps = max(n_in, d - n_in) - 1
        self.forward = [[] for _ in range(max(steps, 1))]
        self.backward = [[] for _ in range(steps)]
        self._forward_tasks()
        self._backward_tasks()
        self._gradient_tasks()
        # dG_k = E_k g_k and dg_k = column sums of G_k E_k, every gated core: (E, G, gate, dg, rows, r)
        self.finish = [[self.e_at[k], math.prod(cores[k]), self.core_at[k].offset, self.core_at[k].stride,
                        *self.gate_at[k], self.dg_at[k], cores[k][2], cores[k][0] * cores[k][1], cores[k][2]]
                       for k in range(d - 1)]
        self._tables: dict = {}

    def _rows(self, k: int) -> int:
        """Rows of ``P_k``: the product of the first ``k + 1`` cores' modes."""
        return math.prod(c[1] for c in self.cores[:k + 1])

    def _cols(self, k: int) -> int:
        """Columns of ``Q_k``: the product of the modes of cores ``k ..``."""
        return math.prod(c[1] for c in self.cores[k:])

    def _forward_workspace(self, params: int) -> None:
        """``P_k`` (``k >= 1``; ``P_0`` is the core) and ``Q_k`` (``k < d - 1``) after the params."""
        cores, n_in, d = self.cores, self.n_in, self.d
        work = _Regions(self.n, params)
        self.prefix = [None] * n_in
        for k in range(0 if n_in == 1 else 1, n_in):      # a one-core side's factor is a copy
            self.prefix[k] = work.add(self._rows(k) * cores[k][2])
        self.suffix = [None] * d
        for k in range(d - 1 if n_in == d - 1 else d - 2, n_in - 1, -1):
            self.suffix[k] = work.add(cores[k][0] * self._cols(k))
        self.work_size = work.end
        self.a_offset, self.b_offset = self.prefix[n_in - 1], self.suffix[n_in]

    def _backward_workspace(self) -> None:
        """``dA`` and ``dB`` first (the incoming gradients), each core's ``E_k`` (then
        ``dG_k``), each gate's ``dg_k``, and the chains' ``dP_k`` / ``dQ_k`` (``dP_0`` is
        ``E_0``, ``dQ_{d-1}`` is ``E_{d-1}``)."""
        cores, n_in, d = self.cores, self.n_in, self.d
        grad = _Regions(self.n)
        self.da_offset = grad.add(self.m * self.r)
        self.db_offset = grad.add(self.r * self.n_out)
        self.incoming = grad.end
        self.e_at = [grad.add(math.prod(c)) for c in cores]
        if n_in == 1:           # a one-core side: its factor's gradient is its core's (gated)
            self.e_at[0] = self.da_offset
        if n_in == d - 1:
            self.e_at[d - 1] = self.db_offset
        self.dg_at = [grad.add(cores[k][2]) for k in range(d - 1)]
        self.d_prefix = [None] * n_in
        for k in range(1, n_in - 1):
            self.d_prefix[k] = grad.add(self._rows(k) * cores[k][2])
        self.d_prefix[0], self.d_prefix[n_in - 1] = self.e_at[0], self.da_offset
        self.d_suffix = [None] * d
        for k in range(n_in + 1, d - 1):
            self.d_suffix[k] = grad.add(cores[k][0] * self._cols(k))
        self.d_suffix[n_in], self.d_suffix[d - 1] = self.db_offset, self.e_at[d - 1]
        self.grad_size = grad.end

    def _p(self, k: int) -> tuple[Operand, int, int]:
        """``P_k`` as an operand, its rows and columns (``P_0``: core 0 as ``(s_0, r_0)``)."""
        rows, cols = self._rows(k), self.cores[k][2]
        if k == 0:
            return Operand(self.core_at[0].offset, self.core_at[0].stride, cols, 1), rows, cols
        return Operand(self.prefix[k], rows * cols, cols, 1), rows, cols

    def _q(self, k: int) -> tuple[Operand, int, int]:
        """``Q_k`` as an operand ``(r_{k-1}, prod s_>=k)`` (``Q_{d-1}``: the last core)."""
        rows, cols = self.cores[k][0], self._cols(k)
        if k == self.d - 1:
            return Operand(self.core_at[k].offset, self.core_at[k].stride, cols, 1), rows, cols
        return Operand(self.suffix[k], rows * cols, cols, 1), rows, cols

    def _core(self, k: int, cols: int) -> Operand:
        """Core ``k`` as a row-major matrix of ``cols`` columns."""
        return Operand(self.core_at[k].offset, self.core_at[k].stride, cols, 1)

    def _forward_tasks(self) -> None:
        """Launch ``j`` makes ``P_{1+j}`` and ``Q_{d-2-j}`` (a one-core side's factor, its core
        gated, in launch 0)."""
        cores, n_in, d, gate = self.cores, self.n_in, self.d, self.gate_at
        if n_in == 1:                           # A = G_0 g_0
            s, r = cores[0][1], cores[0][2]
            self.forward[0].append(_task(self._core(0, r), Operand(0, 0, 0, 0), Operand(self.prefix[0], s * r, r, 1),
                                         s, 1, r, gate_out=(*gate[0], r, 1), copy=True))
        if n_in == d - 1:                       # B = G_{d-1}
            r, s = cores[d - 1][0], cores[d - 1][1]
            self.forward[0].append(_task(self._core(d - 1, s), Operand(0, 0, 0, 0),
                                         Operand(self.suffix[d - 1], r * s, s, 1), r, 1, s, copy=True))
        for k in range(1, n_in):                # P_k = (P_{k-1} G_k) g_k; P_0 = G_0 g_0, gated as it is read
            left, rows, r_prev = self._p(k - 1)
            s, r = cores[k][1], cores[k][2]
            out = Operand(self.prefix[k], rows * s * r, s * r, 1)
            g0 = (*gate[0], r_prev) if k == 1 else None
            self.forward[k - 1].append(_task(left, self._core(k, s * r), out, rows, r_prev, s * r,
                                             gate_k=g0, gate_out=(*gate[k], r, 1)))
        for k in range(d - 2, n_in - 1, -1):    # Q_k = (G_k g_k) Q_{k+1}
            right, r, cols = self._q(k + 1)
            r_prev, s = cores[k][0], cores[k][1]
            out = Operand(self.suffix[k], r_prev * s * cols, cols, 1)
            self.forward[d - 2 - k].append(_task(self._core(k, r), right, out, r_prev * s, r, cols,
                                                 gate_k=(*gate[k], r)))

    def _backward_tasks(self) -> None:
        """Launch ``j`` makes ``dP_{n_in-2-j}`` and ``dQ_{n_in+1+j}`` (left operand in the
        gradients' workspace, right in the forward's)."""
        cores, n_in, d, gate = self.cores, self.n_in, self.d, self.gate_at
        for k in range(n_in - 1, 0, -1):        # dP_{k-1} = (dP_k g_k) G_k^T
            _, rows, r_prev = self._p(k - 1)
            s, r = cores[k][1], cores[k][2]
            d_in = Operand(self.d_prefix[k], rows * s * r, s * r, 1)
            out = Operand(self.d_prefix[k - 1], rows * r_prev, r_prev, 1)
            self.backward[n_in - 1 - k].append(_task(d_in, self._core(k, s * r).t(), out, rows, s * r, r_prev,
                                                     gate_k=(*gate[k], r), buffers=(1, 0)))
        for k in range(n_in, d - 1):            # dQ_{k+1}^T = dQ_k^T (G_k g_k), written transposed
            r_prev, s, r = cores[k]
            cols = self._cols(k + 1)
            d_in = Operand(self.d_suffix[k], r_prev * s * cols, cols, 1).t()      # (cols, r_prev s)
            out = Operand(self.d_suffix[k + 1], r * cols, cols, 1).t()            # (cols, r)
            self.backward[k - n_in].append(_task(d_in, self._core(k, r), out, cols, r_prev * s, r,
                                                 gate_out=(*gate[k], r, 1), buffers=(1, 0)))

    def _gradient_tasks(self) -> None:
        """Each gated core's gradient ``E_k``, in the first backward launch after its
        ``dP_k`` / ``dQ_k`` is made (left operand in the forward's workspace)."""
        cores, n_in, d, gate = self.cores, self.n_in, self.d, self.gate_at
        for k in range(1, n_in):                # E_k = P_{k-1}^T dP_k  (P_0 = G_0 g_0: rows gated)
            left, rows, r_prev = self._p(k - 1)
            s, r = cores[k][1], cores[k][2]
            d_in = Operand(self.d_prefix[k], rows * s * r, s * r, 1)
            out = Operand(self.e_at[k], r_prev * s * r, s * r, 1)
            g0 = (*gate[0], r_prev, 0) if k == 1 else None
            self.backward[n_in - 1 - k].append(_task(left.t(), d_in, out, r_prev, rows, s * r, gate_out=g0,
                                                     buffers=(0, 1)))
        for k in range(n_in, d - 1):            # E_k^T = Q_{k+1} dQ_k^T, written transposed
            right, r, cols = self._q(k + 1)
            r_prev, s = cores[k][0], cores[k][1]
            d_in = Operand(self.d_suffix[k], r_prev * s * cols, cols, 1).t()      # (cols, r_prev s)
            out = Operand(self.e_at[k], r_prev * s * r, r, 1).t()                 # (r, r_prev s)
            self.backward[k - n_in].append(_task(right, d_in, out, r, cols, r_prev * s, buffers=(0, 1)))

    def tables(self, device: torch.device) -> dict[str, list[Tensor] | Tensor]:
        """The task tables as int64 tensors on ``device`` (made once per device)."""
        return _device_tables(self, device)

    def factors(self, work: Tensor) -> tuple[Tensor, Tensor]:
        """``A (n, M, R)`` and ``B (n, R, N)``: views of the forward workspace."""
        n = self.n
        return (work[self.a_offset: self.a_offset + n * self.m * self.r].view(n, self.m, self.r),
                work[self.b_offset: self.b_offset + n * self.r * self.n_out].view(n, self.r, self.n_out))

    def factor_grads(self, grad: Tensor) -> tuple[Tensor, Tensor]:
        """``dA`` and ``dB`` (shaped as :meth:`factors`): views of the backward workspace's start."""
        n = self.n
        return (grad[self.da_offset: self.da_offset + n * self.m * self.r].view(n, self.m, self.r),
                grad[self.db_offset: self.db_offset + n * self.r * self.n_out].view(n, self.r, self.n_out))

    def network_grads(self, grad: Tensor) -> list[Tensor]:
        """Every core's gradient ``(n, *core)``, then every gate's ``(n, r)``: views of the
        backward workspace after :func:`merge_backward`."""
        n = self.n
        cores = [grad[self.e_at[k]: self.e_at[k] + n * math.prod(c)].view(n, *c) for k, c in enumerate(self.cores)]
        gates = [grad[self.dg_at[k]: self.dg_at[k] + n * self.cores[k][2]].view(n, self.cores[k][2])
                 for k in range(self.d - 1)]
        return cores + gates


def _device_tables(plan, device: torch.device) -> dict[str, list[Tensor] | Tensor]:
    """``plan``'s task tables as int64 tensors on ``device``, made once per device."""
    if device not in plan._tables:
        def table(rows):
            return torch.tensor(rows, dtype=torch.int64, device=device) if rows else None
        plan._tables[device] = {"forward": [table(t) for t in plan.forward],
                                "backward": [table(t) for t in plan.backward], "finish": table(plan.finish)}
    return plan._tables[device]


def _absolute(rows: list[list[int]], n: int, work_base: int, grad_base: int, out_base: int) -> list[list[int]]:
    """Task rows of an ``n``-network plan as rows of a one-network launch: each row once per
    network, its operands' offsets absolute (``+ m * stride``, the stride then 0) and
    moved by the plan's place in joint workspaces (``work_base`` for an operand in the
    first buffer or a gate, ``grad_base`` for one in the second, ``out_base`` for the
    result)."""
    base = (work_base, grad_base)
    out = []
    for r in rows:
        for m in range(n):
            t = list(r)
            t[0], t[1] = r[0] + m * r[1] + base[r[22]], 0
            t[4], t[5] = r[4] + m * r[5] + base[r[23]], 0
            t[8], t[9] = r[8] + m * r[9] + out_base, 0
            for at in (15, 18):                # gates (in the forward workspace), -1: none
                if r[at] >= 0:
                    t[at], t[at + 1] = r[at] + m * r[at + 1] + work_base, 0
            out.append(t)
    return out


class JointPlan:
    """Several batches' merges as one: their workspaces laid end to end, each launch running
    one step of every batch (tasks made per network, :func:`_absolute`), so a model's
    families of layers merge in as many launches as one family does.

    ``work_at[i]`` / ``grad_at[i]``: where batch ``i``'s forward / backward workspace
    starts in the joint ones (each laid out as its own :class:`MergePlan` says)."""

    def __init__(self, plans: Sequence[MergePlan]):
        self.parts, self.n = list(plans), 1
        self.work_at, self.grad_at = [], []
        work = grad = 0
        for plan in self.parts:
            self.work_at.append(work)
            self.grad_at.append(grad)
            work, grad = work + plan.work_size, grad + plan.grad_size
        self.work_size, self.grad_size = work, grad
        steps = max(len(p.forward) for p in self.parts)
        self.forward = [[t for p, w in zip(self.parts, self.work_at) if j < len(p.forward)
                         for t in _absolute(p.forward[j], p.n, w, w, w)] for j in range(steps)]
        steps = max(len(p.backward) for p in self.parts)
        self.backward = [[t for p, w, g in zip(self.parts, self.work_at, self.grad_at) if j < len(p.backward)
                          for t in _absolute(p.backward[j], p.n, w, g, g)] for j in range(steps)]
        self.finish = [[r[0] + m * r[1] + g, 0, r[2] + m * r[3] + w, 0, r[4] + m * r[5] + w, 0,
                        r[6] + m * r[7] + g, 0, *r[8:]]
                       for p, w, g in zip(self.parts, self.work_at, self.grad_at) for r in p.finish for m in range(p.n)]
        self._tables: dict = {}

    def tables(self, device: torch.device) -> dict[str, list[Tensor] | Tensor]:
        return _device_tables(self, device)


def supports(n_in: int, d: int) -> bool:
    """Whether a batch merges here: at least one core on each side."""
    return 1 <= n_in < d


_PLANS: dict[tuple, int] = {}
_BY_KEY: list[MergePlan] = []


def merge_plan(n: int, n_in: int, cores: Sequence[tuple[int, int, int]], placement: Sequence[tuple[int, int]],
               params: int) -> tuple[int, MergePlan]:
    """``(key, plan)`` for a batch of this shape (made once; the key names it to the custom ops)."""
    signature = (n, n_in, tuple(map(tuple, cores)), tuple(map(tuple, placement)), params)
    key = _PLANS.get(signature)
    if key is None:
        key = _PLANS[signature] = len(_BY_KEY)
        _BY_KEY.append(MergePlan(n, n_in, cores, placement, params))
    return key, _BY_KEY[key]


def joint_plan(keys: Sequence[int]) -> tuple[int, JointPlan]:
    """``(key, plan)`` merging the batches of plans ``keys`` together (made once)."""
    signature = ("joint", *keys)
    key = _PLANS.get(signature)
    if key is None:
        key = _PLANS[signature] = len(_BY_KEY)
        _BY_KEY.append(JointPlan([_BY_KEY[k] for k in keys]))
    return key, _BY_KEY[key]


def plan_of(key: int) -> MergePlan | JointPlan:
    """The plan :func:`merge_plan` or :func:`joint_plan` gave ``key``."""
    return _BY_KEY[key]


# ---------------------------------------------------------------- kernels
def _tasks_kernel(first_ptr, second_ptr, out_ptr, gate_ptr, table_ptr,
                  FIELDS: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tile, net, task = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = table_ptr + task * FIELDS
    m, k, n = tl.load(row + 12), tl.load(row + 13), tl.load(row + 14)
    tiles_n = tl.cdiv(n, BN)
    if tile < tl.cdiv(m, BM) * tiles_n:
        if tl.load(row + 22) == 0:
            l_at = first_ptr + tl.load(row + 0) + net * tl.load(row + 1)
        else:
            l_at = second_ptr + tl.load(row + 0) + net * tl.load(row + 1)
        l_rs, l_cs = tl.load(row + 2), tl.load(row + 3)
        if tl.load(row + 23) == 0:
            r_at = first_ptr + tl.load(row + 4) + net * tl.load(row + 5)
        else:
            r_at = second_ptr + tl.load(row + 4) + net * tl.load(row + 5)
        r_rs, r_cs = tl.load(row + 6), tl.load(row + 7)
        o_at = out_ptr + tl.load(row + 8) + net * tl.load(row + 9)
        o_rs, o_cs = tl.load(row + 10), tl.load(row + 11)
        gk_off, go_off = tl.load(row + 15), tl.load(row + 18)
        rows = (tile // tiles_n) * BM + tl.arange(0, BM)
        cols = (tile % tiles_n) * BN + tl.arange(0, BN)
        if tl.load(row + 24) == 1:   # a copy of left (M x N)
            acc = tl.load(l_at + rows[:, None] * l_rs + cols[None, :] * l_cs,
                          mask=(rows[:, None] < m) & (cols[None, :] < n), other=0.0).to(ACC)
        else:
            acc = tl.zeros((BM, BN), dtype=ACC)
            for k0 in range(0, k, BK):
                ks = k0 + tl.arange(0, BK)
                lhs = tl.load(l_at + rows[:, None] * l_rs + ks[None, :] * l_cs,
                              mask=(rows[:, None] < m) & (ks[None, :] < k), other=0.0).to(ACC)
                if gk_off >= 0:
                    gk = tl.load(gate_ptr + gk_off + net * tl.load(row + 16) + ks % tl.load(row + 17),
                                 mask=ks < k, other=0.0).to(ACC)
                    lhs = lhs * gk[None, :]
                rhs = tl.load(r_at + ks[:, None] * r_rs + cols[None, :] * r_cs,
                              mask=(ks[:, None] < k) & (cols[None, :] < n), other=0.0).to(ACC)
                acc += tl.dot(lhs, rhs, input_precision="ieee", out_dtype=ACC)
        if go_off >= 0:
            g_at = gate_ptr + go_off + net * tl.load(row + 19)
            period = tl.load(row + 20)
            if tl.load(row + 21) == 1:
                acc = acc * tl.load(g_at + cols % period, mask=cols < n, other=0.0).to(ACC)[None, :]
            else:
                acc = acc * tl.load(g_at + rows % period, mask=rows < m, other=0.0).to(ACC)[:, None]
        tl.store(o_at + rows[:, None] * o_rs + cols[None, :] * o_cs, acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < m) & (cols[None, :] < n))


def _finish_kernel(grad_ptr, work_ptr, table_ptr, FIELDS: tl.constexpr, ACC: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    tile, net, task = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = table_ptr + task * FIELDS
    rows_n, cols_n = tl.load(row + 8), tl.load(row + 9)
    cols = tile * BN + tl.arange(0, BN)
    if tile * BN < cols_n:
        e_at = grad_ptr + tl.load(row + 0) + net * tl.load(row + 1)
        c_at = work_ptr + tl.load(row + 2) + net * tl.load(row + 3)
        g = tl.load(work_ptr + tl.load(row + 4) + net * tl.load(row + 5) + cols, mask=cols < cols_n, other=0.0).to(ACC)
        total = tl.zeros((BN,), dtype=ACC)
        for r0 in range(0, rows_n, BM):
            rows = r0 + tl.arange(0, BM)
            mask = (rows[:, None] < rows_n) & (cols[None, :] < cols_n)
            at = rows[:, None] * cols_n + cols[None, :]
            e = tl.load(e_at + at, mask=mask, other=0.0).to(ACC)
            total += tl.sum(e * tl.load(c_at + at, mask=mask, other=0.0).to(ACC), axis=0)
            tl.store(e_at + at, (e * g[None, :]).to(grad_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_ptr + tl.load(row + 6) + net * tl.load(row + 7) + cols, total.to(grad_ptr.dtype.element_ty),
                 mask=cols < cols_n)


@functools.cache
def _compiled(name: str, device_type: str):
    fn = {"tasks": _tasks_kernel, "finish": _finish_kernel}[name]
    if device_type == "cuda":
        return triton.jit(fn)
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(fn)


def _runs_triton(t: Tensor) -> bool:
    return triton_available() and (t.is_cuda or (t.device.type == "cpu" and interpreting())) \
        and t.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _acc(t: Tensor):
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def _launch_tasks(rows: list[list[int]], table: Tensor, first: Tensor, second: Tensor, out: Tensor, gates: Tensor,
                  n: int) -> None:
    """One launch of the task table ``rows`` (``table`` on the device): operands in ``first``
    or ``second`` as each task says, results into ``out``."""
    if _runs_triton(out):
        tiles = max(triton.cdiv(r[12], BLOCK) * triton.cdiv(r[14], BLOCK) for r in rows)
        _compiled("tasks", out.device.type)[(tiles, n, len(rows))](
            first, second, out, gates, table, FIELDS=FIELDS, ACC=_acc(out), BM=BLOCK, BN=BLOCK, BK=BLOCK)
    else:
        _run_tasks_torch(rows, first, second, out, gates, n)


def _view(buffer: Tensor, op: Operand, n: int, rows: int, cols: int) -> Tensor:
    return buffer.as_strided((n, rows, cols), (op.stride, op.row, op.col), buffer.storage_offset() + op.offset)


def _run_tasks_torch(rows: list[list[int]], first: Tensor, second: Tensor, out: Tensor, gates: Tensor,
                     n: int) -> None:
    """The task table in PyTorch ops: each task a batched product over the ``n`` networks
    (every task reads what earlier launches wrote, as a launch's programs do)."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    for r in rows:
        m, k, cols = r[12], r[13], r[14]
        left, right = (second if r[22] else first), (second if r[23] else first)
        if r[24]:   # a copy of left
            prod = _view(left, Operand(*r[0:4]), n, m, cols).to(acc)
        else:
            lhs = _view(left, Operand(*r[0:4]), n, m, k).to(acc)
            if r[15] >= 0:
                g = gates.as_strided((n, r[17]), (r[16], 1), gates.storage_offset() + r[15]).to(acc)
                lhs = lhs * g.repeat(1, k // r[17])[:, None, :]
            prod = torch.bmm(lhs, _view(right, Operand(*r[4:8]), n, k, cols).to(acc))
        if r[18] >= 0:
            g = gates.as_strided((n, r[20]), (r[19], 1), gates.storage_offset() + r[18]).to(acc)
            prod = prod * (g.repeat(1, cols // r[20])[:, None, :] if r[21] == 1 else g.repeat(1, m // r[20])[:, :, None])
        _view(out, Operand(*r[8:12]), n, m, cols).copy_(prod)


def _finish_torch(rows: list[list[int]], grad: Tensor, work: Tensor, n: int) -> None:
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    for e_off, e_st, c_off, c_st, g_off, g_st, dg_off, dg_st, rows_n, cols_n in (r[:10] for r in rows):
        e = grad.as_strided((n, rows_n, cols_n), (e_st, cols_n, 1), grad.storage_offset() + e_off)
        core = work.as_strided((n, rows_n, cols_n), (c_st, cols_n, 1), work.storage_offset() + c_off)
        g = work.as_strided((n, cols_n), (g_st, 1), work.storage_offset() + g_off)
        dg = grad.as_strided((n, cols_n), (dg_st, 1), grad.storage_offset() + dg_off)
        dg.copy_((e.to(acc) * core.to(acc)).sum(1))
        e.copy_(e.to(acc) * g.to(acc)[:, None, :])


# ---------------------------------------------------------------- custom ops
def _forward(work: Tensor, key: int) -> None:
    """Fill ``work`` past its stacked cores and gates with the batch's running products,
    ``A`` and ``B`` among them (``(max(n_in, d - n_in) - 1)`` launches)."""
    plan = _BY_KEY[key]
    tables = plan.tables(work.device) if _runs_triton(work) else None
    for j, rows in enumerate(plan.forward):
        if rows:
            _launch_tasks(rows, tables["forward"][j] if tables else None, work, work, work, work, plan.n)


merge_forward_op = torch.library.custom_op("tncompile::merge_factors_", _forward, mutates_args=("work",))


@merge_forward_op.register_fake
def _(work: Tensor, key: int) -> None:
    return None


def _backward(grad: Tensor, work: Tensor, key: int) -> None:
    """Fill ``grad`` (``dA`` and ``dB`` stacked at its start) with every core's and gate's
    gradient (``max(n_in, d - n_in)`` launches)."""
    plan = _BY_KEY[key]
    tables = plan.tables(grad.device) if _runs_triton(grad) else None
    for j, rows in enumerate(plan.backward):
        if rows:
            _launch_tasks(rows, tables["backward"][j] if tables else None, work, grad, grad, work, plan.n)
    if not plan.finish:
        return
    if tables is None:
        _finish_torch(plan.finish, grad, work, plan.n)
    else:
        tiles = max(triton.cdiv(r[9], BLOCK) for r in plan.finish)
        _compiled("finish", grad.device.type)[(tiles, plan.n, len(plan.finish))](
            grad, work, tables["finish"], FIELDS=len(plan.finish[0]), ACC=_acc(grad), BM=BLOCK, BN=BLOCK)


merge_backward_op = torch.library.custom_op("tncompile::merge_factors_backward_", _backward, mutates_args=("grad",))


@merge_backward_op.register_fake
def _(grad: Tensor, work: Tensor, key: int) -> None:
    return None


def merge_forward(work: Tensor, key: int) -> None:
    """``tncompile::merge_factors_`` (its implementation called directly in an eager step: :func:`.direct`)."""
    (_forward if direct(work) else merge_forward_op)(work, key)


def merge_backward(grad: Tensor, work: Tensor, key: int) -> None:
    """``tncompile::merge_factors_backward_`` (directly in an eager step)."""
    (_backward if direct(grad) else merge_backward_op)(grad, work, key)
