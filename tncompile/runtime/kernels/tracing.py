"""Which tracer runs a layer's forward: ``torch.export`` gets the layers' exported
forms (core ATen ops only), ``torch.compile`` their traced forms.

``torch.compiler.is_exporting()`` cannot tell them apart on every supported torch:
torch 2.11's Dynamo folds it to ``True`` in every trace, ``torch.compile`` included
(2.13 reads the flag ``torch.export`` sets). :func:`exporting` reads that flag itself,
which both versions' Dynamo folds to its value at trace time.
"""
from __future__ import annotations

import torch

from ..native.traced import constant_while_traced, never_traced

__all__ = ["exporting", "constant_while_traced", "never_traced"]


def exporting() -> bool:
    """``True`` while ``torch.export`` (strict or not, or ONNX's dynamo exporter) traces;
    ``False`` in eager code and under ``torch.compile``."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)
