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

__all__ = ["Backend", "register", "get", "active", "registered"]


class Backend:
    """A named set of runners and the test of which tensors it runs."""

    def __init__(self, name: str, runs: Callable[[torch.Tensor], bool], runners: dict[str, Callable]):
        self.name, self.runs, self.runners = name, runs, dict(runners)

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


def active(like: torch.Tensor, runner: str) -> Callable | None:
    """The runner named ``runner`` of the backend switched on for tensors like ``like``
    (its ``tuning`` switch set and ``runs(like)``), else ``None``: the default ways run.
    Asked on every call of a TT linear and a lookup: with every switch off, one attribute
    read per registered backend."""
    for switch, backend in _SWITCHED:
        if getattr(tuning, switch) and runner in backend.runners and backend.runs(like):
            return backend.runners[runner]
    return None
