"""``replan``: plan again every cached plan that no longer fits its layer.

A rank cut changes a layer's network (and a tied head's), so the plans it
carries for its buckets are stale. This pass re-plans exactly those buckets at
the new ranks (``force=True``: every bucket of every layer, e.g. for a model
file whose plans came from an older tncompile). Rank adaptation runs it
through the pipeline after every cut, so the change is linted, recorded in the
program's history and dumped like any compile-time pass.
"""
from __future__ import annotations

from ..formats.indices import planner_problem
from ..ir.program import Program
from ..runtime.kernels.plans import ContractionPlan, LookupPlan
from ..runtime.layers import TNModule
from .infra.base import Pass, register_pass

__all__ = ["Replan", "plan_fits", "replan_module"]


def plan_fits(module: TNModule, plan: ContractionPlan | LookupPlan) -> bool:
    """Whether ``plan`` was made for ``module``'s current network."""
    if isinstance(plan, LookupPlan):
        return plan.ranks is not None and tuple(plan.ranks) == tuple(module.layout.ranks)
    if not isinstance(plan, ContractionPlan) or plan.sizes is None or not plan.cost:
        return False  # no sizes or cost: saved by an older tncompile, plan it afresh
    return plan.sizes == planner_problem(module.layout, module.transposed)[2]


def replan_module(module: TNModule, force: bool = False) -> list[int]:
    """Re-plan ``module``'s stale buckets (all with ``force``); returns them."""
    stale = sorted(b for b, p in module.plans.items() if force or not plan_fits(module, p))
    for bucket in stale:
        del module.plans[bucket]
        module.plan_bucket(bucket)
    return stale


@register_pass
class Replan(Pass):
    """Re-plan the stale plans of every TT/TTM layer (see the module doc).

    Parameters
    ----------
    force : bool
        Re-plan every bucket, stale or not.
    """

    name = "replan"

    def __init__(self, force: bool = False):
        self.force = force

    def _layers(self, program: Program) -> list[TNModule]:
        return list({id(m): m for _, m in program.modules() if isinstance(m, TNModule)}.values())

    def run(self, program: Program) -> Program:
        for module in self._layers(program):
            self.matches["bucket-replanned"] += len(replan_module(module, self.force))
        return program

    def ensures(self, program: Program) -> None:
        stale = [type(m).__name__ for m in self._layers(program)
                 if any(not plan_fits(m, p) for p in m.plans.values())]
        if stale:
            raise RuntimeError(f"replan left stale plans on {stale[:3]}")
