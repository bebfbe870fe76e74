"""How busy the host was while something was timed: the CPU other processes used and the
share the hypervisor stole, read from ``/proc/stat`` around the timed block.

A ratio of two step times measured on a host where other work competes for the cores is
not the ratio of the steps; the demo and the benchmarks say so instead of printing it as
a measurement.

    with HostLoad() as load:
        ...  # the timed work
    if load.busy:
        print(load.describe())
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

#: Other processes using more than this many cores on average, or the hypervisor stealing
#: more than this share of the CPU time, make timings unreliable.
BUSY_OTHER_CORES = 0.25
BUSY_STEAL_SHARE = 0.05

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_ticks() -> tuple[int, int, int] | None:
    """``(busy, steal, total)`` jiffies of all CPUs since boot, or ``None`` off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = values + [0] * (8 - len(values))
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + idle + iowait + steal


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for (a benchmark's
    own subprocesses are not other load)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class HostLoad:
    """Context manager measuring the host's load while its block runs.

    Attributes (set on exit)
    ------------------------
    seconds : float
        Wall-clock length of the block.
    other_cores : float or None
        Average number of cores other processes kept busy (``None`` where ``/proc/stat``
        cannot be read).
    steal_share : float or None
        Share of all CPU time the hypervisor gave to other guests.
    load_average : tuple of float
        The 1, 5 and 15 minute load averages at the end (they count this process too).
    """

    seconds: float = 0.0
    other_cores: float | None = None
    steal_share: float | None = None
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    _start: tuple = field(default=(), repr=False)

    def __enter__(self) -> "HostLoad":
        self._start = (time.perf_counter(), _own_cpu_seconds(), _cpu_ticks())
        return self

    def __exit__(self, *exc) -> None:
        wall0, own0, ticks0 = self._start
        self.seconds = time.perf_counter() - wall0
        own = _own_cpu_seconds() - own0
        ticks1 = _cpu_ticks()
        self.load_average = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
        if ticks0 is None or ticks1 is None or self.seconds <= 0:
            return
        busy, steal, total = (b - a for a, b in zip(ticks0, ticks1))
        self.other_cores = max(0.0, busy / _TICKS_PER_SECOND - own) / self.seconds
        self.steal_share = steal / total if total > 0 else 0.0

    @property
    def busy(self) -> bool:
        """Whether other work competed enough to make the block's timings unreliable."""
        return ((self.other_cores or 0.0) > BUSY_OTHER_CORES
                or (self.steal_share or 0.0) > BUSY_STEAL_SHARE)

    def describe(self) -> str:
        """One line: what else ran, the steal share and the load averages."""
        one, five, fifteen = self.load_average
        parts = [f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"]
        if self.other_cores is not None:
            parts.append(f"other processes used {self.other_cores:.2f} cores")
        if self.steal_share is not None:
            parts.append(f"{100 * self.steal_share:.1f}% of the CPU time was stolen by the hypervisor")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"seconds": round(self.seconds, 3), "other_cores": self.other_cores,
                "steal_share": self.steal_share, "load_average": list(self.load_average), "busy": self.busy}
