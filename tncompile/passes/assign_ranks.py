"""``assign_ranks``: size every network so the whole model meets ``target_ratio``."""
from __future__ import annotations

import math
from collections import Counter

import torch

from .. import tuning
from ..formats.layout import TTLayout, TTMLayout
from ..ir.program import CompileContext, Program
from ..planning import DeviceSpeed, device_speed, fixed_order_macs, layer_step_seconds, merge_family
from ..runtime.layers.experts import experts_rows
from .infra.base import Pass, register_pass
from .infra.pending import PendingLayer
from .plan_contractions import example_rows
from .infra.selection import check_pattern_keys, pattern_lookup
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

    With ``compile(prefer="speed")`` (the default) every TT linear is judged in
    estimated time on the model's device (:mod:`tncompile.planning.speed_model`)
    over a batch of the largest of ``batch_sizes`` (else ``tuning.ASSUMED_ROWS``)
    samples, each with the rows per sample it saw when traced (a sequence's
    tokens): no network gets a rank whose training step would take more than
    ``tuning.SPEED_MARGIN`` of its dense layer's, or a layer stays dense
    (:meth:`_apply_speed`). With ``prefer="size"``, and for ranks fixed by
    ``rank_pattern``, layers estimated slower than dense are noted in
    ``program.notes`` (the report shows it).

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

    def run(self, program: Program, ctx: CompileContext) -> Program:
        if ctx.decisions is not None:  # tncompile.load: the saved layouts carry their ranks
            return program
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
        ids = self._traced_rows(program, owners, lookups=True)
        speed = device_speed(_model_device(program)) if rows or ids else None
        sharing = _layout_sharing(owners)
        sparse = sorted(n for n in ids if getattr(getattr(owners[n], "dense", None), "sparse", False))
        program.speed_estimates = ({"speed": speed, "rows": dict(rows), "ids": ids, "sparse_tables": sparse}
                                   if speed else {})
        size = {n: (lambda r, lay=m.layout: lay.with_ranks(r).num_params()) for n, m in owners.items()}
        absorbed: list[str] = []
        if opts.prefer == "speed":
            base, absorbed = self._apply_speed(program, owners, fixed, caps, size, base, budget, rows, speed,
                                                sharing)
            if not owners:
                return program

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
        lo = _uniform_rank(owners, fixed, caps, size, base, budget)
        floors = {n: max(1, math.ceil(r * tuning.SENSITIVITY_RANK_FLOOR)) for n, r in uniform(lo).items()}
        ranks = by_sensitivity(program, ctx.calibration, owners, fixed, caps, budget - base, floors)
        if ranks is None:
            ranks = uniform(lo)
        used = total(ranks)
        # leftover budget: one rank step at a time, the most sensitive (else the largest) layers first
        sensitivity = program.calibration_summary
        order = sorted((n for n in owners if n not in fixed),
                       key=lambda n: (sensitivity.get(n, {}).get("estimated_error", 0.0),
                                      owners[n].layout.dense_params), reverse=True)
        used = _grow_classes(order, owners, ranks, caps, size, used, budget)
        # then layer by layer: layers without a same-shaped peer first, then -- splitting a
        # shape's layers over two ranks -- only while more than UNIFORM_RANK_SLACK is left
        shapes = Counter(_shape(owners[n].layout) for n in order)
        alone = [n for n in order if shapes[_shape(owners[n].layout)] == 1]
        used = _grow_layers(alone, ranks, caps, size, used, budget, until=budget)
        used = _grow_layers(order, ranks, caps, size, used, budget, until=(1 - tuning.UNIFORM_RANK_SLACK) * budget)
        ranks = _aligned(order, owners, ranks, caps, size, base, budget)
        for n, mod in owners.items():
            mod.layout = mod.layout.with_ranks(ranks[n])
            if n in rows and n not in program.notes:
                self._note_if_slower(program, n, mod.layout, rows[n], speed, absorbed=n in absorbed,
                                     sharing=sharing.get(n, 1))
        for _, mod in program.modules():  # tied heads share their embedding's layout
            if isinstance(mod, PendingLayer) and mod.tied_to is not None:
                mod.layout = owners[mod.tied_to].layout
        return program

    @staticmethod
    def _traced_rows(program: Program, owners: dict[str, PendingLayer], lookups: bool = False) -> dict[str, int]:
        """Rows each TT network multiplied when traced (largest over its call
        sites; an expert's share of its layer's rows); with ``lookups``, the ids each
        TTM embedding looked up instead (the report's estimates)."""
        rows: dict[str, int] = {}
        for node, mod in program.modules():
            if node.target in owners and isinstance(mod.layout, TTMLayout if lookups else TTLayout):
                seen = example_rows(node, lookup=lookups)
                # rows per sample as traced (sequence length), times the batch asked for with
                # batch_sizes, else a typical one: never the batch the example happened to have.
                # No shapes (fx without example_inputs): one row per sample.
                batch = max(program.options.batch_sizes or [tuning.ASSUMED_ROWS])
                traced = batch * max(seen[1] // max(seen[0], 1), 1) if seen is not None else batch
                per_network = traced if lookups else experts_rows(traced, mod.layout.experts)
                rows[node.target] = max(rows.get(node.target, 0), per_network)
        return rows

    @staticmethod
    def _speed_cap(lay: TTLayout, rows: int, speed: DeviceSpeed, sharing: int = 1) -> int:
        """Largest rank before the first one whose network's training step over
        ``rows`` rows is estimated to take longer than ``tuning.SPEED_MARGIN``
        times the dense layer's (:class:`~tncompile.planning.DeviceSpeed`); 0 when
        rank 1 already does."""
        def fits(candidate: TTLayout) -> bool:
            network, dense = layer_step_seconds(candidate, rows, speed, sharing=sharing)
            return network <= tuning.SPEED_MARGIN * dense
        return _largest_rank(lay, fits)

    def _apply_speed(self, program: Program, owners: dict[str, PendingLayer], fixed: dict[str, int],
                     caps: dict[str, int], size, base: int, budget: float, rows: dict[str, int],
                     speed: DeviceSpeed, sharing: dict[str, int]) -> tuple[int, list[str]]:
        """``prefer="speed"``: lower ``caps`` so that no network is slower than its
        dense layer by more than the model can absorb, putting back the dense layer
        of those the rule would cut hardest as far as the budget allows (they leave
        ``owners``). Returns the parameters outside ``owners`` and the slower
        layers the model absorbs.

        Each network is capped at the largest rank within ``tuning.SPEED_MARGIN`` of
        its dense layer's estimated step time. Where that cap is below
        ``tuning.DENSE_BELOW_RANK_SHARE`` of the rank the budget gives the layer (or
        no rank is within it), the layer is *slow*: the slow layers losing least
        time keep their budget rank (capped at dense's multiply-adds) while their
        losses add up to at most ``tuning.SPEED_SLACK`` of all these layers' dense
        step time; the others stay dense, most time lost per parameter first, while
        their weights take at most ``tuning.DENSE_FOR_SPEED_SHARE`` of the budget and
        the target stays reachable; any left stay TT at their cap (the report says so)."""
        budget_rank = _uniform_rank(owners, fixed, caps, size, base, budget)
        speed_caps = {n: self._speed_cap(owners[n].layout, r, speed, sharing.get(n, 1))
                      for n, r in rows.items() if n not in fixed}

        macs_caps: dict[str, int] = {}

        def macs_cap(n: str) -> int:
            if n not in macs_caps:
                r = rows[n]
                macs_caps[n] = max(_largest_rank(owners[n].layout, lambda lay: fixed_order_macs(lay, r) <=
                                                 3 * r * lay.in_features * lay.out_features), 1)
            return macs_caps[n]

        def at_budget(n: str) -> TTLayout:
            return owners[n].layout.with_ranks(max(min(budget_rank, caps[n], macs_cap(n)), 1))
        slow = [n for n, cap in speed_caps.items() if cap < tuning.DENSE_BELOW_RANK_SHARE * min(budget_rank, caps[n])]
        loss = {}
        for n in slow:
            tt, dense = layer_step_seconds(at_budget(n), rows[n], speed, sharing=sharing.get(n, 1))
            loss[n] = max(tt - dense, 0.0)
        slack = tuning.SPEED_SLACK * sum(speed.dense_step_seconds(rows[n], owners[n].layout.in_features,
                                                                  owners[n].layout.out_features) for n in rows)
        absorbed = []
        for n in sorted(slow, key=lambda n: loss[n]):
            if loss[n] <= slack:
                absorbed.append(n)
                slack -= loss[n]
        spare = tuning.DENSE_FOR_SPEED_SHARE * budget
        smallest = base + sum(size[n](fixed.get(n, 1)) for n in owners)
        kept = []
        for n in sorted((n for n in slow if n not in absorbed and owners[n].kind in ("linear", "conv1d")),
                        key=lambda n: loss[n] / max(owners[n].layout.dense_params - at_budget(n).num_params(), 1),
                        reverse=True):
            extra = owners[n].layout.dense_params - size[n](1)
            if owners[n].layout.dense_params <= spare and smallest + extra <= budget:
                kept.append(n)
                spare -= owners[n].layout.dense_params
                smallest += extra
        for n in kept:
            lay = at_budget(n)
            tt, dense = layer_step_seconds(lay, rows[n], speed, sharing=sharing.get(n, 1))
            program.notes[n] = (f"kept dense for speed: as TT at rank {max(lay.ranks)} it would take {_us(tt)} vs "
                                f"dense {_us(dense)} per step at {rows[n]} rows (est. on {speed.device})")
            mod = owners.pop(n)
            program.graph_module.set_submodule(n, mod.dense)
            base += mod.layout.dense_params
        program.speed_capped = {}
        for n, cap in speed_caps.items():
            if n in owners:
                if n in absorbed or cap == 0:
                    if n not in absorbed:
                        program.notes[n] = ("slower than dense in time at every rank, kept as TT to reach "
                                            "target_ratio (a higher target_ratio keeps it dense)")
                    cap = macs_cap(n)
                if max(cap, 1) < min(budget_rank, caps[n]):  # the budget allows more than speed does
                    program.speed_capped[n] = (max(cap, 1), min(budget_rank, caps[n]))
                    if n not in absorbed:  # (an absorbed layer's note says it is slower, and absorbed)
                        program.notes.setdefault(n, f"rank capped at {max(cap, 1)} for speed (the budget allows "
                                                    f"{min(budget_rank, caps[n])}; prefer='size' spends it)")
                caps[n] = min(caps[n], max(cap, 1))
        return base, absorbed

    @staticmethod
    def _note_if_slower(program: Program, name: str, lay: TTLayout, rows: int, speed: DeviceSpeed,
                        absorbed: bool = False, sharing: int = 1) -> None:
        tt, dense = layer_step_seconds(lay, rows, speed, sharing=sharing)
        if tt > dense:
            why = f"; absorbed: under {tuning.SPEED_SLACK:.0%} of the model's step (SPEED_SLACK)" if absorbed else ""
            program.notes[name] = (f"slower than dense at {rows} rows: est. {_us(tt)} vs {_us(dense)} a step on "
                                   f"{speed.device}{why}")

    def _cap(self, lay) -> int:
        """Largest rank whose network keeps at most ``max_layer_ratio`` of the dense weight."""
        return lay.largest_rank_within(self.max_layer_ratio * lay.dense_params)


def _shape(lay) -> tuple:
    """A layout's kind and modes (its ranks aside)."""
    if isinstance(lay, TTLayout):
        return TTLayout, lay.in_modes, lay.out_modes
    return type(lay), lay.row_modes, lay.col_modes


def _aligned(order: list[str], owners: dict[str, PendingLayer], ranks: dict[str, int], caps: dict[str, int],
             size, base: int, budget: float) -> dict[str, int]:
    """``ranks`` with every rank of at least ``tuning.ALIGN_RANKS_FROM`` (below its cap) a
    multiple of ``tuning.RANK_ALIGNMENT``: each rounded down, then the leftover budget grown
    back in whole aligned steps (classes of one layout first, as above). Where that leaves
    more than ``tuning.UNIFORM_RANK_SLACK`` of the budget unused, the unaligned ``ranks``
    stand (``target_ratio``'s contract: within 10% below)."""
    step = tuning.RANK_ALIGNMENT
    wide = [n for n in order if ranks[n] >= max(tuning.ALIGN_RANKS_FROM, step) and ranks[n] < caps[n]]
    if step <= 1 or not wide or all(ranks[n] % step == 0 for n in wide):
        return ranks
    out = dict(ranks)
    for n in wide:
        out[n] -= out[n] % step
    used = base + sum(size[n](out[n]) for n in owners)
    used = _grow_classes(wide, owners, out, caps, size, used, budget, step=step)
    used = _grow_layers(wide, out, caps, size, used, budget, until=(1 - tuning.UNIFORM_RANK_SLACK) * budget, step=step)
    return out if used >= (1 - tuning.UNIFORM_RANK_SLACK) * budget else ranks


def _grow_classes(order: list[str], owners: dict[str, PendingLayer], ranks: dict[str, int], caps: dict[str, int],
                  size, used: int, budget: float, step: int = 1) -> int:
    """Leftover budget, one rank step at a time for whole classes of layers -- the same
    modes, rank and cap -- in ``order`` of their first member: layers of one layout keep
    one layout, so they merge their cores in one batch at run time
    (:mod:`tncompile.runtime.layers.factor_groups`). Updates ``ranks``; returns the budget used."""
    grew = True
    while grew:
        grew = False
        classes: dict[tuple, list[str]] = {}
        for n in order:
            if ranks[n] + step <= caps[n]:
                classes.setdefault((_shape(owners[n].layout), ranks[n], caps[n]), []).append(n)
        for members in classes.values():
            delta = sum(size[n](ranks[n] + step) - size[n](ranks[n]) for n in members)
            if used + delta <= budget:
                for n in members:
                    ranks[n] += step
                used += delta
                grew = True
    return used


def _grow_layers(names: list[str], ranks: dict[str, int], caps: dict[str, int], size, used: int, budget: float,
                 until: float, step: int = 1) -> int:
    """One rank step (``step`` ranks) at a time for single layers of ``names``, in order, while the budget
    used is below ``until`` (and each step fits the budget). Updates ``ranks``; returns
    the budget used."""
    grew = True
    while grew and used < until:
        grew = False
        for n in names:
            if ranks[n] + step > caps[n] or used >= until:
                continue
            delta = size[n](ranks[n] + step) - size[n](ranks[n])
            if used + delta <= budget:
                ranks[n] += step
                used += delta
                grew = True
    return used


def _layout_sharing(owners: dict[str, PendingLayer]) -> dict[str, int]:
    """Per linear: how many linears of the model share its :func:`merge_family` -- they
    merge their cores in one batch at run time (:mod:`tncompile.runtime.layers.factor_groups`),
    sharing those kernels' fixed cost."""
    linears = {n: merge_family(m.layout) for n, m in owners.items()
               if m.kind in ("linear", "conv1d") and isinstance(m.layout, TTLayout)}
    counts = Counter(linears.values())
    return {n: counts[key] for n, key in linears.items()}


def _uniform_rank(owners: dict[str, PendingLayer], fixed: dict[str, int], caps: dict[str, int], size,
                  base: int, budget: float) -> int:
    """Largest rank that every network (clipped to its cap; ``fixed`` ones at theirs)
    can share within ``budget`` parameters, by bisection (at least 1)."""
    def total(r: int) -> int:
        return base + sum(size[n](fixed.get(n, min(r, caps[n]))) for n in owners)
    lo, hi = 1, max(caps[n] for n in owners)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _largest_rank(lay: TTLayout, fits) -> int:
    """Largest rank before the first one at which ``fits(lay.with_ranks(rank))`` is
    false (0 when rank 1 is). Costs are not monotonic in the rank (bonds clip at
    their bounds, and a near-full-rank network merges cheaply), so: double the
    rank until it does not fit, then bisect below that."""
    top = max(lay.rank_bounds())
    if not fits(lay.with_ranks(1)):
        return 0
    ok = 1
    while ok < top and fits(lay.with_ranks(min(2 * ok, top))):
        ok = min(2 * ok, top)
    if ok == top:
        return top
    lo, hi = ok, min(2 * ok, top) - 1  # ok fits; 2 * ok does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(lay.with_ranks(mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us"


def _model_device(program: Program) -> torch.device:
    """The device of the model's first parameter (CPU for a model without any)."""
    for p in program.graph_module.parameters():
        return p.device
    return torch.device("cpu")


def _nothing_to_compress(program: Program, target: float, ratio: float) -> str:
    """Why no layer could be tensorized, for the error ``compile`` raises."""
    reasons = list(program.notes.items())
    shown = "; ".join(f"{name}: {why}" for name, why in reasons[:5])
    more = f" (and {len(reasons) - 5} more)" if len(reasons) > 5 else ""
    return (f"target_ratio={target:g} cannot be reached: no layer could be tensorized, so the model stays at "
            f"ratio {ratio:.4g}. {shown or 'the traced graph has no compressible layer'}{more}. Lower "
            f"tncompile.tuning.MIN_LAYER_PARAMS (or pass Tensorize(min_params=...) in passes), use fewer cores (linear_cores / embedding_cores), or "
            f"widen target_modules / exclude_modules.")
