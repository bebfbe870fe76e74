"""The planner the runtime asks for buckets nobody planned: registered on import.

The runtime cannot import this package (it is below it); it asks whatever planner
:func:`~tncompile.runtime.kernels.plans.set_planner` registered, and importing
:mod:`tncompile.planning` registers :class:`SearchPlanner` -- the dependency inverted.
"""
from __future__ import annotations

from ..formats.indices import BATCH, planner_problem
from ..runtime.kernels.plans import ContractionPlan, LookupPlan, set_planner
from .contraction import plan_contraction
from .lookup import plan_lookup

__all__ = ["SearchPlanner"]


class SearchPlanner:
    """The planner the runtime asks for a new bucket: cotengra-backed search
    for TT networks (:func:`plan_contraction`), split search for TTM lookups."""

    def plan_contraction(self, layout, transpose: bool, rows: int) -> ContractionPlan:
        inputs, output, sizes = planner_problem(layout, transpose)
        return plan_contraction(inputs, output, {**sizes, BATCH: int(rows)}, batch=BATCH)

    def plan_lookup(self, layout, rows: int) -> LookupPlan:
        return plan_lookup(layout, int(rows))


set_planner(SearchPlanner())
