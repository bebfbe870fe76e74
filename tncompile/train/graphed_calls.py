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
* **Proved before captured** (``check=True``, the default): before a signature's first
  capture its forward and backward run on fake tensors through :func:`~.dry_run.dry_run`;
  one that reads a value to the host, makes a data-sized tensor or runs a CPU kernel
  stays eager, with one warning naming each such op, its module and source line.
* **Shapes that never repeat stop capturing**: when as many graphs as ``max_graphs`` were
  dropped without ever being replayed (dynamic padding: a new length every batch), the
  model's calls run eagerly from then on, with one warning saying how to pad.
  FSDP2-sharded parameters (gathered and freed around every call) are never captured.

On a machine without CUDA the same bookkeeping runs on :class:`EmulatedGraphs` (tests):
a "replay" re-runs the captured function and copies its results into the static
buffers, so static inputs and outputs, copies and invalidation behave as on a GPU.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from typing import Any, Callable, Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import tuning
from ..api import AFTER_COMPILE
from ..errors import check_int
from ..runtime.layers.module_kinds import is_sharded
from .dry_run import dry_run
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
        self.served = 0                                 # calls replayed from it (its capture call the first)


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
    check : bool
        Dry-run each signature's forward and backward on fake tensors before its first
        capture; a signature with an op that would break capture stays eager.
    """

    def __init__(self, model: nn.Module, forward: Callable, warmup: int = 2, max_graphs: int = 4,
                 graphs: CudaGraphs | EmulatedGraphs | None = None, check: bool = True):
        check_int(warmup, "warmup", 1)
        try:   # what inspect (HF Trainer picks dataset columns by it) sees: the model's own parameters
            self.__signature__ = inspect.signature(forward)
        except (TypeError, ValueError):
            pass
        self.check = bool(check)
        self.proved: set[Hashable] = set()   # signatures the dry run found capture-safe (this model state)
        self.unreplayed_drops = 0   # graphs evicted having served no call but their capture
        self.churning = False       # inputs change shape too often: no more captures
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
        self.sharded = False        # FSDP2 gathers and frees its parameters around every call
        self.replaced: Callable | None = None   # the instance's own forward graph_calls replaced
        self._seen_state: Hashable = None

    # ------------------------------------------------------------ the call
    def __call__(self, *args, **kwargs):
        model = self.model_ref()
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(model, leaves, spec)
        state = self._state(model) if key is not None else None
        if state is not None and state != self._seen_state:   # parameters replaced: sharded now?
            self._seen_state = state
            self.sharded = is_sharded(model)
            self.proved.clear()   # a changed model is proved again
        if key is None or key in self.eager_only or self.sharded:
            self.stats["eager"] += 1
            return self.forward(*args, **kwargs)
        if self.cache.check_token(state):
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
        if self.check and not self._proved(model, key, args, kwargs):
            self.stats["eager"] += 1
            return self.forward(*args, **kwargs)
        entry = self._capture(model, key, leaves, spec)
        if entry is None:
            return self.forward(*args, **kwargs)
        self._count_unreplayed(model, self.cache.add(key, entry))
        return self._replay(entry, leaves)

    def _proved(self, model, key: Hashable, args, kwargs) -> bool:
        """Dry-run this call's forward and backward on fake tensors (:func:`~.dry_run.dry_run`);
        a signature with hazards stays eager, named in one warning."""
        if key in self.proved:
            return True
        device_type = self.graphs.device_type
        amp = "bf16" if (torch.is_autocast_enabled(device_type)
                         and torch.get_autocast_dtype(device_type) == torch.bfloat16) else None
        probe = _CallWith(model)
        wrapped = model.__dict__.pop("forward", None)   # the dry run's copy runs the model's own forward
        try:
            report = dry_run(probe, torch.optim.SGD([p for p in probe.parameters() if p.requires_grad], lr=0.0),
                             _sum_of_outputs, (args, kwargs), None, amp=amp)
        except Exception as e:  # noqa: BLE001 - a check that cannot run proves nothing: stay eager
            self.eager_only.add(key)
            warnings.warn(f"tncompile.graph_calls: calls of {type(model).__name__} run eagerly: their capture "
                          f"could not be checked ({type(e).__name__}: {str(e)[:200]}); graph_calls(model, "
                          "check=False) captures unchecked", stacklevel=4)
            return False
        finally:
            if wrapped is not None:
                model.__dict__["forward"] = wrapped
        if not report.ok:
            self.eager_only.add(key)
            warnings.warn(f"tncompile.graph_calls: calls of {type(model).__name__} with these inputs run "
                          f"eagerly, not from CUDA graphs: {report}", stacklevel=4)
            return False
        self.proved.add(key)
        return True

    def _count_unreplayed(self, model, evicted: list) -> None:
        """Graphs dropped having served only their capture call: at ``max_graphs`` of them,
        inputs change shape too often for graphs to pay; capture no more."""
        self.unreplayed_drops += sum(1 for e in evicted if e.served <= 1)
        if self.unreplayed_drops >= self.cache.max_graphs and not self.churning:
            self.churning = True
            warnings.warn(f"tncompile.graph_calls: calls of {type(model).__name__} run eagerly from now on: "
                          f"{self.unreplayed_drops} graphs were captured and dropped without being replayed, so "
                          "the inputs' shapes rarely repeat (a new padded length every batch?). Pad batches to a "
                          "few lengths (e.g. DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64)), or raise "
                          "max_graphs", stacklevel=4)

    def _key(self, model, leaves: list, spec) -> Hashable | None:
        """The call's signature, or ``None`` where no graph may serve it."""
        if model is None or self.churning or not torch.is_grad_enabled() or torch.compiler.is_compiling():
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
        entry.served += 1
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


class _CallWith(nn.Module):
    """``model(*args, **kwargs)`` as one module called with ``(args, kwargs)``: what the dry
    run calls (it calls its model with a tuple's items). Its ``anchor`` is a parameter the
    dry run's optimizer always has, and its loss always reaches, also for a frozen model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, args: tuple, kwargs: dict):
        return self.model(*args, **kwargs), self.anchor


def _sum_of_outputs(outputs, _targets) -> torch.Tensor:
    """A scalar whose backward reaches every differentiable output (the dry run's loss)."""
    leaves = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.stack([t.float().sum() for t in leaves]).sum()


def graph_calls(model: nn.Module, *, warmup: int = 2, max_graphs: int = 4,
                graphs: CudaGraphs | EmulatedGraphs | None = None, check: bool = True) -> nn.Module:
    """Make ``model``'s calls replay CUDA graphs (see :mod:`tncompile.train.graphed_calls`);
    returns ``model`` (its ``forward`` wrapped on the instance; :func:`ungraph_calls`
    undoes it). Calling it again replaces the earlier wrapping. ``check``: dry-run each
    signature on fake tensors before capturing it (a hazard keeps it eager)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"graph_calls needs an nn.Module, got {type(model).__name__}")
    ungraph_calls(model)
    calls = GraphedCalls(model, model.forward, warmup=warmup, max_graphs=max_graphs, graphs=graphs, check=check)
    calls.replaced = model.__dict__.get("forward")   # an instance's own forward (a CompiledModel's) comes back
    model.__dict__["forward"] = calls
    return model


def ungraph_calls(model: nn.Module) -> nn.Module:
    """Undo :func:`graph_calls` (its graphs are freed with it); a model without it is returned as is."""
    calls = model.__dict__.get("forward")
    if isinstance(calls, GraphedCalls):
        if calls.replaced is not None:
            model.__dict__["forward"] = calls.replaced
        else:
            del model.__dict__["forward"]
    return model


def _graph_calls_if_asked(model: nn.Module) -> None:
    """``compile``'s last step under ``tuning.GRAPH_CALLS``: the model it hands back replays
    CUDA graphs in the user's own loop."""
    if tuning.GRAPH_CALLS:
        graph_calls(model)


AFTER_COMPILE.append(_graph_calls_if_asked)
