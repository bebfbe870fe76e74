"""Measured host time per compressed layer: ``compiled.report(inputs)``'s timing columns.

On a GPU an eager training step costs at least the host's time to dispatch it: the kernels
run asynchronously, and a step whose Python and dispatcher work outlasts its kernels keeps
the GPU waiting. :func:`measure_layer_times` measures that per layer: each compressed
layer's forward and backward on the input it receives in the model, timed until the calls
return (*host*) and until the device is done (*wall*; on the CPU the two are the same),
beside a dense ``nn.Linear`` / ``nn.Embedding`` of the same shape on the same input.

How, so that a layer costs what it costs in a step:

* each layer's input is captured from one forward of the model (no autograd, eval mode,
  random state restored): only shapes, dtypes and values the model really produces;
* the TT linears that merge their factors in one pass (a batch of one layout; on the
  Triton kernels every batch of the model: :mod:`~tncompile.runtime.layers.factor_groups`)
  are timed together, forward then backward, as a step runs them, and their time is
  shared among them (the merge is paid once per step);
* layers run in training mode under autograd; the backward of every output at once
  (``torch.autograd.backward``), no loss ops added; a warm-up first (plans, Triton builds).

Nothing of the model changes: training flags, parameter gradients and the random state
are put back, and factors made for the timing are dropped.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..ir.calls import call_model
from ..runtime.layers.factor_groups import merge_unit, peers_of
from ..runtime.layers import TNModule, TTLinear, TTMEmbedding

__all__ = ["LayerTime", "MeasuredSummary", "measure_layer_times", "summarize", "time_cells"]


@dataclass(frozen=True)
class LayerTime:
    """One layer's forward + backward, median seconds: until the calls returned (``host``),
    until the device finished (``wall``); the same for a dense layer of its shape
    (``None`` where there is no plain dense counterpart, e.g. a tied head)."""

    host: float
    wall: float
    dense_host: float | None
    dense_wall: float | None
    rows: int          # rows (ids for a lookup) of the captured input
    shared_with: int   # layers of its merge batch timed together (1: alone)


@dataclass(frozen=True)
class MeasuredSummary:
    """The measured layers together: one step's forward + backward of every compressed layer
    that has a dense counterpart, as compiled and as dense layers, on ``device``."""

    device: str
    layers: int
    host: float
    dense_host: float
    wall: float
    dense_wall: float
    shows_wall: bool   # a device that runs asynchronously (host and wall times differ)

    def lines(self) -> list[str]:
        extra = (self.host - self.dense_host) / max(self.layers, 1)
        out = [f"measured on {self.device} (forward + backward of each layer on its input in the model): "
               f"host {self.host * 1e3:,.3f} ms for the {self.layers} compressed layers vs "
               f"{self.dense_host * 1e3:,.3f} ms as dense layers ({extra * 1e6:+,.0f} us a layer)"]
        if self.shows_wall:
            out.append(f"  to completion: {self.wall * 1e3:,.3f} ms vs {self.dense_wall * 1e3:,.3f} ms dense; where "
                       "host time is near it, the host's dispatch is the step (captured steps remove it)")
        return out


def summarize(times: dict[str, LayerTime], device: torch.device) -> MeasuredSummary | None:
    """:class:`MeasuredSummary` of the layers with a dense counterpart (``None``: none)."""
    both = [t for t in times.values() if t.dense_host is not None]
    if not both:
        return None
    name = str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    return MeasuredSummary(name, len(both), sum(t.host for t in both), sum(t.dense_host for t in both),
                           sum(t.wall for t in both), sum(t.dense_wall for t in both), device.type != "cpu")


def time_cells(t: LayerTime | None, wall: bool) -> tuple[str, ...]:
    """A report row's measured cells: host (and wall) time, dense's in brackets."""
    def cell(mine: float, dense: float | None) -> str:
        return f"{mine * 1e6:,.0f} us" + (f" ({dense * 1e6:,.0f})" if dense is not None else "")
    if t is None:
        return ("", "") if wall else ("",)
    return (cell(t.host, t.dense_host), cell(t.wall, t.dense_wall)) if wall else (cell(t.host, t.dense_host),)


def measure_layer_times(model: nn.Module, inputs: Any, steps: int = 5, warmup: int = 2
                        ) -> dict[str, LayerTime]:
    """``layer name -> LayerTime`` for every compressed layer ``model(inputs)`` calls.

    Parameters
    ----------
    model : nn.Module
        What ``tncompile.compile`` returned (either mode).
    inputs : Tensor, tuple or dict
        One batch, as ``model`` takes it: ``model(x)``, ``model(*inputs)``, ``model(**inputs)``.
    steps : int
        Timed repetitions (the median is kept), after ``warmup`` untimed ones.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"report: steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    layers = _distinct_layers(model)
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    with torch.random.fork_rng(devices=devices):   # the model's random state is left as it was
        captured = _capture_inputs(model, inputs, layers)
        return _measure(layers, captured, steps, warmup)


#: a layer's call as captured: positional and keyword inputs
Call = tuple[tuple, dict]


def _measure(layers: dict[str, TNModule], captured: dict[str, Call], steps: int, warmup: int
             ) -> dict[str, LayerTime]:
    times: dict[str, LayerTime] = {}
    saved_grads = {p: p.grad for m in layers.values() for p in m.parameters()}
    try:
        for p in saved_grads:   # the user's gradients are set aside, not accumulated into
            p.grad = None
        for group in _timing_groups(layers, captured):
            mods = [layers[name] for name in group]
            calls = [captured[name] for name in group]
            host, wall = _time(mods, calls, steps, warmup)
            dense = [_dense_like(m) for m in mods]
            dense_host = dense_wall = None
            if all(d is not None for d in dense):
                dense_host, dense_wall = _time(dense, [((args[0],), {}) for args, _ in calls], steps, warmup)
            share = len(group)
            for name, (args, _) in zip(group, calls):
                times[name] = LayerTime(host / share, wall / share,
                                        None if dense_host is None else dense_host / share,
                                        None if dense_wall is None else dense_wall / share,
                                        _rows(args[0]), share)
    finally:
        for p, g in saved_grads.items():
            p.grad = g
        for m in layers.values():
            peers = peers_of(m)
            if peers is not None:
                peers.forget()
    return times


def _distinct_layers(model: nn.Module) -> dict[str, TNModule]:
    """Each compressed layer once (a table looked up under several names: its first)."""
    out, seen = {}, set()
    for name, m in model.tensorized_modules().items():
        if id(m) not in seen:
            seen.add(id(m))
            out[name] = m
    return out


def _capture_inputs(model: nn.Module, inputs: Any, layers: dict[str, TNModule]) -> dict[str, Call]:
    """The first call each layer gets in one forward of ``model`` (eval mode, no autograd,
    training flags restored), its tensors copied. Layers with hooks run unfused, so every
    layer's own call happens."""
    captured: dict[str, Call] = {}

    def keep(name: str) -> Callable:
        def hook(_module, args, kwargs):
            if name not in captured and args and isinstance(args[0], torch.Tensor):
                captured[name] = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                                          (tuple(args), dict(kwargs)))
        return hook

    modes = {m: m.training for m in model.modules()}
    handles = [m.register_forward_pre_hook(keep(name), with_kwargs=True) for name, m in layers.items()]
    try:
        model.eval()
        with torch.no_grad():
            call_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return captured


def _timing_groups(layers: dict[str, TNModule], captured: dict[str, Call]) -> list[list[str]]:
    """Names timed together: the TT linears whose factors merge in one pass
    (:func:`~tncompile.runtime.layers.factor_groups.merge_unit`), every other layer alone."""
    groups: dict[Hashable, list[str]] = {}
    alone: list[list[str]] = []
    for name, m in layers.items():
        if name not in captured:
            continue
        unit = merge_unit(m)
        if unit is None:
            alone.append([name])
        else:
            groups.setdefault(unit, []).append(name)
    return [*groups.values(), *alone]


def _time(mods: list[nn.Module], calls: list[Call], steps: int, warmup: int) -> tuple[float, float]:
    """Median (host, wall) seconds of the modules' forwards then one backward of all
    their floating outputs; each call's first input takes a gradient where it can."""
    device = next(t for t in tree_leaves(calls) if isinstance(t, torch.Tensor)).device
    modes = [m.training for m in mods]
    calls = [((_grad_leaf(args[0]), *args[1:]), kwargs) for args, kwargs in calls]
    grads: list[torch.Tensor] | None = None
    hosts, walls = [], []
    try:
        for m in mods:
            m.train()
        for i in range(warmup + steps):
            _sync(device)
            start = time.perf_counter()
            outs = [t for m, (args, kwargs) in zip(mods, calls) for t in tree_leaves(m(*args, **kwargs))
                    if isinstance(t, torch.Tensor) and t.requires_grad]
            if grads is None:
                grads = [torch.randn_like(y) for y in outs]
            torch.autograd.backward(outs, grads)
            returned = time.perf_counter()
            _sync(device)
            done = time.perf_counter()
            if i >= warmup:
                hosts.append(returned - start)
                walls.append(done - start)
            for m in mods:
                m.zero_grad(set_to_none=True)
    finally:
        for m, training in zip(mods, modes):
            m.train(training)
    return statistics.median(hosts), statistics.median(walls)


def _grad_leaf(x: torch.Tensor) -> torch.Tensor:
    """A leaf copy of ``x`` that takes a gradient (floating inputs), as a layer's input does in a step."""
    return x.detach().requires_grad_() if x.is_floating_point() else x


def _dense_like(m: TNModule) -> nn.Module | None:
    """A dense layer of ``m``'s shape on its device and dtype (``None``: no plain counterpart)."""
    param = next(m.parameters())
    if type(m) is TTLinear:
        return nn.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                         device=param.device, dtype=param.dtype)
    if type(m) is TTMEmbedding:
        return nn.Embedding(m.num_embeddings, m.embedding_dim, device=param.device, dtype=param.dtype)
    return None


def _rows(x: torch.Tensor) -> int:
    """Rows of a layer's input (ids, for a lookup)."""
    return x.numel() if not x.is_floating_point() else x.numel() // max(x.shape[-1], 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
