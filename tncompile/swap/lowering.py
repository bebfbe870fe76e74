"""Graph-mode lowerings that swap mode makes in the user's module tree instead.

A swap-mode model runs its own ``forward``, so rewrites that graph mode makes on
the traced graph are made here on the model's modules, when their pass is in the
pipeline that compiled it:

* ``lower_dropout`` (:func:`lower_dropout_into`): every plain ``nn.Dropout``
  (exactly that class: a subclass keeps its own forward) becomes a
  :class:`~tncompile.runtime.fused.dropout.FastDropout` (same ``p``, ``inplace`` and
  mode; no state, so ``state_dict`` is unchanged), and a ``transformers`` model
  whose attention is ``"sdpa"`` gets ``"tncompile_sdpa"``
  (:mod:`tncompile.swap.hf_attention`): ``sdpa`` except that a training call with
  dropout on CPU runs the native attention kernel (not where the model's code
  compares ``_attn_implementation`` with ``"sdpa"`` by name: falcon, gemma4);
* ``canonicalize`` (:func:`canonicalize_into`): a parameter-free module whose
  forward writes the tanh GELU formula out (HF's ``NewGELUActivation``,
  ``gelu_new``: GPT-2, GPT-Neo, GPT-J, CodeGen; about eight elementwise kernels
  each way) becomes :class:`TanhGELU`, PyTorch's one-kernel
  ``nn.GELU(approximate="tanh")`` -- the same function, about 4x faster forward
  plus backward on CPU. Graph mode rewrites the formula in the traced graph
  (``canonicalize``'s ``gelu-tanh-formula`` rule).

``to_dense()`` undoes both in the copy it returns (:func:`restore_lowerings`), so
a dense model handed back to ``transformers`` holds nothing of tncompile's.
"""
from __future__ import annotations

import inspect
import re
import sys

from torch import fx, nn

from ..ir.program import Program
from ..passes.canonicalize import tanh_gelu_formula
from ..runtime.fused.dropout import FastDropout

__all__ = ["lower_into", "lower_dropout_into", "canonicalize_into", "restore_lowerings", "register_for",
           "TanhGELU", "writes_tanh_gelu"]

SDPA = "sdpa"


class TanhGELU(nn.GELU):
    """``nn.GELU(approximate="tanh")`` in place of ``original``, a module that wrote the
    formula out; :func:`restore_lowerings` puts ``original`` back.

    Shapes: any -> the same.
    """

    def __init__(self, original: nn.Module):
        super().__init__(approximate="tanh")
        self.__dict__["original"] = original  # not a submodule: no state of its own
        self.train(original.training)


def lower_into(model: nn.Module, program: Program) -> dict[str, int]:
    """Make, in ``model``'s tree, the lowerings of the passes ``program``'s pipeline ran."""
    ran = {record.name for record in program.history}
    counts = {}
    if "canonicalize" in ran:
        counts.update(canonicalize_into(model))
    if "lower_dropout" in ran:
        counts.update(lower_dropout_into(model))
    return counts


def canonicalize_into(model: nn.Module) -> dict[str, int]:
    """Put :class:`TanhGELU` in place of every module :func:`writes_tanh_gelu`."""
    swapped = 0
    for path, module in list(model.named_modules()):
        if path and writes_tanh_gelu(module):
            model.set_submodule(path, _with_hooks_of(module, TanhGELU(module)))
            swapped += 1
    return {"gelu-tanh-formula": swapped}


def writes_tanh_gelu(module: nn.Module) -> bool:
    """Whether ``module`` has no state and its forward, traced by ``torch.fx``, is the
    tanh GELU formula of its one input (``canonicalize``'s own matcher decides)."""
    if type(module).__module__.startswith("torch.") or module._modules or module._parameters or module._buffers:
        return False  # PyTorch's own modules (nn.Dropout, nn.GELU, ...) are never the written-out formula
    try:
        graph = fx.symbolic_trace(module).graph
    except Exception:  # noqa: BLE001 - any module fx cannot trace is not the formula
        return False
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    result = next(n for n in graph.nodes if n.op == "output").args[0]
    found = tanh_gelu_formula(result) if isinstance(result, fx.Node) else None
    return len(inputs) == 1 and found is not None and found[0] is inputs[0]


def lower_dropout_into(model: nn.Module) -> dict[str, int]:
    """Put tncompile's dropout and attention into ``model``'s tree (see the module doc)."""
    swapped = 0
    for path, module in list(model.named_modules()):
        if path and type(module) is nn.Dropout:
            model.set_submodule(path, _with_hooks_of(module, FastDropout.from_dropout(module)))
            swapped += 1
    configs = [] if _compares_sdpa_by_name(model) else _configs(model, SDPA)
    if configs:
        from .hf_attention import NAME, register  # noqa: PLC0415 - only HF models get here
        register()
        for config in configs:
            _set_implementation(config, NAME)
    return {"dropout-module": swapped, "hf-attention": len(configs)}


def restore_lowerings(model: nn.Module) -> None:
    """Undo :func:`lower_into` on ``model`` (a dense copy): ``nn.Dropout``, ``"sdpa"`` and
    the original activation modules again."""
    for path, module in list(model.named_modules()):
        if path and type(module) is FastDropout:
            dense = nn.Dropout(module.p, module.inplace)
            dense.train(module.training)
            model.set_submodule(path, _with_hooks_of(module, dense))
        elif path and type(module) is TanhGELU:
            model.set_submodule(path, module.original)
    if "tncompile.swap.hf_attention" in sys.modules:
        from .hf_attention import NAME  # noqa: PLC0415
        for config in _configs(model, NAME):
            _set_implementation(config, SDPA)


_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _with_hooks_of(old: nn.Module, new: nn.Module) -> nn.Module:
    """``new``, running ``old``'s hooks: the same dicts, so the user's handles still remove them."""
    for name in _HOOKS:
        if hasattr(old, name):
            setattr(new, name, getattr(old, name))
    return new


def register_for(cls: type) -> None:
    """Register ``"tncompile_sdpa"`` when ``cls`` is a ``transformers`` model class (unpickling
    a swap-mode model in a fresh process: its config may name it)."""
    if any(base.__module__.startswith("transformers.") for base in cls.__mro__):
        from .hf_attention import register  # noqa: PLC0415
        register()


_SDPA_BY_NAME = re.compile(r'_attn_implementation[^#\n]*"sdpa"')
_SOURCES: dict[str, bool] = {}


def _compares_sdpa_by_name(model: nn.Module) -> bool:
    """Whether the code of a class in ``model`` reads ``_attn_implementation`` against
    ``"sdpa"`` by name (falcon, gemma4: such a model would take its non-sdpa branch
    under another name, so it keeps ``"sdpa"``)."""
    for name in {type(m).__module__ for m in model.modules()}:
        if name not in _SOURCES:
            try:
                source = inspect.getsource(sys.modules[name])
            except (KeyError, OSError, TypeError):
                source = ""
            _SOURCES[name] = bool(_SDPA_BY_NAME.search(source))
        if _SOURCES[name]:
            return True
    return False


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
