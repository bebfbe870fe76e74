"""Calibration-driven rank allocation for ``assign_ranks`` (``compile(calibration=...)``)."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ..calibration.allocation import CURVE_DTYPE, allocate_by_sensitivity, candidate_ranks, error_curve
from ..calibration.layer_fit import RIDGE, weighted_table
from ..ir.program import Program
from .infra.progress import progress
from ..runtime.layers.module_kinds import linear_weight_of
from .infra.pending import PendingLayer

if TYPE_CHECKING:  # statistics imports the passes' progress bar: a circle at import time
    from ..calibration.statistics import CalibrationStats

__all__ = ["by_sensitivity", "uses_sensitivity"]


def uses_sensitivity(program: Program, stats: CalibrationStats | None) -> bool:
    """Whether ``assign_ranks`` allocates by sensitivity: calibration statistics ``stats``
    are there (the compile's context) and ``compile(allocation=...)`` is ``"sensitivity"``
    or ``"auto"``."""
    allocation = program.options.allocation
    return stats is not None and allocation in ("auto", "sensitivity")


def by_sensitivity(program: Program, stats: CalibrationStats | None, owners: dict[str, PendingLayer],
                   fixed: dict[str, int],
                   caps: dict[str, int], budget: float, floors: dict[str, int] | None = None
                   ) -> dict[str, int] | None:
    """Ranks for ``owners`` from their estimated output error per parameter (each
    layer's error weighted by the model outputs' sensitivity to it), within
    ``budget`` parameters for all of them, none below its ``floors`` rank; ``None``
    to fall back to uniform ranks
    (no calibration, allocation ``"uniform"``, mixture-of-experts layers, or a
    budget below every layer's smallest candidate). Records each layer's estimate
    in ``program.calibration_summary``."""
    if not uses_sensitivity(program, stats):
        return None
    if any(m.kind == "experts" for m in owners.values()):
        warnings.warn("rank allocation by sensitivity does not cover mixture-of-experts layers; "
                      "ranks are uniform", stacklevel=2)
        return None
    budget -= sum(owners[n].layout.with_ranks(r).num_params() for n, r in fixed.items())
    curves, weights = {}, {}
    free = [n for n in owners if n not in fixed]
    for name in progress(free, "sensitivity (rank allocation)"):
        mod = owners[name]
        table = mod.kind in ("embedding", "embedding_bag")
        # a table tied to a head moves the outputs through both
        roles = ("table", "linear") if table else ("linear",)
        found = [stats.sensitivity_of(mod.dense.weight, role) for role in roles]
        weights[name] = None if found[0] is None else sum(found)
        if table:
            counts = stats.counts_of(mod.weight)
            target = weighted_table(mod.weight, counts) if counts is not None else mod.weight
        else:
            weight = linear_weight_of(mod.dense)
            moment = stats.moments.get(id(mod.dense.weight))
            if moment is None or moment.rows == 0:
                target = weight
            else:  # layers fed the same inputs (query, key, value) share the moment's cached root
                root = moment.normalized_root(RIDGE)
                target = weight.detach().to(CURVE_DTYPE) @ root.to(weight.device, CURVE_DTYPE)
        floor = min((floors or {}).get(name, 1), caps[name])
        curves[name] = error_curve(target, mod.layout, candidate_ranks(caps[name], floor))
    measured = {n: w for n, w in weights.items() if w is not None}
    if not any(measured.values()):  # not measured (allocation by layer error alone) or no output reached
        measured = {}
    ranks = allocate_by_sensitivity(curves, int(budget), measured)
    if ranks is None:
        return None
    summary = program.calibration_summary
    total = sum(measured.values())
    for name, r in ranks.items():
        c = curves[name]
        entry = summary.setdefault(name, {})
        entry["estimated_error"] = c.errors[c.ranks.index(r)]
        if total:
            entry["output_weight"] = measured.get(name, 0.0) / total
    return {**ranks, **fixed}
