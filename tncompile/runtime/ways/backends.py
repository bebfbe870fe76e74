"""Optional backends that add ways to ops by registering themselves.

A backend (tncompile's Triton kernels: :mod:`tncompile.runtime.triton`) gives named
runners for some ops and says which tensors it runs (``runs(like)``: device, dtype,
whether its compiler is installed). The ways ask :func:`active` for the backend of a call;
nothing in ``ways/`` imports a backend, and nothing in ``layers/`` or ``fused/`` knows one
exists.

A backend is not imported with the runtime (Triton's import alone is about half a second,
and its kernels lose on every GPU measured so far): the runtime registers a *loader*
(:func:`register_loader`), which imports and registers it the first time a call could
use it -- its switch turned on, or a tensor on a device where it is a measured candidate
-- or when the user imports it. A backend also names its device-path ops
(``device_ops``): what the dry run allows through the dispatcher besides PyTorch's.

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

__all__ = ["Backend", "register", "register_loader", "get", "active", "candidate", "runner_for", "registered",
           "device_ops"]


class Backend:
    """A named set of runners and the test of which tensors it runs. ``measured_on``: the
    device types where its runners are candidates of the measured choice
    (:mod:`.measured`) while its switch is ``None`` -- timed against the default ways on
    the device, kept only where they win."""

    def __init__(self, name: str, runs: Callable[[torch.Tensor], bool], runners: dict[str, Callable],
                 measured_on: tuple[str, ...] = (), device_ops: frozenset[str] = frozenset()):
        self.name, self.runs, self.runners = name, runs, dict(runners)
        self.measured_on, self.device_ops = tuple(measured_on), frozenset(device_ops)

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, runners={sorted(self.runners)})"


_BACKENDS: dict[str, Backend] = {}

#: which ``tuning`` switch turns each backend on (off by default: a backend stays off the hot
#: path until a measured profile shows it wins)
SWITCHES = {"triton": "TRITON_KERNELS"}


#: ``(switch, backend)`` of every registered backend that has a switch
_SWITCHED: list[tuple[str, Backend]] = []


#: ``name -> (device types where it is measured, load)`` of backends not imported yet
_LOADERS: dict[str, tuple[tuple[str, ...], Callable[[], None]]] = {}


def register(backend: Backend) -> None:
    """Add (or replace) ``backend`` under its name (its loader, if any, is done)."""
    _BACKENDS[backend.name] = backend
    _LOADERS.pop(backend.name, None)
    _pending_changed()
    _SWITCHED[:] = [(SWITCHES[name], b) for name, b in _BACKENDS.items() if name in SWITCHES]


def register_loader(name: str, load: Callable[[], None], measured_on: tuple[str, ...] = ()) -> None:
    """``load()`` imports the backend ``name`` (which then calls :func:`register`): called
    the first time its switch is on or a call's tensor is on a device type of
    ``measured_on``."""
    if name not in _BACKENDS:
        _LOADERS[name] = (tuple(measured_on), load)
        _pending_changed()


#: the switches and device types that make a pending backend load (kept with ``_LOADERS``)
_LOAD_SWITCHES: list[str] = []
_LOAD_ON_CPU = [False]


def _pending_changed() -> None:
    _LOAD_SWITCHES[:] = [SWITCHES[n] for n in _LOADERS if n in SWITCHES]
    _LOAD_ON_CPU[0] = any("cpu" in on for on, _ in _LOADERS.values())


def _load_wanted(like: torch.Tensor) -> None:
    """Import the backends a call on ``like`` could use: switched on, or measured on its
    device. A CPU call with the switches off costs a few attribute reads."""
    if like.is_cpu and not _LOAD_ON_CPU[0]:
        for switch in _LOAD_SWITCHES:
            if getattr(tuning, switch) is True:
                break
        else:
            return
    for name, (measured_on, load) in list(_LOADERS.items()):
        switch = SWITCHES.get(name)
        if (switch is not None and getattr(tuning, switch) is True) or (
                like.device.type in measured_on and (switch is None or getattr(tuning, switch) is not False)):
            _LOADERS.pop(name, None)
            _pending_changed()
            load()


def device_ops() -> frozenset[str]:
    """The ``tncompile::`` ops the registered backends run on the device path."""
    return frozenset().union(*(b.device_ops for b in _BACKENDS.values()))


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
    if _LOADERS:
        _load_wanted(like)
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
    read per registered backend, and per backend not loaded yet its switch and the device."""
    if _LOADERS:
        _load_wanted(like)
    for switch, backend in _SWITCHED:
        if getattr(tuning, switch) is True and runner in backend.runners and backend.runs(like):
            return backend.runners[runner]
    return None
