"""Registers tncompile's ``HfQuantizer`` (:mod:`.hf_quantizer`) with transformers, so that
``from_pretrained`` of a compressed folder works after ``import tncompile``.

transformers has no plugin entry point for quantization backends: they live in the dict
of ``transformers.quantizers.auto``. Importing transformers from ``import tncompile``
would cost every user about a second and a half, so the registration waits for that
module instead: if it is already imported, it happens now; otherwise a one-shot finder
on ``sys.meta_path`` runs it right after transformers imports the module (which
``from_pretrained`` does), and removes itself. Without transformers nothing happens.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

__all__ = ["QUANTIZER_REGISTRY", "register_when_imported"]

QUANTIZER_REGISTRY = "transformers.quantizers.auto"


def _register() -> None:
    from . import hf_quantizer  # noqa: F401  (its decorators register quant_method "tncompile")


class _Loader(importlib.abc.Loader):
    """The registry's own loader, then the registration."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register()


class _AfterRegistryImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the registry module's loader, once."""

    def find_spec(self, name, path, target=None):
        if name != QUANTIZER_REGISTRY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def register_when_imported() -> None:
    """Register now if transformers' registry is imported, else right after it is."""
    if QUANTIZER_REGISTRY in sys.modules:
        _register()
    elif importlib.util.find_spec("transformers") is not None \
            and not any(isinstance(f, _AfterRegistryImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterRegistryImport())


register_when_imported()
