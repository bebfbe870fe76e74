"""``lower_dropout``: dropout runs on tncompile's counter-based CPU kernel.

Two small rules over the canonical forms (``canonicalize`` runs first):

* ``dropout-module``: a ``call_module`` node whose module is an ``nn.Dropout``
  running its own forward gets a :class:`~tncompile.runtime.fused.dropout.FastDropout`
  in its place (same ``p``, ``inplace``, training flag; no parameters, so the
  state dict is unchanged);
* ``dropout-function``: a canonical ``F.dropout(x, p=, training=, inplace=False)``
  call (every functional spelling, ``aten.dropout.default`` from
  ``torch.export`` included) calls :func:`tncompile.runtime.ways.dropout.dropout`;
* ``attention-dropout``: the fx frontend's
  :class:`~tncompile.runtime.fused.attention.SelfAttention` (``nn.MultiheadAttention``,
  ``nn.TransformerEncoder``) with dropout gets ``native_dropout=True``: in training on
  CPU it runs tncompile's native attention kernel with this generator;
* ``attention-function``: an ``F.scaled_dot_product_attention`` call (or
  ``aten.scaled_dot_product_attention``) with dropout -- its ``dropout_p`` read from
  an :class:`~tncompile.runtime.fused.attention.AttentionDropoutRate` (the frontend's
  train/eval-following rate) or a nonzero number -- calls
  :func:`tncompile.runtime.ways.attention.scaled_dot_product_attention` instead:
  the same function, on the native kernel in training on CPU.

Swap mode makes the same choice in the user's module tree (:mod:`tncompile.swap.lowering`).

Where the native kernels do not apply (CUDA, bf16, autocast) PyTorch's
dropout and attention run; under ``torch.compile`` the kernels run as the
opaque ops ``tncompile::traced_dropout`` / ``traced_attention`` (their seeds
drawn in the graph). Remove the pass
(``default_pipeline().remove("lower_dropout")``) to keep PyTorch's masks.
"""
from __future__ import annotations

from torch import fx, nn

from ..runtime.fused.attention import AttentionDropoutRate, SelfAttention
from ..runtime.ways.attention import scaled_dot_product_attention
from ..runtime.fused.dropout import FastDropout, dropout
from .canonicalize import DROPOUT
from .infra.base import register_pass
from .infra.rule_pass import RulePass
from .fuse_attention import SDPA
from .infra.rules import Match, Pat, Rule

__all__ = ["LowerDropout"]


def _swap_module(m: Match) -> None:
    # a module called from several nodes is swapped at its first node: FastDropout has its own
    # forward, so the rule does not match the later ones
    m.gm.set_submodule(m.root.target, FastDropout.from_dropout(m.module("root")))


def _call_native(m: Match) -> None:
    m.root.target = dropout


def _attention_with_dropout(node, gm) -> bool:
    mod = gm.get_submodule(node.target)
    return mod.dropout > 0 and not mod.native_dropout


def _native_attention_dropout(m: Match) -> None:
    m.module("root").native_dropout = True


def _sdpa_with_dropout(node: fx.Node, gm: fx.GraphModule) -> bool:
    rate = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    if isinstance(rate, fx.Node):
        return rate.op == "call_module" and isinstance(gm.get_submodule(rate.target), AttentionDropoutRate)
    return isinstance(rate, (int, float)) and rate > 0


def _call_native_attention(m: Match) -> None:
    m.root.target = scaled_dot_product_attention


RULES = [
    Rule("dropout-module", Pat.module(nn.Dropout, name="root"), _swap_module),
    Rule("dropout-function", Pat.call(DROPOUT), _call_native),
    Rule("attention-dropout", Pat.module(SelfAttention, name="root", where=_attention_with_dropout),
         _native_attention_dropout),
    Rule("attention-function", Pat.call(SDPA, where=_sdpa_with_dropout), _call_native_attention),
]


@register_pass
class LowerDropout(RulePass):
    """Swap ``nn.Dropout`` / functional dropout for tncompile's (see the module doc)."""

    name = "lower_dropout"

    rules = RULES
