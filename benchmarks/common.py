"""Shared benchmark helpers: timing, machine info, JSON output."""
from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path(__file__).parent / "results"


def median_ms(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def interleaved_ms(fns: dict[str, Callable[[], None]], reps: int, warmup: int = 1,
                   setup: Callable[[], None] | None = None) -> dict[str, float]:
    """Median ms of each function, measured round-robin (one call of each per
    round) so that drift in a shared machine's speed hits every variant alike.
    The order is shuffled every round (seeded): the call after a big one (a
    dense layer's weight gradient evicts the caches) must not always be the
    same variant. (Rotating the order is not enough: it keeps the cyclic
    order, so one variant would follow the big one in almost every round.)
    ``setup`` runs, untimed, before every call (e.g. setting gradients to
    ``None``, as ``optimizer.zero_grad()`` does between training steps).

    ``warmup`` rounds run first, alternating like the timed ones. With large
    models that matters: while two models' steps alternate, the process heap
    keeps growing for a few rounds and the step that touches new memory pays
    for the page faults (measured on the six-encoder at 32x128: ~100k faults,
    0.2-0.5 s per compiled step, in each of the first three rounds; none after)."""
    for _ in range(warmup):  # warm-up rounds alternate too: the heap settles only then
        for fn in fns.values():
            if setup is not None:
                setup()
            fn()
    names = list(fns)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        shuffle(names)
        for name in names:
            fn = fns[name]
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {k: 1000 * statistics.median(v) for k, v in samples.items()}


def machine() -> dict:
    return {"machine": platform.machine(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def clear_grads(*tensors_or_modules) -> Callable[[], None]:
    """A ``setup`` for :func:`interleaved_ms` that sets the gradients of the
    given tensors and modules' parameters to ``None`` (no accumulation
    between timed calls, as in training with ``zero_grad()``)."""
    leaves = []
    for t in tensors_or_modules:
        leaves.extend(t.parameters() if isinstance(t, torch.nn.Module) else [t])

    def setup() -> None:
        for leaf in leaves:
            leaf.grad = None
    return setup


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=1))
    return path
