"""A model's own calls, forward and backward, replayed from CUDA graphs in the user's loop.

:class:`~tncompile.train.TrainStep` captures a whole training step, but many users keep
their own loop (HF ``Trainer``, plain PyTorch): ``loss = model(**batch).loss``,
``loss.backward()``, ``opt.step()``. There an eager step is bound by the host's dispatch
(a 1B Llama's dense step on an H200 spent 114 of its 163 ms launching kernels).
:func:`graph_calls` makes such a model's calls replay CUDA graphs, in the style of
``torch.cuda.make_graphed_callables``: per input signature, after ``warmup`` eager calls,
one graph of the forward and one of the backward; a call then copies its inputs into the
graph's static inputs and replays the forward; its ``backward()`` replays the backward,
which hands the parameters their gradients (accumulated by autograd as usual).

What a user may rely on:

* **Outputs are the caller's.** Each call returns fresh tensors (copies of the graph's
  static outputs), so a loss or logits kept across steps never change under the caller.
* **Gradients accumulate.** The backward returns copies, never the graph's buffers, so
  ``.grad`` is never aliased to memory the next replay overwrites (gradient accumulation
  over micro-batches sums as in eager).
* **Every change selects or makes its own graph**: input shapes, dtypes and
  ``requires_grad``, non-tensor arguments, ``train()`` / ``eval()``, grad mode and
  autocast each key a graph of their own (at most ``max_graphs``, least recently used
  dropped first).
* **Graphs never go stale**: the parameters' identities, storage and ``requires_grad`` are
  checked on every call; ``p.data = ...``, a rank cut or a new parameter drops every graph
  (re-captured after warm-up). In-place updates (optimizers, ``load_state_dict``) need none.
* **A clean fallback**: calls run eagerly where a graph cannot serve them -- no grad, a
  tensor off the GPU, an output that is not tensors (HF's ``DynamicCache``: pass
  ``use_cache=False`` when training, or set ``model.config.use_cache = False``), a second
  forward before the first's backward (its saved activations would be overwritten), or a
  capture that failed (named in one warning, then that signature stays eager).

On a machine without CUDA the same bookkeeping runs on :class:`EmulatedGraphs` (tests):
a "replay" re-runs the captured function and copies its results into the static
buffers, so static inputs and outputs, copies and invalidation behave as on a GPU.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import check_int
from .capture_cache import CaptureCache
from .side_stream import on_side_stream, side_stream

__all__ = ["graph_calls", "ungraph_calls", "GraphedCalls", "CudaGraphs", "EmulatedGraphs"]

#: non-tensor argument and output leaves a graph may key on or return as they were
_PLAIN = (type(None), bool, int, float, str)


class CudaGraphs:
    """Captures on CUDA: ``capture(fn)`` records ``fn`` into a ``torch.cuda.CUDAGraph``
    (all graphs of one :class:`GraphedCalls` share a memory pool, on the shared side
    stream) and returns ``(replay, fn's result)``; its result's tensors are the static
    buffers each replay rewrites."""

    device_type = "cuda"

    def __init__(self) -> None:
        self.pool = None

    def warm_context(self):
        """Warm-up calls run on the side stream the captures use (its cuBLAS workspace
        and lazy initializations are made before a capture, where they may not be)."""
        return on_side_stream()

    def reset(self) -> None:
        """A fresh pool for later captures: the dropped graphs' memory goes back with theirs."""
        self.pool = None

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool, stream=side_stream()):
            result = fn()
        torch.cuda.synchronize()
        return graph.replay, result


class EmulatedGraphs:
    """Captures without a GPU (tests): ``capture(fn)`` runs ``fn`` once for the static
    buffers; a replay runs it again and copies the new values into them in place."""

    device_type = "cpu"

    def warm_context(self):
        return contextlib.nullcontext()

    def reset(self) -> None:
        pass

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        static = fn()

        def replay() -> None:
            with torch.enable_grad():   # called from an autograd Function's forward (no grad there)
                fresh = fn()
            with torch.no_grad():
                for buffer, value in zip(_tensors(static), _tensors(fresh)):
                    buffer.copy_(value)
        return replay, static


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Entry:
    """One signature's two graphs and their static buffers."""

    def __init__(self, inputs: list, wants_grad: list[bool], params: list[nn.Parameter]):
        self.static_inputs = inputs                     # the call's leaves (tensors cloned)
        self.wants_grad = wants_grad                    # per tensor input: requires_grad
        self.params = params
        self.forward_replay: Callable[[], None] | None = None
        self.backward_replay: Callable[[], None] | None = None
        self.outputs: list = []                         # static output leaves
        self.out_spec = None
        self.differentiable: list[int] = []             # indices of outputs that carry gradients
        self.grad_outputs: list[torch.Tensor] = []      # static incoming gradients
        self.grads: list[torch.Tensor | None] = []      # static gradients of inputs, then params
        self.latest: list[torch.Tensor] = []            # outputs whose autograd graph backward runs


class _Replay(torch.autograd.Function):
    """Forward: replay the forward graph, return copies of its outputs. Backward: copy the
    incoming gradients into the static ones, replay the backward graph, return copies."""

    @staticmethod
    def forward(ctx, calls: "GraphedCalls", entry: _Entry, *tensors: torch.Tensor):
        entry.forward_replay()
        ctx.calls, ctx.entry = calls, entry
        outs = [o.clone() for o in (entry.outputs[i] for i in entry.differentiable)]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        entry = ctx.entry
        with torch.no_grad():
            for buffer, g in zip(entry.grad_outputs, grads):
                buffer.copy_(g) if g is not None else buffer.zero_()
        entry.backward_replay()
        ctx.calls.pending = None
        inputs = [g.clone() if g is not None else None for g in entry.grads]
        return (None, None, *inputs)


class GraphedCalls:
    """``model``'s calls through CUDA graphs (see the module docstring).

    Parameters
    ----------
    model : nn.Module
        Called as ``forward(*args, **kwargs)``; its outputs a tensor or a pytree of tensors
        and plain values (``ModelOutput``, tuples, dicts).
    forward : callable
        The model's own forward (what eager calls run).
    warmup : int
        Eager calls per signature before its capture (measured ways, lazy workspaces and
        optimizer state settle in them).
    max_graphs : int
        Signatures with live graphs at once.
    graphs : CudaGraphs or EmulatedGraphs, optional
        How to capture; CUDA by default.
    """

    def __init__(self, model: nn.Module, forward: Callable, warmup: int = 2, max_graphs: int = 4,
                 graphs: CudaGraphs | EmulatedGraphs | None = None):
        check_int(warmup, "warmup", 1)
        self.model_ref = weakref.ref(model)
        self.forward = forward
        self.graphs = graphs if graphs is not None else CudaGraphs()
        self.cache = CaptureCache(max_graphs=max_graphs, warmup_steps=warmup)
        self.eager_only: set[Hashable] = set()
        self.stats = {"replays": 0, "captures": 0, "eager": 0, "fallbacks": 0}
        self._emulated = isinstance(self.graphs, EmulatedGraphs)
        #: the replayed call whose backward is still due: its saved activations live in the
        #: graphs' shared pool, where any other replay may write, so until it runs (or its
        #: outputs are dropped) every call runs eagerly
        self.pending: weakref.ref | None = None

    # ------------------------------------------------------------ the call
    def __call__(self, *args, **kwargs):
        model = self.model_ref()
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(model, leaves, spec)
        if key is None or key in self.eager_only:
            self.stats["eager"] += 1
            return self.forward(*args, **kwargs)
        if self.cache.check_token(self._state(model)):
            self.graphs.reset()
        decision = self.cache.decide(key)
        if decision != "eager" and self.pending is not None and self.pending() is not None:
            self.stats["fallbacks"] += 1     # a replay's backward is still due: no graph may run now
            return self.forward(*args, **kwargs)
        if decision == "replay":
            return self._replay(self.cache.get(key), leaves)
        if decision == "eager":
            self.cache.warmed(key)
            self.stats["eager"] += 1
            with self.graphs.warm_context():
                return self.forward(*args, **kwargs)
        entry = self._capture(model, key, leaves, spec)
        if entry is None:
            return self.forward(*args, **kwargs)
        self.cache.add(key, entry)
        return self._replay(entry, leaves)

    def _key(self, model, leaves: list, spec) -> Hashable | None:
        """The call's signature, or ``None`` where no graph may serve it."""
        if model is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        parts = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if not (self._emulated or leaf.is_cuda):
                    return None
                parts.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
            elif isinstance(leaf, _PLAIN):
                parts.append(("value", type(leaf).__name__, leaf))
            else:
                return None
        if not self._emulated and torch.cuda.is_current_stream_capturing():
            return None
        device_type = self.graphs.device_type
        amp = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        return (spec, tuple(parts), model.training, amp)

    @staticmethod
    def _state(model) -> Hashable:
        """What makes every graph stale when it changes: the parameters' identities,
        storage and ``requires_grad``."""
        return tuple((id(p), p.data_ptr(), p.requires_grad) for p in model.parameters())

    # ------------------------------------------------------------ capture and replay
    def _capture(self, model, key, leaves: list, spec) -> _Entry | None:
        params = [p for p in model.parameters() if p.requires_grad]
        inputs = [leaf.detach().clone().requires_grad_(leaf.requires_grad) if isinstance(leaf, torch.Tensor)
                  else leaf for leaf in leaves]
        tensor_inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
        entry = _Entry(inputs, [t.requires_grad for t in tensor_inputs], params)
        try:
            entry.forward_replay, outputs = self.graphs.capture(lambda: self._forward_leaves(entry, spec))
            entry.outputs, entry.out_spec = outputs
            if any(not isinstance(o, (torch.Tensor, *_PLAIN)) for o in entry.outputs):
                kinds = sorted({type(o).__name__ for o in entry.outputs if not isinstance(o, (torch.Tensor, *_PLAIN))})
                raise _NotGraphable(f"its outputs hold {', '.join(kinds)} (not tensors); for a Hugging Face "
                                    f"model pass use_cache=False when training (or set model.config.use_cache = False)")
            entry.differentiable = [i for i, o in enumerate(entry.outputs)
                                    if isinstance(o, torch.Tensor) and o.requires_grad]
            entry.latest = [entry.outputs[i] for i in entry.differentiable]
            entry.grad_outputs = [torch.zeros_like(o) for o in entry.latest]
            diff_inputs = [t for t, w in zip(tensor_inputs, entry.wants_grad) if w]
            if entry.differentiable:   # else (everything frozen) a forward graph alone
                entry.backward_replay, grads = self.graphs.capture(lambda: self._backward(entry, diff_inputs))
                entry.grads = list(grads)
        except Exception as e:  # noqa: BLE001 - any capture failure: this signature stays eager
            self.eager_only.add(key)
            warnings.warn(f"tncompile.graph_calls: a call of {type(model).__name__} runs eagerly, not from a CUDA "
                          f"graph: {type(e).__name__}: {e}", stacklevel=3)
            return None
        self.stats["captures"] += 1
        return entry

    def _forward_leaves(self, entry: _Entry, spec) -> tuple[list, Any]:
        args, kwargs = tree_unflatten(entry.static_inputs, spec)
        amp, device_type = contextlib.nullcontext(), self.graphs.device_type
        if torch.is_autocast_enabled(device_type):   # no cast cache inside a graph (it would outlive a replay)
            amp = torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
        with amp:
            out = self.forward(*args, **kwargs)
        leaves, out_spec = tree_flatten(out)
        if self._emulated:   # the autograd graph a backward replay runs: the latest forward's
            entry.latest = [o for o in leaves if isinstance(o, torch.Tensor) and o.requires_grad]
        return leaves, out_spec

    def _backward(self, entry: _Entry, diff_inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        wrt = [*diff_inputs, *entry.params]
        grads = torch.autograd.grad(entry.latest, wrt, entry.grad_outputs, allow_unused=True)
        return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, wrt)]

    def _replay(self, entry: _Entry, leaves: list):
        with torch.no_grad():
            for static, leaf in zip(entry.static_inputs, leaves):
                if isinstance(leaf, torch.Tensor):
                    static.copy_(leaf)
        diff_inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if entry.differentiable:
            outs = _Replay.apply(self, entry, *diff_inputs, *entry.params)
        else:
            with torch.no_grad():
                entry.forward_replay()
            outs = ()
        self.stats["replays"] += 1
        if outs and outs[0].grad_fn is not None:
            self.pending = weakref.ref(outs[0].grad_fn)
        result = list(entry.outputs)
        for i, out in zip(entry.differentiable, outs):
            result[i] = out
        for i, o in enumerate(result):   # outputs that carry no gradient: copies too
            if isinstance(o, torch.Tensor) and i not in entry.differentiable:
                result[i] = o.clone()
        return tree_unflatten(result, entry.out_spec)


class _NotGraphable(RuntimeError):
    pass


def graph_calls(model: nn.Module, *, warmup: int = 2, max_graphs: int = 4,
                graphs: CudaGraphs | EmulatedGraphs | None = None) -> nn.Module:
    """Make ``model``'s calls replay CUDA graphs (see :mod:`tncompile.train.graphed_calls`);
    returns ``model`` (its ``forward`` wrapped on the instance; :func:`ungraph_calls`
    undoes it). Calling it again replaces the earlier wrapping."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"graph_calls needs an nn.Module, got {type(model).__name__}")
    ungraph_calls(model)
    calls = GraphedCalls(model, model.forward, warmup=warmup, max_graphs=max_graphs, graphs=graphs)
    model.__dict__["forward"] = calls
    return model


def ungraph_calls(model: nn.Module) -> nn.Module:
    """Undo :func:`graph_calls` (its graphs are freed with it); a model without it is returned as is."""
    if isinstance(model.__dict__.get("forward"), GraphedCalls):
        del model.__dict__["forward"]
    return model
