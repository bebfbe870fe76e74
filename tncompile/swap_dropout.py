"""Swap mode's dropout on tncompile's kernels, as graph mode's after ``lower_dropout``.

Graph mode's ``lower_dropout`` pass rewrites the traced graph; a swap-mode model
runs its own ``forward``, so when that pass is in the pipeline the same choice
is made in the user's module tree instead:

* every plain ``nn.Dropout`` (exactly that class: a subclass keeps its own
  forward) becomes a :class:`~tncompile.runtime.dropout.FastDropout` (same
  ``p``, ``inplace`` and mode; no state, so ``state_dict`` is unchanged);
* a ``transformers`` model whose attention is ``"sdpa"`` gets
  ``"tncompile_sdpa"`` (:mod:`tncompile.swap_attention`): ``sdpa``
  except that a training call with dropout on CPU runs the native attention
  kernel.

``to_dense()`` undoes both in the copy it returns (:func:`restore_dropout`), so
a dense model handed back to ``transformers`` holds nothing of tncompile's.
Remove the pass (``default_pipeline().remove("lower_dropout")``) to keep
PyTorch's dropout and attention.
"""
from __future__ import annotations

import sys

from torch import nn

from .ir.program import Program
from .runtime.dropout import FastDropout

__all__ = ["lower_dropout_into", "restore_dropout", "wants_native_dropout", "register_for"]

SDPA = "sdpa"


def wants_native_dropout(program: Program) -> bool:
    """Whether the pipeline that compiled ``program`` ran ``lower_dropout``."""
    return any(record.name == "lower_dropout" for record in program.history)


def lower_dropout_into(model: nn.Module) -> dict[str, int]:
    """Put tncompile's dropout and attention into ``model``'s tree (see the module doc).

    Returns ``{"dropout-module": swapped nn.Dropout modules, "hf-attention": configs switched}``.
    """
    swapped = 0
    for path, module in list(model.named_modules()):
        if path and type(module) is nn.Dropout:
            model.set_submodule(path, FastDropout.from_dropout(module))
            swapped += 1
    configs = _configs(model, SDPA)
    if configs:
        from .swap_attention import NAME, register  # noqa: PLC0415 - only HF models get here
        register()
        for config in configs:
            _set_implementation(config, NAME)
    return {"dropout-module": swapped, "hf-attention": len(configs)}


def restore_dropout(model: nn.Module) -> None:
    """Undo :func:`lower_dropout_into` on ``model`` (a dense copy): ``nn.Dropout`` and ``"sdpa"`` again."""
    for path, module in list(model.named_modules()):
        if path and type(module) is FastDropout:
            dense = nn.Dropout(module.p, module.inplace)
            dense.train(module.training)
            model.set_submodule(path, dense)
    if "tncompile.swap_attention" in sys.modules:
        from .swap_attention import NAME  # noqa: PLC0415
        for config in _configs(model, NAME):
            _set_implementation(config, SDPA)


def register_for(cls: type) -> None:
    """Register ``"tncompile_sdpa"`` when ``cls`` is a ``transformers`` model class (unpickling
    a swap-mode model in a fresh process: its config may name it)."""
    if any(base.__module__.startswith("transformers.") for base in cls.__mro__):
        from .swap_attention import register  # noqa: PLC0415
        register()


def _configs(model: nn.Module, implementation: str) -> list:
    """The distinct HF configs held by ``model``'s modules whose attention is ``implementation``
    (sub-configs are held by the modules that use them)."""
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation_internal", None) == implementation:
            seen.setdefault(id(config), config)
    return list(seen.values())


def _set_implementation(config, implementation: str) -> None:
    # the dict form sets this config only: its sub-configs keep theirs (each is switched on its own)
    config._attn_implementation = {"": implementation}
