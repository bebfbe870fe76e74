"""RankController's late-stage schedules, one class each (strategies the controller holds).

A schedule says what the late stage minimizes beside the task loss and when it cuts ranks
to a size budget; the controller owns the state (stage, steps, gates, losses) and asks it.

* :class:`BudgetSchedule` (``schedule="budget"``, the default): the early penalty keeps
  pulling gates down while the allowed ratio falls linearly from where the early stage
  ended to ``target_ratio`` at :meth:`~BudgetSchedule.final_cut_step`; cuts at every
  ``truncate_every`` enforce it, the last one reaches the target, and the remaining
  ``recovery`` share of ``late_steps`` trains the cores at that size.
* :class:`ComeraSchedule` (``schedule="comera"``): CoMERA's scalarized objective, the task
  loss against the size by their relative distances to their targets; it does not promise
  to reach ``target_ratio``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["Schedule", "BudgetSchedule", "ComeraSchedule", "SCHEDULES"]

#: the :class:`~tncompile.train.controller.RankController` asking (it holds its schedule;
#: a schedule reads it and never imports it)
Controller = Any


class Schedule:
    """What a late stage adds to the task loss, and which budget cut (if any) is due."""

    name = ""

    def late_penalty(self, ctl: Controller, task_loss: torch.Tensor, agreed: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def final_cut_step(self, ctl: Controller) -> int | None:
        """The step of the last budget cut, or ``None`` (no budget cuts)."""
        return None

    def due_budget(self, ctl: Controller) -> float | None:
        """The ratio to cut to at this step, or ``None`` when no budget cut is due."""
        return None

    def check_reachable(self, ctl: Controller) -> None:
        """Raise when this schedule cannot reach ``ctl.target_ratio``."""


class BudgetSchedule(Schedule):
    """``schedule="budget"``: reach ``target_ratio`` by cuts to a falling budget (module doc)."""

    name = "budget"

    def late_penalty(self, ctl, task_loss, agreed):
        # cuts enforce the size; gates keep their pull until the last cut
        return ctl._core_term() if ctl.recovering else ctl.early_penalty()

    def final_cut_step(self, ctl):
        if ctl._late_start is None:
            return None
        if ctl.late_steps is None:  # no time scale: the first cut point goes to the target
            every = ctl.truncate_every or 1
            return ctl._late_start + every - (ctl._late_start % every)
        return ctl._late_start + max(1, math.ceil((1.0 - ctl.recovery) * ctl.late_steps))

    def due_budget(self, ctl):
        if ctl.stage != "late" or ctl.recovering:
            return None
        final = self.final_cut_step(ctl)
        due = ctl.steps_done >= final or (ctl.truncate_every and ctl.steps_done % ctl.truncate_every == 0)
        return (ctl.target_ratio if ctl.steps_done >= final else ctl.budget()) if due else None

    def check_reachable(self, ctl):
        if ctl.allow_layer_removal:
            return
        floor = ctl.rank_one_ratio()
        if ctl.target_ratio < floor:
            raise ValueError(f"RankController: target_ratio={ctl.target_ratio:g} cannot be reached: with every "
                             f"rank at 1 the model is at {floor:.4g} ({ctl._other_params:,} parameters "
                             f"are not in TT/TTM layers). Aim at least that high, compress more layers, "
                             f"or pass allow_layer_removal=True.")


class ComeraSchedule(Schedule):
    """``schedule="comera"``: CoMERA's late-stage objective (module doc)."""

    name = "comera"

    def late_penalty(self, ctl, task_loss, agreed):
        return ctl.late_objective(task_loss, agreed) - task_loss


SCHEDULES: dict[str, type[Schedule]] = {"budget": BudgetSchedule, "comera": ComeraSchedule}
