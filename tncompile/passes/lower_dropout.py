"""``lower_dropout``: dropout runs on tncompile's counter-based CPU kernel.

Two small rules:

* a ``call_module`` node whose module is exactly ``nn.Dropout`` gets a
  :class:`~tncompile.runtime.dropout.FastDropout` in its place (same ``p``,
  ``inplace``, training flag; no parameters, so the state dict is unchanged);
* a ``call_function`` node calling ``F.dropout`` / ``torch.dropout`` calls
  :func:`tncompile.runtime.dropout.dropout` with the same arguments.

Where the native kernel does not apply (CUDA, bf16, autocast,
``torch.compile``) both run PyTorch's dropout. Remove the pass
(``default_pipeline().remove("lower_dropout")``) to keep PyTorch's masks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ir.program import Program
from ..runtime.dropout import FastDropout, dropout
from .base import Pass, register_pass

__all__ = ["LowerDropout"]

_FUNCTIONAL = {F.dropout, torch.dropout}


@register_pass
class LowerDropout(Pass):
    """Swap ``nn.Dropout`` / functional dropout for tncompile's (see the module doc)."""

    name = "lower_dropout"

    def run(self, program: Program) -> Program:
        gm = program.graph_module
        swapped: set[str] = set()
        for node in program.graph.nodes:
            if node.op == "call_module" and node.target not in swapped:
                mod = gm.get_submodule(node.target)
                if type(mod) is nn.Dropout:
                    gm.set_submodule(node.target, FastDropout.from_dropout(mod))
                    swapped.add(node.target)
            elif node.op == "call_function" and node.target in _FUNCTIONAL:
                if "train" in node.kwargs:  # torch.dropout(input, p, train) names it train
                    kwargs = dict(node.kwargs)
                    kwargs["training"] = kwargs.pop("train")
                    node.kwargs = kwargs
                node.target = dropout
        return program
