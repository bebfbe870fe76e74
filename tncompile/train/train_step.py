"""``TrainStep``: a whole training step as one callable -- CUDA graphs on GPU, eager on CPU.

    step = tncompile.TrainStep(compiled, optimizer, loss_fn, controller=ctl)
    for x, y in loader:
        loss = step(x, y)          # forward, penalty, backward, clip, optimizer, controller

On CUDA with ``cuda_graph`` on, each input signature (shapes, dtypes,
non-tensor values) first runs ``warmup_steps`` real eager steps on a side
stream (this allocates gradients and optimizer state outside any graph),
then is captured once -- forward, backward, rank penalty, gradient clipping
and optimizer step in one graph -- and replayed on every later call with the
inputs copied into its static buffers. Signatures are captured per exact
size (no padding, so any loss function stays exact) under an LRU cap of
``max_graphs``, all graphs sharing one memory pool. Whenever the model's
state changes -- the controller cuts ranks or switches stage, parameters are
replaced, or their dtype or device changes -- every graph is dropped and
re-captured; a stale graph is never replayed. The returned loss is a copy,
never a buffer that the next replay overwrites.

Elsewhere (CPU, or ``cuda_graph=False``) the same step runs eagerly,
computing the same thing.

``compile=True`` runs the model through ``torch.compile`` (captured too, on CUDA);
``compile="auto"`` times the steps of both ways per signature and keeps the faster
(:mod:`.step_ways`; ``stats()["ways"]`` has the figures).
"""
from __future__ import annotations

import contextlib
import contextvars
import time
import warnings
from typing import Any, Callable, Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import check_materialized
from ..ir.calls import call_model
from ..runtime.layers.derived import advance_weights_epoch
from .ddp import DDP_WARMUP_STEPS, check_controller_group, is_ddp, unwrap
from .capture_cache import CaptureCache
from .sharding import is_sharded
from .side_stream import on_side_stream, side_stream
from .step_guard import StepGuard
from .step_ways import StepWays

__all__ = ["TrainStep", "call_model", "make_capturable"]

AMP_DTYPES = {"bf16": torch.bfloat16}


#: set by the dry run, whose TrainStep steps a copy of the model on the meta device on purpose
_CHECKING_ON_META = contextvars.ContextVar("tncompile_checking_on_meta", default=False)


@contextlib.contextmanager
def checking_on_meta():
    """Within it, a ``TrainStep`` may be built on a model on the meta device (the dry run's copy)."""
    token = _CHECKING_ON_META.set(True)
    try:
        yield
    finally:
        _CHECKING_ON_META.reset(token)


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Switch ``optimizer`` to its CUDA-graph-safe mode (``capturable=True``,
    step counters on the device), or raise ``TypeError`` saying why it cannot be."""
    if "capturable" in optimizer.defaults:
        for group in optimizer.param_groups:
            group["capturable"] = True
        for p, state in optimizer.state.items():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                state["step"] = step.to(p.device, torch.float32)
        return
    if type(optimizer) is torch.optim.SGD:
        return  # no host-side state: its update is capturable as is
    raise TypeError(
        f"{type(optimizer).__name__} cannot be captured in a CUDA graph: it has no capturable mode "
        "(its step keeps host-side state or syncs with the host). Use Adam, AdamW, SGD or another "
        "optimizer with capturable=True, or TrainStep(..., cuda_graph=False).")


class _Captured:
    """One captured step: its graph, static input buffers and static loss."""

    def __init__(self, graph, static_leaves: list, losses: tuple[torch.Tensor, torch.Tensor], bytes_: int):
        self.graph, self.static_leaves, self.losses, self.bytes = graph, static_leaves, losses, bytes_

    def run(self, leaves: list) -> tuple[torch.Tensor, torch.Tensor]:
        for buf, x in zip(self.static_leaves, leaves):
            if isinstance(buf, torch.Tensor):
                buf.copy_(x, non_blocking=True)
        self.graph.replay()
        advance_weights_epoch()  # the replayed optimizer step bumped no version counter
        return tuple(t.clone() for t in self.losses)


class TrainStep:
    """One training step of a compiled model, captured as CUDA graphs where possible.

    Parameters
    ----------
    compiled : nn.Module
        The model (usually a ``CompiledModel``); called as ``compiled(x)``,
        ``compiled(*x)`` or ``compiled(**x)`` for a tensor, tuple or dict.
    optimizer : torch.optim.Optimizer
    loss_fn : callable
        ``loss_fn(outputs, targets) -> scalar tensor``.
    controller : RankController, optional
        Adds its penalty inside the step and is stepped after it; its
        truncations and stage switches trigger re-capture. With a
        controller, a step whose loss or gradients are not finite leaves
        the parameters and optimizer state as they were, decided on the
        device (:class:`~.step_guard.StepGuard`); ``skipped_steps()`` counts them,
        and the controller's ``nonfinite`` decides whether training raises
        (``FloatingPointError`` at its next host read) or goes on.
    cuda_graph : {"auto", True, False}
        ``"auto"``: capture when the model is on CUDA (and not sharded by
        FSDP2, which runs eagerly; ``True`` with FSDP2 is an error).
    amp : {None, "bf16"}
        Autocast forward and loss in bfloat16 (parameters, gradients and
        optimizer state stay fp32).
    grad_clip : float, optional
        Clip the global gradient norm (no host sync).
    max_graphs : int
        Most captured signatures kept (LRU).
    warmup_steps : int
        Eager steps per signature before capture (under DDP at least
        ``DDP_WARMUP_STEPS`` = 11, as PyTorch's CUDA-graph notes require; the
        count starts over after every cut, which builds a new DDP wrapper).
    max_batch : int, optional
        Reject batches (first dimension of the first input tensor) above this.
    compile : {False, True, "auto"}
        ``True``: run the model through ``torch.compile`` (on CUDA, that step is what is
        captured). ``"auto"``: per input signature, time ``tuning.STEP_MEASURE_STEPS``
        steps each way once it has settled -- the model as it is, then compiled -- and keep
        the faster; measuring costs one compilation, no extra steps. A compiled way that
        raises is dropped for the plain one, with a warning.
    """

    def __init__(self, compiled: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 controller=None, cuda_graph: bool | str = "auto", amp: str | None = None, *,
                 grad_clip: float | None = None, max_graphs: int = 8, warmup_steps: int = 2,
                 max_batch: int | None = None, compile: bool | str = False):
        wrapper = compiled if unwrap(compiled) is not compiled else None  # DDP / DistributedModel
        compiled = unwrap(compiled)
        params = [p for p in compiled.parameters()]
        if not params:
            raise ValueError("TrainStep: the model has no parameters to train")
        if not _CHECKING_ON_META.get():
            check_materialized(compiled, "TrainStep")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TrainStep: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError("TrainStep: loss_fn must be callable as loss_fn(outputs, targets)")
        if controller is not None and wrapper is not None and not hasattr(wrapper, "after_step"):
            raise TypeError("TrainStep: a plain DistributedDataParallel wrapper keeps reducing the parameters a "
                            "rank cut replaces; wrap the compiled model in tncompile.distributed.DistributedModel("
                            "compiled, **ddp_kwargs) instead (it rebuilds DDP after each cut)")
        if controller is not None and getattr(controller, "compiled", None) is not compiled:
            raise ValueError("TrainStep: the controller was built for a different model")
        check_controller_group(controller, wrapper)
        if amp is not None and amp not in AMP_DTYPES:
            raise ValueError(f"TrainStep: amp must be None or one of {sorted(AMP_DTYPES)}, got {amp!r} "
                             "(fp16 needs loss scaling; use bf16)")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"TrainStep: grad_clip must be > 0, got {grad_clip!r}")
        if max_batch is not None and not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"TrainStep: max_batch must be an int >= 1, got {max_batch!r}")
        if cuda_graph not in ("auto", True, False):
            raise ValueError(f"TrainStep: cuda_graph must be 'auto', True or False, got {cuda_graph!r}")
        device = params[0].device
        sharded = is_sharded(compiled)
        if cuda_graph is True and sharded:
            raise ValueError("TrainStep: cuda_graph=True with an FSDP2-sharded model is not supported (FSDP2 "
                             "gathers and frees parameters on its own streams around every unit, which a "
                             "captured graph would replay stale); use cuda_graph=False, or DDP "
                             "(tncompile.distributed.DistributedModel) to capture")
        if cuda_graph is True and device.type != "cuda":
            raise ValueError(f"TrainStep: cuda_graph=True needs the model on a CUDA device, it is on {device}; "
                             "move it with .to('cuda') or use cuda_graph='auto'")
        self.compiled, self.optimizer, self.loss_fn, self.controller = compiled, optimizer, loss_fn, controller
        self.amp, self.grad_clip, self.max_batch = amp, grad_clip, max_batch
        self.autocast_device: str | None = None  # None: the parameters' device type (a dry run sets "cuda")
        self.use_graphs = device.type == "cuda" and cuda_graph in ("auto", True) and not sharded  # FSDP2: eager
        # settled: warm-up steps and, captured, the capture step (plain: tncompile's own ways measure first)
        self.ways = StepWays(compile, settle_steps=warmup_steps + 1 if self.use_graphs else 2)
        self.wrapper = wrapper
        self._forwards: dict[str, Callable] = {"plain": wrapper or compiled}
        if compile is True:
            self._forwards["compiled"] = torch.compile(wrapper or compiled)
        self._forward = self._forwards["compiled" if compile is True else "plain"]
        if self.use_graphs:
            make_capturable(optimizer)
        if wrapper is not None and is_ddp(wrapper):
            warmup_steps = max(warmup_steps, DDP_WARMUP_STEPS)
            if self.use_graphs and hasattr(wrapper, "use_stream"):
                wrapper.use_stream(side_stream())  # DDP built on the stream it is captured on
        self.cache = CaptureCache(max_graphs, warmup_steps)
        self._pool = None
        self._structure = None
        self.last_event = None
        self.last_total: torch.Tensor | None = None
        # with a controller, a step whose loss or gradients are not finite is left undone (on the device)
        self.guard = StepGuard() if controller is not None else None

    # ------------------------------------------------------------ checks
    def _check_inputs(self, leaves: list, spec) -> None:
        described = [("tensor", t.dim()) if isinstance(t, torch.Tensor) else ("value", type(t).__name__)
                     for t in leaves]
        if self._structure is None:
            self._structure = (spec, described)
        elif (spec, described) != self._structure:
            raise ValueError(f"TrainStep: inputs changed structure. First call: {self._structure[0]}; "
                             f"this call: {spec}. A TrainStep serves one input structure; build another "
                             "for a different one.")
        device = next(iter(self.compiled.parameters())).device
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.device != device:
                raise ValueError(f"TrainStep: input leaf {i} is on {t.device}, the model on {device}; "
                                 "move the batch first")
        if self.max_batch is not None:
            first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), None)
            if first is not None and first.shape[0] > self.max_batch:
                raise ValueError(f"TrainStep: batch of {first.shape[0]} is larger than max_batch="
                                 f"{self.max_batch}; split it or raise max_batch")

    def _state_token(self) -> tuple:
        params = list(self.compiled.parameters())
        return (getattr(self.controller, "version", None), params[0].device, params[0].dtype,
                tuple(id(p) for p in params), self.amp)

    # ------------------------------------------------------------ the step
    def _autocast(self):
        if self.amp is None:
            return contextlib.nullcontext()
        device = next(iter(self.compiled.parameters())).device
        # no cast cache while capturing: cached casts would be stale on replay (PyTorch's CUDA-graph notes)
        return torch.autocast(device_type=self.autocast_device or device.type, dtype=AMP_DTYPES[self.amp],
                              cache_enabled=not self.use_graphs)

    def _body(self, inputs: Any, targets: Any, set_to_none: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One step; returns the task loss and the minimized total (both detached)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        with self._autocast():
            loss = self.loss_fn(call_model(self._forward, inputs), targets)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"TrainStep: loss_fn must return a scalar tensor (to backpropagate through), got "
                            f"{type(loss).__name__} {loss!r}")
        if loss.dim() != 0:
            raise ValueError(f"TrainStep: loss_fn must return a scalar, got shape {tuple(loss.shape)}")
        total = loss.float() + self.controller.penalty(loss.float()) if self.controller is not None else loss
        total.backward()
        if self.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.compiled.parameters(), self.grad_clip, foreach=True)
        if self.guard is not None:
            self.guard.step(self.optimizer, total)
        else:
            self.optimizer.step()
        return loss.detach(), total.detach()

    def skipped_steps(self) -> int:
        """Steps whose loss or gradients were not finite and were left undone (a host read)."""
        return 0 if self.guard is None or self.guard.skipped is None else int(self.guard.skipped)

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Run one training step on ``(inputs, targets)``; returns the task loss
        (a fresh tensor). ``last_total`` holds the minimized total (task plus
        penalty), ``last_event`` what the controller did."""
        leaves, spec = tree_flatten((inputs, targets))
        self._check_inputs(leaves, spec)
        # the signature keys graphs and measurements; a fixed eager step needs none
        key = self._signature(leaves) if self.use_graphs or self.ways.mode == "auto" else None
        way = self.ways.way(key)
        timed = self.ways.timed(key, way)
        start = self._clock() if timed else None
        try:
            loss, self.last_total = self._run_way(way, key, inputs, targets, leaves, spec)
        except Exception as e:  # noqa: BLE001 - measuring: a compiled way that fails is dropped
            if way != "compiled" or self.ways.mode != "auto":
                raise
            self._drop_compiled(key, e)
            way, timed = "plain", False
            loss, self.last_total = self._run_way(way, key, inputs, targets, leaves, spec)
        chosen = self.ways.ran(key, way, self._clock() - start if timed else None)
        if chosen is not None and self.use_graphs:   # the other way's graph is not replayed again
            self.cache.drop((key, "plain" if chosen == "compiled" else "compiled"))
        if self.controller is not None:
            self.last_event = self.controller.step()
            if self.wrapper is not None and hasattr(self.wrapper, "after_step"):
                self.wrapper.after_step(self.last_event)  # a new DDP wrapper over cut parameters
        return loss

    @staticmethod
    def _signature(leaves: list) -> Hashable:
        return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("value", repr(t))
                     for t in leaves)

    def _clock(self) -> float:
        """Seconds, after the device's queued work (timed steps only)."""
        device = next(iter(self.compiled.parameters())).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _run_way(self, way: str, key: Hashable, inputs, targets, leaves, spec) -> tuple[torch.Tensor, torch.Tensor]:
        if way not in self._forwards:
            self._forwards[way] = torch.compile(self._forwards["plain"])
        self._forward = self._forwards[way]
        if not self.use_graphs:
            return self._body(inputs, targets, set_to_none=True)
        return self._graph_step(inputs, targets, leaves, spec, (key, way))

    def _drop_compiled(self, key: Hashable, error: Exception) -> None:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        self.ways.failed(key, reason)
        if self.use_graphs:
            self.cache.drop((key, "compiled"))
        warnings.warn(f"TrainStep(compile='auto'): the compiled model failed on inputs {key}, which run as "
                      f"the model is from now on: {reason}", stacklevel=3)

    def _graph_step(self, inputs, targets, leaves, spec, key: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cache.check_token(self._state_token()):
            self._pool = None  # the dropped graphs' memory goes back with their pool
        decision = self.cache.decide(key)
        if decision == "replay":
            return self.cache.get(key).run(leaves)
        if decision == "eager":
            with on_side_stream():
                losses = self._body(inputs, targets, set_to_none=False)
            self.cache.warmed(key)
            return losses
        captured = self._capture(leaves, spec)
        self.cache.add(key, captured)
        return captured.run(leaves)

    def _capture(self, leaves: list, spec) -> _Captured:
        static_leaves = [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves]
        static_inputs, static_targets = tree_unflatten(static_leaves, spec)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side_stream()):
            losses = self._body(static_inputs, static_targets, set_to_none=False)
        torch.cuda.synchronize()
        return _Captured(graph, static_leaves, losses, torch.cuda.memory_allocated() - before)

    # ------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """Live graphs, captures, replays, eager steps, evictions, invalidations,
        the memory the live graphs hold (bytes, CUDA only), and with ``compile="auto"``
        per signature the way chosen and each way's median step time (``"ways"``)."""
        out = dict(vars(self.cache.stats))
        out["graph_bytes"] = sum(g.bytes for g in self.cache._graphs.values())
        out["mode"] = "cuda_graph" if self.use_graphs else "eager"
        out["compile"] = self.ways.mode
        if self.ways.mode == "auto":
            out["ways"] = self.ways.rows()
        return out

    def __repr__(self) -> str:
        return (f"TrainStep(mode={'cuda_graph' if self.use_graphs else 'eager'}, compile={self.ways.mode!r}, "
                f"graphs={len(self.cache)})")
