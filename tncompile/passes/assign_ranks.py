"""``assign_ranks``: size every network so the whole model meets ``target_ratio``."""
from __future__ import annotations

import math

from .. import tuning
from ..formats.layout import TTLayout
from ..ir.program import Program
from ..planning import fixed_order_macs
from ..runtime.experts import experts_rows
from .base import Pass, register_pass
from .pending import PendingLayer
from .plan_contractions import example_rows
from .selection import check_pattern_keys, pattern_lookup
from .sensitivity import by_sensitivity

__all__ = ["AssignRanks"]


@register_pass
class AssignRanks(Pass):
    """Give every pending network a rank so that
    ``params(compiled) <= target_ratio * params(model)``, as close below it as
    the layouts allow.

    Ranks are uniform per layer (every internal bond gets the layer's rank,
    clipped to its bound). Layers named in ``rank_pattern`` get that rank.
    With calibration statistics (``compile(calibration=...)``, allocation
    ``"sensitivity"``, the default then) the others get ranks chosen from
    their estimated output error per parameter (:mod:`tncompile.calibration.allocation`);
    otherwise they share one rank ``r`` found by bisection. Then single layers are
    raised one step at a time (most sensitive, else largest, first) while the budget allows. No
    layer gets a rank at which its network is not smaller than its dense
    weight, nor a rank at which it keeps more than ``max_layer_ratio`` of it
    (there a dense layer is as small, exact and cheaper to run).

    With ``compile(prefer="speed")`` (the default) no TT linear gets a rank
    at which a training step (forward and backward) over a batch of the
    largest of ``batch_sizes`` (else ``tuning.ASSUMED_ROWS``) samples, each
    with the rows per sample it saw when traced (a sequence's tokens), costs more
    multiply-adds than its dense layer's, ``3 * rows * in * out`` (costed in the cheaper fixed order,
    :func:`tncompile.planning.fixed_order_macs`). With ``prefer="size"``, and for ranks fixed by
    ``rank_pattern``, such layers are noted in ``program.notes`` (the report
    shows it).

    Raises
    ------
    ValueError
        If rank 1 everywhere (and ``rank_pattern``) is already above the
        target; the message gives the smallest reachable ratio. Also when no
        layer could be tensorized at all (too small, excluded, unsupported)
        and the model is above the target; the message gives the reasons.
    """

    name = "assign_ranks"

    def __init__(self, max_layer_ratio: float | None = None):
        self._max_layer_ratio = max_layer_ratio

    @property
    def max_layer_ratio(self) -> float:
        """At most this share of a dense weight per network (default :data:`tncompile.tuning.MAX_LAYER_RATIO`)."""
        return tuning.MAX_LAYER_RATIO if self._max_layer_ratio is None else self._max_layer_ratio

    def ensures(self, program: Program) -> None:
        unsized = [node.target for node, m in program.modules()
                   if isinstance(m, PendingLayer) and m.layout.ranks is None]
        if unsized:
            raise RuntimeError(f"assign_ranks left layers without ranks: {unsized[:3]}")

    def run(self, program: Program) -> Program:
        opts = program.options
        owners: dict[str, PendingLayer] = {}
        for node, mod in program.modules():
            if isinstance(mod, PendingLayer) and mod.tied_to is None:
                owners.setdefault(node.target, mod)
        if not owners:
            ratio = program.num_params() / max(program.original_params, 1)
            if ratio > opts.target_ratio:
                raise ValueError(_nothing_to_compress(program, opts.target_ratio, ratio))
            return program
        weights = {id(m.weight) for m in owners.values()}
        unique = {id(p): p for p in program.graph_module.parameters() if id(p) not in weights}
        base = sum(p.numel() for p in unique.values())
        budget = opts.target_ratio * program.original_params

        check_pattern_keys(owners, opts.rank_pattern, "rank_pattern")
        fixed = {n: r for n in owners if (r := pattern_lookup(n, opts.rank_pattern)) is not None}
        caps = {n: self._cap(m.layout) for n, m in owners.items()}
        rows = self._traced_rows(program, owners)
        if opts.prefer == "speed":
            for n, r in rows.items():
                caps[n] = min(caps[n], self._speed_cap(owners[n].layout, r))
        size = {n: (lambda r, lay=m.layout: lay.with_ranks(r).num_params()) for n, m in owners.items()}

        def total(ranks: dict[str, int]) -> int:
            return base + sum(size[n](ranks[n]) for n in owners)

        def uniform(r: int) -> dict[str, int]:
            return {n: fixed.get(n, min(r, caps[n])) for n in owners}

        smallest = total(uniform(1))
        if smallest > budget:
            hint = " with the ranks fixed by rank_pattern" if fixed else ""
            raise ValueError(
                f"target_ratio={opts.target_ratio:g} cannot be reached: the smallest possible ratio "
                f"is {smallest / program.original_params:.4g} (every tensorized layer at rank 1{hint}; "
                f"{base:,} parameters stay dense). Raise target_ratio to at least that, or compress "
                f"more layers (target_modules) or use more cores per layer.")
        lo, hi = 1, max(caps.values())
        while lo < hi:  # largest uniform rank within budget
            mid = (lo + hi + 1) // 2
            if total(uniform(mid)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        floors = {n: max(1, math.ceil(r * tuning.SENSITIVITY_RANK_FLOOR)) for n, r in uniform(lo).items()}
        ranks = by_sensitivity(program, owners, fixed, caps, budget - base, floors)
        if ranks is None:
            ranks = uniform(lo)
        used = total(ranks)
        # leftover budget: one rank step at a time, the most sensitive (else the largest) layers first
        sensitivity = getattr(program, "calibration_summary", {})
        order = sorted((n for n in owners if n not in fixed),
                       key=lambda n: (sensitivity.get(n, {}).get("estimated_error", 0.0),
                                      owners[n].layout.dense_params), reverse=True)
        grew = True
        while grew:
            grew = False
            for n in order:
                if ranks[n] >= caps[n]:
                    continue
                delta = size[n](ranks[n] + 1) - size[n](ranks[n])
                if used + delta <= budget:
                    ranks[n] += 1
                    used += delta
                    grew = True
        for n, mod in owners.items():
            mod.layout = mod.layout.with_ranks(ranks[n])
            if n in rows:
                self._note_if_slower(program, n, mod.layout, rows[n])
        for _, mod in program.modules():  # tied heads share their embedding's layout
            if isinstance(mod, PendingLayer) and mod.tied_to is not None:
                mod.layout = owners[mod.tied_to].layout
        return program

    @staticmethod
    def _traced_rows(program: Program, owners: dict[str, PendingLayer]) -> dict[str, int]:
        """Rows each TT network multiplied when traced (largest over its call
        sites; an expert's share of its layer's rows)."""
        rows: dict[str, int] = {}
        for node, mod in program.modules():
            if node.target in owners and isinstance(mod.layout, TTLayout):
                seen = example_rows(node, lookup=False)
                # rows per sample as traced (sequence length), times the batch asked for with
                # batch_sizes, else a typical one: never the batch the example happened to have.
                # No shapes (fx without example_inputs): one row per sample.
                batch = max(program.options.batch_sizes or [tuning.ASSUMED_ROWS])
                traced = batch * max(seen[1] // max(seen[0], 1), 1) if seen is not None else batch
                per_network = experts_rows(traced, mod.layout.experts)
                rows[node.target] = max(rows.get(node.target, 0), per_network)
        return rows

    @staticmethod
    def _speed_cap(lay: TTLayout, rows: int) -> int:
        """Largest rank before the first one whose network's training step over
        ``rows`` rows costs more multiply-adds than the dense layer's (at least
        1). The cost is not monotonic in the rank (bonds clip at their bounds,
        and a near-full-rank network merges cheaply), so: double the rank until
        it is too costly, then bisect below that."""
        dense = _dense_step_macs(lay, rows)
        top = max(lay.rank_bounds())

        def fits(r: int) -> bool:
            return fixed_order_macs(lay.with_ranks(r), rows) <= dense
        if not fits(1):
            return 1
        ok = 1
        while ok < top and fits(min(2 * ok, top)):
            ok = min(2 * ok, top)
        if ok == top:
            return top
        lo, hi = ok, min(2 * ok, top) - 1  # ok fits; 2 * ok does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    @staticmethod
    def _note_if_slower(program: Program, name: str, lay: TTLayout, rows: int) -> None:
        tn, dense = fixed_order_macs(lay, rows), _dense_step_macs(lay, rows)
        if tn > dense:
            program.notes[name] = (f"slower than dense at {rows} rows: {tn / rows:,.0f} vs {dense / rows:,.0f} "
                                   "multiply-adds per row, forward and backward")

    def _cap(self, lay) -> int:
        """Largest rank whose network keeps at most ``max_layer_ratio`` of the dense weight."""
        limit = self.max_layer_ratio * lay.dense_params
        lo, hi = 1, max(lay.rank_bounds())
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if lay.with_ranks(mid).num_params() <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _dense_step_macs(lay: TTLayout, rows: int) -> int:
    """Multiply-adds of the dense layer's training step over ``rows`` rows:
    forward, input gradient and weight gradient, ``rows * in * out`` each."""
    return 3 * rows * lay.in_features * lay.out_features


def _nothing_to_compress(program: Program, target: float, ratio: float) -> str:
    """Why no layer could be tensorized, for the error ``compile`` raises."""
    reasons = list(program.notes.items())
    shown = "; ".join(f"{name}: {why}" for name, why in reasons[:5])
    more = f" (and {len(reasons) - 5} more)" if len(reasons) > 5 else ""
    return (f"target_ratio={target:g} cannot be reached: no layer could be tensorized, so the model stays at "
            f"ratio {ratio:.4g}. {shown or 'the traced graph has no compressible layer'}{more}. Lower "
            f"tncompile.tuning.MIN_LAYER_PARAMS (or pass Tensorize(min_params=...) in passes), use fewer cores (linear_cores / embedding_cores), or "
            f"widen target_modules / exclude_modules.")
