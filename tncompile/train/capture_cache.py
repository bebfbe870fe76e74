"""Which captured training step serves a call: keys, warm-up counts, LRU, invalidation.

Pure bookkeeping, independent of CUDA, so that every re-capture decision is
testable on any machine. :class:`~tncompile.train.TrainStep` asks
:meth:`CaptureCache.decide` before each step:

* ``"eager"``   -- this input signature has not been warmed up yet: run eagerly
  (a real training step) and count it;
* ``"capture"`` -- warmed up, no graph yet: capture one (then replay it);
* ``"replay"``  -- a graph for this signature and this model state exists.

A *state token* (controller version, parameter identities, dtype, device)
is checked on every call; when it changes, every graph is dropped -- a stale
graph is never replayed. At most ``max_graphs`` graphs live at once; the
least recently used is evicted first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable
from ..errors import check_int

__all__ = ["CaptureCache", "CacheStats"]

DECISIONS = ("eager", "capture", "replay")


@dataclass
class CacheStats:
    """Counters of a :class:`CaptureCache` (what ``TrainStep.stats()`` reports)."""

    live_graphs: int = 0
    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    evictions: int = 0
    invalidations: int = 0


class CaptureCache:
    """LRU map ``signature -> captured graph``, invalidated by a state token.

    Parameters
    ----------
    max_graphs : int
        Most graphs alive at once (each holds its static buffers).
    warmup_steps : int
        Eager steps a signature runs before it is captured (CUDA graph
        capture needs the optimizer state and workspaces allocated first).
    """

    def __init__(self, max_graphs: int = 8, warmup_steps: int = 2):
        check_int(max_graphs, "max_graphs", 1)
        check_int(warmup_steps, "warmup_steps", 1)
        self.max_graphs = max_graphs
        self.warmup_steps = warmup_steps
        self._graphs: OrderedDict[Hashable, Any] = OrderedDict()
        self._warm: dict[Hashable, int] = {}
        self._token: Hashable = None
        self.stats = CacheStats()

    def check_token(self, token: Hashable) -> bool:
        """Drop every graph (and warm-up count) if ``token`` differs from the
        last one seen; returns whether it did."""
        if token == self._token:
            return False
        had = bool(self._graphs) or bool(self._warm)
        self._token = token
        self.clear()
        if had:
            self.stats.invalidations += 1
        return had

    def decide(self, key: Hashable) -> str:
        """``"replay"``, ``"capture"`` or ``"eager"`` for signature ``key``."""
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return "replay"
        if self._warm.get(key, 0) >= self.warmup_steps:
            return "capture"
        return "eager"

    def warmed(self, key: Hashable) -> None:
        """Record one eager (warm-up) step of ``key``."""
        self._warm[key] = self._warm.get(key, 0) + 1
        self.stats.eager_steps += 1

    def add(self, key: Hashable, graph: Any) -> list[Any]:
        """Store a newly captured graph; returns the graphs evicted to make room."""
        self._graphs[key] = graph
        self._graphs.move_to_end(key)
        self.stats.captures += 1
        evicted = []
        while len(self._graphs) > self.max_graphs:
            old_key, old = self._graphs.popitem(last=False)
            self._warm.pop(old_key, None)
            evicted.append(old)
            self.stats.evictions += 1
        self.stats.live_graphs = len(self._graphs)
        return evicted

    def get(self, key: Hashable) -> Any:
        self.stats.replays += 1
        return self._graphs[key]

    def drop(self, key: Hashable) -> None:
        """Forget ``key``'s graph and warm-up count (it warms up again if it comes back)."""
        self._graphs.pop(key, None)
        self._warm.pop(key, None)
        self.stats.live_graphs = len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._warm.clear()
        self.stats.live_graphs = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[Hashable]:
        return list(self._graphs)
