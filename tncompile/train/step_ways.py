"""How a :class:`~tncompile.train.TrainStep` runs each input signature: the model as it is
(``"plain"``) or through ``torch.compile`` (``"compiled"``), chosen by measurement.

``TrainStep(..., compile="auto")`` times both ways on the steps a user runs anyway -- no
step is thrown away, each is a real training step -- and keeps the faster per signature:

1. the plain way runs until it is settled (its warm-up steps, on CUDA its capture), then
   ``tuning.STEP_MEASURE_STEPS`` steps are timed;
2. the compiled way runs until settled (its first calls compile; on CUDA it is captured
   again), then as many steps are timed;
3. the way with the lower median step time serves the signature from then on.

Every timed step synchronizes the device before and after it (steps that are not timed
never do). ``compile=True`` / ``False`` fix the way without measuring. Pure bookkeeping,
independent of CUDA and of the clock: the caller times the steps it is told to time.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Hashable

from .. import tuning

__all__ = ["StepWays", "WayTimes", "STEP_WAYS"]

STEP_WAYS = ("plain", "compiled")


@dataclass
class WayTimes:
    """One signature's measurement: steps run and seconds timed per way, and the choice."""

    ran: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_WAYS, 0))
    seconds: dict[str, list[float]] = field(default_factory=lambda: {w: [] for w in STEP_WAYS})
    chosen: str | None = None

    def median_ms(self, way: str) -> float | None:
        times = self.seconds[way]
        return round(1e3 * statistics.median(times), 4) if times else None

    def as_row(self) -> dict:
        return {"chosen": self.chosen, **{f"{w}_ms": self.median_ms(w) for w in STEP_WAYS}}


class StepWays:
    """Per signature, the way its next step runs and whether that step is timed.

    Parameters
    ----------
    mode : {False, True, "auto"}
        ``False``: always plain; ``True``: always compiled; ``"auto"``: measured.
    settle_steps : int
        Steps of a way before its steps are timed (warm-up and capture for the plain way;
        compilation, warm-up and capture for the compiled one).
    """

    def __init__(self, mode: bool | str, settle_steps: int):
        if mode not in (False, True, "auto"):
            raise ValueError(f"TrainStep: compile must be False, True or 'auto', got {mode!r}")
        self.mode = mode
        self.settle_steps = settle_steps
        self.timed_steps = tuning.STEP_MEASURE_STEPS
        self._times: dict[Hashable, WayTimes] = {}
        self.failures: dict[Hashable, str] = {}

    def way(self, key: Hashable) -> str:
        """The way ``key``'s next step runs."""
        if self.mode != "auto":
            return "compiled" if self.mode else "plain"
        times = self._times.setdefault(key, WayTimes())
        if times.chosen is not None:
            return times.chosen
        return "plain" if len(times.seconds["plain"]) < self.timed_steps else "compiled"

    def timed(self, key: Hashable, way: str) -> bool:
        """Whether the step about to run ``key`` the ``way`` way is to be timed."""
        times = self._times.get(key)
        return (self.mode == "auto" and times is not None and times.chosen is None
                and times.ran[way] >= self.settle_steps)

    def ran(self, key: Hashable, way: str, seconds: float | None) -> str | None:
        """Record a step of ``key`` run ``way`` (``seconds`` where it was timed); returns
        the way chosen when this step completed the measurement, else ``None``."""
        times = self._times.get(key)
        if self.mode != "auto" or times is None or times.chosen is not None:
            return None
        times.ran[way] += 1
        if seconds is not None:
            times.seconds[way].append(seconds)
        if len(times.seconds["compiled"]) < self.timed_steps:
            return None
        times.chosen = min(STEP_WAYS, key=lambda w: statistics.median(times.seconds[w]))
        return times.chosen

    def failed(self, key: Hashable, reason: str) -> None:
        """The compiled way could not run ``key``: plain from now on, the reason kept."""
        times = self._times.setdefault(key, WayTimes())
        times.chosen = "plain"
        times.seconds["compiled"].clear()
        self.failures[key] = reason

    def rows(self) -> dict[str, dict]:
        """``signature -> {"chosen", "plain_ms", "compiled_ms"}`` (medians of the timed steps),
        plus ``"compile_failed"`` where the compiled way raised."""
        out = {}
        for key, times in self._times.items():
            row = times.as_row()
            if key in self.failures:
                row["compile_failed"] = self.failures[key]
            out[repr(key)] = row
        return out
