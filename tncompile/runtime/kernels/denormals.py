"""Subnormal floats flushed to zero while a compressed model computes on the CPU.

Early in training a network's backward can make subnormal intermediates (below 1.2e-38 in
fp32 and bf16), which x86 cores compute 10-100x slower than normal floats; GPUs flush
them. :func:`call_flushing` runs a compressed model's forward with flush-to-zero and
denormals-are-zero set on every intra-op thread, and its backward too (set when the
backward reaches the model's outputs, restored when that backward ends); what the caller
had before is put back both times. Nothing changes process-wide: the user's own CPU work
outside the model keeps IEEE subnormals.

Every thread: ``torch.set_flush_denormal`` sets the calling thread only (the intra-op
workers keep theirs); the native op ``tncompile::flush_denormals`` sets each worker too.
Without the native kernels (``TNCOMPILE_NATIVE=0``, no compiler) only the calling thread
flushes. ``tuning.FLUSH_DENORMALS = False`` turns it off.

A flushed value is below 1.2e-38: against any gradient a model trains on, zero; the
numerics tests compare flushed gradients with the dense reference.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from ... import tuning

__all__ = ["call_flushing", "flush_denormals", "flushing"]

_state = threading.local()   # depth: nested scopes of this thread; restore: backward's pending restore


def flush_denormals(on: bool) -> bool:
    """Set (or clear) flush-to-zero on the calling thread and every intra-op worker;
    whether the calling thread was flushing before."""
    from ..native import native_ops
    ops = native_ops()
    if ops is not None and hasattr(ops, "flush_denormals"):
        was, supported = ops.flush_denormals(on)
        if supported:
            return bool(was)
    was = bool(getattr(_state, "fallback_on", False))
    if torch.set_flush_denormal(on):  # this thread only; False where the CPU has no such mode
        _state.fallback_on = on
    return was


class flushing:
    """``with flushing():`` -- flush-to-zero on every intra-op thread for the block, the
    previous state put back after it. Nested blocks cost one thread-local read."""

    def __enter__(self) -> "flushing":
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        if depth == 0:
            self._was = flush_denormals(True)
        return self

    def __exit__(self, *exc) -> None:
        _state.depth -= 1
        if _state.depth == 0:
            flush_denormals(self._was)


def _applies(model: torch.nn.Module) -> bool:
    if not tuning.FLUSH_DENORMALS or torch.compiler.is_compiling():
        return False
    first = next(model.parameters(), None)
    return first is not None and first.device.type == "cpu"


def _on_output_grad(grad: torch.Tensor) -> None:
    """The backward has reached the model's outputs: flush from here to its end."""
    if getattr(_state, "restore", None) is None and getattr(_state, "depth", 0) == 0:
        _state.restore = flush_denormals(True)
        torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)


def _end_of_backward() -> None:
    was = getattr(_state, "restore", None)
    _state.restore = None
    if was is not None:
        flush_denormals(was)


def call_flushing(model: torch.nn.Module, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` -- the compressed ``model``'s forward -- flushing
    subnormals on the CPU, and its outputs' backward flushing too (see the module
    docstring); elsewhere (a GPU, under ``torch.compile``, turned off) just the call."""
    if not _applies(model):
        return call(*args, **kwargs)
    with flushing():
        out = call(*args, **kwargs)
    if torch.is_grad_enabled():
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.grad_fn is not None:
                leaf.register_hook(_on_output_grad)
    return out
