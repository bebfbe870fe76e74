"""tncompile's parts that plug into other libraries, registered when those load.

- transformers' quantization backend ``"tncompile"`` (:mod:`.hf_quantizer`), so that
  ``from_pretrained`` of a compressed folder works after ``import tncompile``, and the
  reading of its ``config.json``, whose dtype refuses to build without tncompile
  (:mod:`.hf_config`);
- PEFT's LoRA ``Linear`` over a compressed layer (:mod:`.peft_lora`), so that
  ``tncompile.compile`` of a model carrying adapters keeps them.

Neither library has a plugin entry point, and importing them from ``import tncompile``
would cost every user seconds. So each registration waits for the module it extends: if
that module is already imported, it happens now; otherwise a finder on ``sys.meta_path``
runs it right after the module is imported (by ``from_pretrained``, by ``import peft``),
and stops looking for it. A library that is not installed is never looked for.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["PLUGINS", "register_when_imported"]

#: module that is extended -> tncompile module whose import registers the extension (or
#: ``module:function``, called)
PLUGINS = {"transformers.configuration_utils": "tncompile.integrations.hf_config:install",
           "transformers.quantizers.auto": "tncompile.integrations.hf_quantizer",
           "peft.tuners.lora.layer": "tncompile.integrations.peft_lora",
           "peft.tuners.lora.model": "tncompile.integrations.peft_lora:register_with_peft"}


class _Loader(importlib.abc.Loader):
    """The extended module's own loader, then the registration."""

    def __init__(self, loader: importlib.abc.Loader, plugin: str):
        self.loader = loader
        self.plugin = plugin

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register(self.plugin)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of each module it waits for, once."""

    def __init__(self):
        self.waiting: dict[str, str] = {}

    def find_spec(self, name, path, target=None):
        plugin = self.waiting.pop(name, None)
        if plugin is None:
            return None
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, plugin)
        return spec


def _register(plugin: str) -> None:
    module, _, function = plugin.partition(":")
    imported = importlib.import_module(module)
    if function:
        getattr(imported, function)()


def register_when_imported(plugins: dict[str, str] = PLUGINS) -> None:
    """Import each plugin now if its module is imported, else right after it is."""
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)
    for module, plugin in plugins.items():
        if module in sys.modules:
            _register(plugin)
        elif importlib.util.find_spec(module.partition(".")[0]) is not None:
            if finder is None:
                finder = _AfterImport()
                sys.meta_path.insert(0, finder)
            finder.waiting[module] = plugin


register_when_imported()
