"""Registers tncompile's ``HfQuantizer`` (:mod:`.hf_quantizer`) with transformers when it is
installed, so ``from_pretrained`` of a compressed folder works after ``import tncompile``.
Without transformers this does nothing (tncompile does not need it)."""
from __future__ import annotations

import importlib.util

__all__ = ["HAS_TRANSFORMERS"]

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

if HAS_TRANSFORMERS:
    from . import hf_quantizer  # noqa: F401  (registers quant_method "tncompile")
