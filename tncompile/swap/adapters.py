"""Models that carry adapters (PEFT LoRA): compress the layers under them, keep the adapters.

PEFT wraps each adapted layer: ``...query`` becomes a LoRA layer whose ``base_layer`` is
the original ``nn.Linear`` and whose ``lora_A`` / ``lora_B`` hold the adapter. Compiling
such a model (``tncompile.compile(peft_model, ...)``: the model a ``PeftModel`` wraps is
compiled, in swap mode) compresses the base layers -- each wrapper keeps wrapping, now a
TT network -- and leaves every adapter part dense, trainable and as it was. A wrapper whose
base became a network then takes the class registered for its kind
(:func:`register_adapter_wrapper`; :mod:`tncompile.integrations.peft_lora` registers PEFT's
LoRA ``Linear``, whose merge folds the adapter into the network).
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..runtime.layers import TNModule

__all__ = ["ADAPTER_PARTS", "register_adapter_wrapper", "adapted_model", "adapter_wrappers", "adapter_exclusion",
           "check_adapter_wrappers", "adopt_compressed_bases"]

#: submodules of a PEFT tuner layer that belong to the adapter, never compressed
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                 "modules_to_save", "original_module")
_WRAPPERS: dict[type, tuple[Callable[[nn.Module], None], Callable[[str, nn.Module], None] | None]] = {}


def register_adapter_wrapper(cls: type, adopt: Callable[[nn.Module], None],
                             check: Callable[[str, nn.Module], None] | None = None) -> None:
    """``adopt(wrapper)`` turns a ``cls`` wrapper whose base layer became a TT network into
    one that works on it (its merge above all); ``check(path, wrapper)``, before anything is
    compiled, raises ``TypeError`` for a wrapper it could not adopt."""
    _WRAPPERS[cls] = (adopt, check)


def adapted_model(model: nn.Module) -> nn.Module | None:
    """The model a PEFT model wraps (``peft_model.base_model.model``), else ``None``."""
    inner = getattr(getattr(model, "base_model", None), "model", None)
    return inner if hasattr(model, "peft_config") and isinstance(inner, nn.Module) else None


def adapter_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """``path -> wrapper`` of every PEFT tuner layer (a ``base_layer`` and a ``lora_A``) in ``model``."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "base_layer", None), nn.Module) and hasattr(m, "lora_A")}


def adapter_exclusion() -> str:
    """An ``exclude_modules`` entry matching every adapter part's layers."""
    return r"re:(.*\.)?(" + "|".join(ADAPTER_PARTS) + r")(\..*)?"


def check_adapter_wrappers(model: nn.Module) -> None:
    """Every wrapper kind in ``model`` has a registered form for a compressed base
    (``TypeError`` naming the first that has none)."""
    for name, wrapper in adapter_wrappers(model).items():
        adopt, check = _WRAPPERS.get(type(wrapper), (None, None))
        if adopt is None:
            raise TypeError(f"tncompile.compile: the adapter at {name!r} is a {type(wrapper).__name__}, which "
                            "tncompile cannot keep over a compressed layer (LoRA on linears only); merge it first "
                            "(peft_model.merge_and_unload()) and compile the result")
        if check is not None:
            check(name, wrapper)


def adopt_compressed_bases(model: nn.Module) -> list[str]:
    """Give each wrapper whose base layer is now a TT network its registered form; returns their paths."""
    adopted = []
    for name, wrapper in adapter_wrappers(model).items():
        if isinstance(wrapper.base_layer, TNModule) and type(wrapper) in _WRAPPERS:
            _WRAPPERS[type(wrapper)][0](wrapper)
            adopted.append(name)
    return adopted
