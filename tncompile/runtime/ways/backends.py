"""Optional backends that add ways to ops by registering themselves.

A backend (tncompile's Triton kernels: :mod:`tncompile.runtime.triton`, registered when
the runtime is imported) gives named runners for some ops and says which tensors it runs
(``runs(like)``: device, dtype, whether its compiler is installed). The ways ask
:func:`active` for the backend of a call; nothing in ``ways/`` imports a backend, and
nothing in ``layers/`` or ``fused/`` knows one exists.

Runner names (what a backend may register, and what each takes):

* ``"thin_pair"`` -- ``(x (rows, P_in), A, B, bias, activation) -> (rows, P_out)``, ``act(x A B + bias)``;
* ``"lookup"`` -- ``(layer, ids (T,), split, *cores_and_gates) -> (T, padded_cols)``;
  ``"lookup_supports"`` -- ``(split, cores) -> bool``;
* ``"merge"`` -- ``(batches, tensors) -> factors``; ``"merge_supports"`` -- ``(batch) -> bool``.
"""
from __future__ import annotations

from typing import Callable

import torch

from ... import tuning

__all__ = ["Backend", "register", "get", "active", "candidate", "runner_for", "registered"]


class Backend:
    """A named set of runners and the test of which tensors it runs. ``measured_on``: the
    device types where its runners are candidates of the measured choice
    (:mod:`.measured`) while its switch is ``None`` -- timed against the default ways on
    the device, kept only where they win."""

    def __init__(self, name: str, runs: Callable[[torch.Tensor], bool], runners: dict[str, Callable],
                 measured_on: tuple[str, ...] = ()):
        self.name, self.runs, self.runners = name, runs, dict(runners)
        self.measured_on = tuple(measured_on)

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, runners={sorted(self.runners)})"


_BACKENDS: dict[str, Backend] = {}

#: which ``tuning`` switch turns each backend on (off by default: a backend stays off the hot
#: path until a measured profile shows it wins)
SWITCHES = {"triton": "TRITON_KERNELS"}


#: ``(switch, backend)`` of every registered backend that has a switch
_SWITCHED: list[tuple[str, Backend]] = []


def register(backend: Backend) -> None:
    """Add (or replace) ``backend`` under its name."""
    _BACKENDS[backend.name] = backend
    _SWITCHED[:] = [(SWITCHES[name], b) for name, b in _BACKENDS.items() if name in SWITCHES]


def get(name: str) -> Backend | None:
    """The backend registered as ``name``, if any."""
    return _BACKENDS.get(name)


def registered() -> list[str]:
    return sorted(_BACKENDS)


def candidate(like: torch.Tensor, runner: str) -> Callable | None:
    """The runner named ``runner`` of a backend that may be measured for tensors like
    ``like``: its switch ``None`` (measured: the default) or on, ``like``'s device type in
    its ``measured_on``, and ``runs(like)``; else ``None``. Asked once per shape, where the
    measured choice makes its candidates."""
    for backend in _BACKENDS.values():
        switch = SWITCHES.get(backend.name)
        if switch is not None and getattr(tuning, switch) is False:
            continue
        if runner in backend.runners and like.device.type in backend.measured_on and backend.runs(like):
            return backend.runners[runner]
    return None


def runner_for(like: torch.Tensor, runner: str) -> Callable | None:
    """The runner a way chosen for ``like`` runs: the switched-on backend's, else a
    measured candidate's (the way was its winner)."""
    return active(like, runner) or candidate(like, runner)


def active(like: torch.Tensor, runner: str) -> Callable | None:
    """The runner named ``runner`` of the backend switched on for tensors like ``like``
    (its ``tuning`` switch set and ``runs(like)``), else ``None``: the default ways run.
    Asked on every call of a TT linear and a lookup: with every switch off, one attribute
    read per registered backend."""
    for switch, backend in _SWITCHED:
        if getattr(tuning, switch) is True and runner in backend.runners and backend.runs(like):
            return backend.runners[runner]
    return None
