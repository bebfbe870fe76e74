"""Tensors derived from a layer's parameters, kept only until anything may have changed them.

Without autograd a layer keeps merged forms of its cores (a TT linear's factors, a
lookup's half tables, a tied head's table: see ``docs/planning.md``), made once and
reused by every call, which is what decoding one token at a time needs. Such a form
must never outlive the values it was made from, and ``Tensor._version`` alone does not
see every update: the fused optimizers (``torch._fused_adamw_``, the HF ``Trainer``'s
default ``adamw_torch_fused``) leave it alone, so do writes through ``p.data`` (a tensor
with a counter of its own), FSDP2 gathering new values into an unsharded parameter, and
a replayed CUDA graph.

So a kept form (:func:`kept`) is made again when any of these changed since it was made:

* each tensor's shape, dtype, device, storage address or in-place version (an update
  through autograd's counter, ``load_state_dict``'s copies, a cut, ``.to()``);
* the **weights epoch** (:func:`weights_epoch`), which moves on every step of every
  ``torch.optim`` optimizer in the process (a global step hook: fused ones included),
  every ``train()`` / ``eval()`` call on a compressed layer, every
  ``load_state_dict`` into one, and every training step :class:`~tncompile.TrainStep`
  replays from a CUDA graph.

What none of these sees: a write that bypasses the version counter (through ``p.data``,
a NumPy view) *between* two inference calls with no optimizer step and no
``train()``/``eval()`` in between. ``model.eval()`` after such a write starts afresh.

Why not compare the values: checking that the cores hold the bits they held reads them
and a copy on every call, about as much memory traffic as a decode step itself: 1.3-1.9x
the time per token of a 4-layer, 768-wide GPT-2 at ratios 0.3 and 0.1, batch 1 and 8;
merging again on every call costs 2.5-10x (``python benchmarks/bench_kept_forms.py``,
``benchmarks/results/kept_forms.json``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["advance_weights_epoch", "kept", "storage_address", "weights_epoch"]

_EPOCH = [0]      # see weights_epoch
_HOOK: list = []  # the optimizer step hook's handle, once registered


def advance_weights_epoch(*_: Any) -> None:
    """Note that weights may have changed where no version counter shows it (every
    value kept by :func:`kept` is made again). Also the optimizers' step hook."""
    _EPOCH[0] += 1


def weights_epoch() -> int:
    """A counter that moves whenever weights may have changed unseen by their version
    counters (see the module doc). Registers the global optimizer step hook on first call."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(advance_weights_epoch))
    return _EPOCH[0]


def storage_address(t: Tensor) -> int:
    """``t.data_ptr()``, or 0 for a fake tensor (a dry run's), which has no storage."""
    return 0 if type(t).__name__ == "FakeTensor" else t.data_ptr()


def _stamp(tensors: Sequence[Tensor], key: tuple) -> tuple:
    return (key, weights_epoch(),
            *((t.shape, t.dtype, t.device, t._version, storage_address(t)) for t in tensors))


def kept(module: nn.Module, slot: str, tensors: Sequence[Tensor], make: Callable[[], Any],
         key: tuple = ()) -> Any:
    """``make()``'s value, kept on ``module`` under ``slot`` until ``tensors`` may have
    changed (see the module doc) or ``key`` differs.

    Parameters
    ----------
    module : nn.Module
        Where the value is kept (``module.__dict__[slot]``: list ``slot`` in the module's
        ``transient_state`` so that it is never saved).
    slot : str
        The attribute name.
    tensors : sequence of Tensor
        What the value is derived from (a layer's cores and gates).
    make : callable
        Computes the value (called without autograd).
    key : tuple
        Anything else the value depends on (a split point), compared with ``==``.
    """
    stamp = _stamp(tensors, key)
    entry = module.__dict__.get(slot)
    if entry is not None and entry[0] == stamp:
        return entry[1]
    with torch.no_grad():
        value = make()
    module.__dict__[slot] = (stamp, value)
    return value
