"""Contraction search: the pairwise order of one TT network for one bucket of rows.

Candidates are cotengra's exact search for flops and for ``flops + write``
(``combo``) -- or its hyper-optimizer for networks too large for exact search
-- the left-to-right order, and CoMERA's merge-the-cores-first order. Each is
turned into SSA :class:`~tncompile.runtime.kernels.plans.Step`\\ s and costed:

Cost model: ``flops + WRITE_WEIGHT * elements_written + OP_OVERHEAD *
kernels`` (forward plus reverse-mode backward), where the writes include the
permuted copies the executor makes when an operand's contracted axes neither
lead nor trail it in order. So orders that stream huge intermediates through
memory lose to slightly more arithmetic on small ones, and tiny batches
prefer fewer copies -- which is what CPU and GPU timings reward. The weights
are in :mod:`tncompile.tuning`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from math import prod
from typing import Sequence

import cotengra as ctg

from .. import tuning
from ..formats.indices import BATCH, planner_problem
from ..runtime.kernels.plans import ContractionPlan, Step

__all__ = ["plan_contraction", "fixed_order_plan", "fixed_order_macs"]

Indices = tuple[str, ...]


@dataclass
class _Cost:
    flops: int = 0
    write: int = 0
    largest: int = 0
    kernels: int = 0


def _build(inputs: list[Indices], output: Indices, sizes: dict[str, int],
           path: Sequence[tuple[int, int]], needs_grad: Sequence[bool], weight: float):
    """Turn a linear (opt_einsum-style) path into SSA steps and cost them."""
    ops: list[Indices] = list(inputs)
    live = list(range(len(inputs)))  # positions in the shrinking list -> SSA ids
    rank_of = {}
    for ix in inputs:  # canonical index order: first appearance (input modes, then the chain)
        for x in ix:
            rank_of.setdefault(x, len(rank_of))
    grads = list(needs_grad)
    steps: list[Step] = []
    cost = _Cost()
    for i, j in path:
        i, j = sorted((i, j))
        a, b = live[i], live[j]
        # operand order decides the result's index order: the batch-carrying operand goes
        # first (results stay batch-major), otherwise the one whose indices come first
        # canonically, so merged blocks keep the input's mode order and need no copies later
        if output and output[0] in ops[b] and output[0] not in ops[a]:
            a, b = b, a
        elif not (output and output[0] in ops[a]) and \
                min(rank_of[x] for x in ops[b]) < min(rank_of[x] for x in ops[a]):
            a, b = b, a
        ai, bi = ops[a], ops[b]
        others = [ops[k] for k in live if k not in (a, b)]
        keep = set(output).union(*others) if others else set(output)
        shared = [x for x in ai if x in bi]
        contracted = [x for x in shared if x not in keep]
        if len(contracted) != len(shared):
            raise ValueError("hyper-indices are not supported by the pairwise executor")
        ci = tuple(x for x in ai if x not in contracted) + tuple(x for x in bi if x not in contracted)
        flops = prod(sizes[x] for x in set(ai) | set(bi))
        size = prod(sizes[x] for x in ci)
        a_axes = tuple(ai.index(x) for x in contracted)
        b_axes = tuple(bi.index(x) for x in contracted)
        steps.append(Step.make(a, b, a_axes, b_axes, ai, bi, ci, flops, size))
        # the executor copies an operand unless its contracted axes lead or trail in order
        copies = [prod(sizes[x] for x in ix) for ix, axes in ((ai, a_axes), (bi, b_axes))
                  if axes not in (tuple(range(len(axes))), tuple(range(len(ix) - len(axes), len(ix))))]
        cost.write += sum(copies)
        cost.kernels += 1 + len(copies)
        ops.append(ci)
        grads.append(grads[a] or grads[b])
        live = [k for k in live if k not in (a, b)] + [len(ops) - 1]
        cost.flops += flops
        cost.write += size
        cost.largest = max(cost.largest, size)
    bwd = bwd_write = 0
    for s in steps:  # reverse mode: each needed operand gradient is one more contraction
        for operand, idx in ((s.a, s.a_idx), (s.b, s.b_idx)):
            if grads[operand]:
                bwd += s.flops
                bwd_write += prod(sizes[x] for x in idx)
    final = ops[-1] if steps else inputs[0]
    perm = None if tuple(final) == tuple(output) else tuple(final.index(x) for x in output)
    kernels = 3 * cost.kernels + (1 if perm is not None else 0)  # backward ~ two kernels a step
    total = cost.flops + bwd + weight * (cost.write + bwd_write) + tuning.OP_OVERHEAD * kernels
    return steps, perm, cost, bwd, bwd_write, total


def _left_to_right(n: int) -> list[tuple[int, int]]:
    """``((t0 . t1) . t2) ...``: each result is appended last, the next operand is first."""
    return [(0, 1)] + [(0, m) for m in range(n - 2, 0, -1)]


def _merge_first(inputs: list[Indices], batch: str) -> list[tuple[int, int]] | None:
    """CoMERA's hand-written order for linears: merge the cores that touch the
    input's modes into one block, the remaining cores into another, then two
    skinny contractions ``(x . left) . right``. ``None`` when the network does
    not have that shape (input first, left cores then right cores)."""
    n = len(inputs)
    if n < 3 or batch not in inputs[0]:
        return None
    x_modes = set(inputs[0]) - {batch}
    left = [k for k in range(1, n) if set(inputs[k]) & x_modes]
    right = [k for k in range(1, n) if k not in left]
    if not left or not right or left != list(range(1, len(left) + 1)):
        return None
    live = list(range(n))   # SSA ids in the order opt_einsum-style positions see them
    path: list[tuple[int, int]] = []

    def contract(a: int, b: int) -> int:
        i, j = live.index(a), live.index(b)
        path.append((i, j))
        for k in sorted((i, j), reverse=True):
            live.pop(k)
        live.append(n + len(path) - 1)
        return live[-1]

    def chain(ids: list[int]) -> int:
        acc = ids[0]
        for k in ids[1:]:
            acc = contract(acc, k)
        return acc

    contract(contract(0, chain(left)), chain(right))
    return path


def _hyper_search(inputs: list, output: tuple, sizes: dict, minimize: str) -> list:
    """cotengra's hyper-optimizer on greedy trials, in this process: its ``labels`` method
    would start a pool of worker processes for its sub-problems (``parallel="auto"`` inside,
    whatever ``parallel=False`` says), and its trials draw from Python's ``random``, which is
    seeded here and put back: plans are reproducible and the caller's stream is untouched."""
    state = random.getstate()
    random.seed(0)
    try:
        opt = ctg.HyperOptimizer(methods=["greedy"], minimize=minimize, max_repeats=tuning.HYPER_REPEATS,
                                 parallel=False, progbar=False)
        return opt.search(inputs, output, sizes).get_path()
    finally:
        random.setstate(state)


def plan_contraction(inputs: Sequence[Indices], output: Indices, sizes: dict[str, int],
                     needs_grad: Sequence[bool] | None = None, batch: str = "b",
                     write_weight: float | None = None,
                     strategies: Sequence[str] | None = None) -> ContractionPlan:
    """Choose the cheapest pairwise order (forward + reverse-mode backward).

    Candidates: cotengra's exact search for flops and for ``flops + write``
    (``combo``) -- or its hyper-optimizer for networks too large for exact
    search -- the left-to-right order, and the merge-the-cores-first order.
    Each is costed with the plan cost model; the cheapest wins. ``strategies``
    restricts the candidates by name (e.g. ``["merge-cores-first"]`` to force
    CoMERA's fixed order, as the benchmarks do).
    """
    write_weight = tuning.WRITE_WEIGHT if write_weight is None else write_weight
    inputs = [tuple(ix) for ix in inputs]
    output = tuple(output)
    needs_grad = list(needs_grad) if needs_grad is not None else [True] * len(inputs)
    n = len(inputs)
    candidates: dict[str, list[tuple[int, int]]] = {"left-to-right": _left_to_right(n)}
    merge = _merge_first(inputs, batch)
    if merge is not None:
        candidates["merge-cores-first"] = merge
    if n > 2:
        exact = n <= tuning.EXACT_SEARCH_MAX_TENSORS
        for minimize in ("flops", f"combo-{int(write_weight)}"):
            if strategies is not None and f"cotengra-{minimize.split('-')[0]}" not in strategies:
                continue  # not asked for: skip the search
            if exact:
                ssa = ctg.optimal_optimize(list(inputs), output, sizes, minimize=minimize)
            else:
                ssa = _hyper_search(list(inputs), output, sizes, minimize)
            candidates[f"cotengra-{minimize.split('-')[0]}"] = [tuple(p) for p in ssa]
    if strategies is not None:
        unknown = set(strategies) - set(candidates)
        if unknown:
            raise ValueError(f"strategies {sorted(unknown)} not applicable here; candidates: {sorted(candidates)}")
        candidates = {k: v for k, v in candidates.items() if k in strategies}
    scored = {}
    for name, path in candidates.items():
        scored[name] = (_build(inputs, output, sizes, path, needs_grad, write_weight), path)
    best = min(scored, key=lambda k: scored[k][0][-1])
    return _plan_of(inputs, output, sizes, scored[best][0], best, {k: v[0][-1] for k, v in scored.items()},
                    needs_grad, batch, write_weight)


def _plan_of(inputs, output, sizes, built, strategy: str, candidates: dict[str, float], needs_grad,
             batch: str, write_weight: float) -> ContractionPlan:
    steps, perm, cost, bwd, bwd_write, total = built
    naive_total = _build(inputs, output, sizes, _left_to_right(len(inputs)), needs_grad, write_weight)[-1]
    return ContractionPlan(
        rows=sizes.get(batch, 1), inputs=inputs, output=output, steps=steps, out_perm=perm,
        fwd_flops=cost.flops, bwd_flops=bwd, write=cost.write + bwd_write, largest=cost.largest,
        naive_cost=naive_total, strategy=strategy, write_weight=write_weight, cost=total,
        candidates=dict(candidates),
        kernels=3 * cost.kernels + (1 if perm is not None else 0),
        bias_fusable=bool(steps) and perm is None and tuple(
            x for k, x in enumerate(steps[-1].a_idx) if k not in steps[-1].a_axes) == output[:1],
        batch=batch if any(batch in ix for ix in inputs) else None,
        sizes={k: int(v) for k, v in sizes.items() if k != batch})


def fixed_order_plan(layout, rows: int, transpose: bool = False) -> ContractionPlan:
    """The plan of ``layout``'s network over ``rows`` rows in the cheaper of the two
    fixed orders (left-to-right, merge-the-cores-first): no search, cheap enough to
    evaluate at every candidate rank. :func:`plan_contraction` considers both
    orders, so what it picks costs about as much or less."""
    inputs, output, sizes = planner_problem(layout, transpose)
    return plan_contraction(inputs, output, {**sizes, BATCH: int(rows)}, batch=BATCH,
                            strategies=[k for k in ("left-to-right", "merge-cores-first")
                                        if k == "left-to-right" or _merge_first(list(inputs), BATCH)])


def fixed_order_macs(layout, rows: int, transpose: bool = False) -> int:
    """Multiply-adds of a training step's forward and backward (every operand's
    gradient) of ``layout``'s network over ``rows`` rows, as :func:`fixed_order_plan`
    contracts it. The dense layer's count is ``3 * rows * in * out``."""
    plan = fixed_order_plan(layout, rows, transpose)
    return plan.fwd_flops + plan.bwd_flops
