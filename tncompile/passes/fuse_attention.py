"""``fuse_attention``: a hand-written attention becomes one ``scaled_dot_product_attention``.

The rewrite, matched upward from the second matmul::

    %s = matmul(%q, %k_t)                 # %k_t = %k.transpose(-1, -2), or any (..., E, S) node
    %s = truediv(%s, c) | mul(%s, c)      # optional, c a number
    %s = add(%s, %mask)                   # optional, an additive mask (either operand order)
    %w = softmax(%s, -1)                  # method, torch.softmax or F.softmax over the last dim
    %w = call_module[dropout](%w)         # optional, an nn.Dropout (or the lowered FastDropout),
                                          # or a functional dropout with p=0 or training=False
    %y = matmul(%w, %v)
        ==>  %y = call_module[<owner>.fused_attention](%q, %k, %v, %mask)

when every intermediate has no other user (attention weights that are also returned
stay as written). :class:`~tncompile.runtime.fused.attention.FusedAttention` keeps the
dropout module itself, so ``train()`` / ``eval()`` and its ``p`` govern the fused
call; it runs the steps as written where PyTorch has no fused kernel for the call
(dropout on CPU, inputs the kernel does not take). It is placed beside the dropout it
absorbed (``layers.0.attention.fused_attention``, the dropout then its child
``...fused_attention.dropout`` unless the graph still calls it elsewhere), or at the
root when there is none.

Calls that already are fused attention -- ``F.scaled_dot_product_attention`` (HF models'
"sdpa" implementation), ``lower_dropout``'s drop-in for it and the fx frontend's
:class:`~tncompile.runtime.fused.attention.SelfAttention` (``nn.MultiheadAttention``,
``nn.TransformerEncoder``) -- are counted under ``already-fused`` and left alone, so the
dump's match counts say how every attention in the model runs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..runtime.fused.attention import FusedAttention, SelfAttention
from ..runtime.ways.attention import scaled_dot_product_attention
from ..runtime.fused.dropout import FastDropout, dropout as native_dropout
from .infra.base import register_pass
from .infra.rule_pass import RulePass
from .infra.rules import Match, Pat, Rule

__all__ = ["FuseAttention"]

aten = torch.ops.aten
# the fx spellings, then torch.export's (models only torch.export traces)
MATMULS = frozenset({operator.matmul, torch.matmul, aten.matmul.default})
SOFTMAXES = frozenset({torch.softmax, F.softmax, aten.softmax.int})
ADDS = frozenset({operator.add, torch.add, aten.add.Tensor})
DIVS = frozenset({operator.truediv, aten.div.Tensor})
MULS = frozenset({operator.mul, aten.mul.Tensor})
TRANSPOSES = frozenset({torch.transpose, aten.transpose.int})
SDPA = frozenset({F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default})
FUNCTIONAL_DROPOUTS = frozenset({F.dropout, native_dropout})  # canonical, and after lower_dropout


@dataclass
class _Attention:
    """One parsed attention: its inputs, how the scores were scaled (and by what: a number
    or a node), the dropout module's path, and the intermediate nodes the fused call
    replaces (producer first)."""

    q: fx.Node
    k_t: fx.Node
    v: fx.Node
    mask: fx.Node | None = None
    scaling: str = "none"
    scale: Any = 1.0
    dropout: str | None = None
    steps: list[fx.Node] = field(default_factory=list)


def _only_user(node, user: fx.Node) -> bool:
    return isinstance(node, fx.Node) and list(node.users) == [user]


def _is_call(node, targets, nargs: int) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets
            and len(node.args) == nargs and not node.kwargs)


def _softmax_input(node) -> fx.Node | None:
    """The input of a softmax over the last dim (no dtype), else ``None``."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method" and node.target == "softmax":
        dims = [*node.args[1:2], *[v for k, v in node.kwargs.items() if k == "dim"]]
        extra = set(node.kwargs) - {"dim"}
    elif node.op == "call_function" and node.target in SOFTMAXES:
        dims = [*node.args[1:2], *[v for k, v in node.kwargs.items() if k == "dim"]]
        extra = {k for k, v in node.kwargs.items() if k != "dim" and not (k == "_stacklevel" or v is None)}
    elif node.op == "call_function" and node.target is aten._softmax.default and len(node.args) == 3:
        dims, extra = [node.args[1]], {"half_to_float"} if node.args[2] else set()
        return node.args[0] if dims == [-1] and not extra and not node.kwargs else None
    else:
        return None
    if dims != [-1] or extra or len(node.args) > 2:
        return None
    return node.args[0]


def _dropout_module(node, gm: fx.GraphModule) -> nn.Module | None:
    if not (isinstance(node, fx.Node) and node.op == "call_module" and len(node.args) == 1 and not node.kwargs):
        return None
    mod = gm.get_submodule(node.target)
    plain = isinstance(mod, nn.Dropout) and type(mod).forward in (nn.Dropout.forward, FastDropout.forward)
    return mod if plain and not mod.inplace else None


def _no_op_dropout(node) -> bool:
    """A canonical functional dropout that never drops: ``p=0`` or ``training=False`` as
    constants (HF's eager attention passes ``dropout=0.0`` when traced in eval mode)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in FUNCTIONAL_DROPOUTS
            and len(node.args) == 1):
        return False
    p, training = node.kwargs.get("p", 0.5), node.kwargs.get("training", True)
    return isinstance(p, (int, float)) and isinstance(training, bool) and (p == 0 or not training)


def _parse(root: fx.Node, gm: fx.GraphModule) -> _Attention | None:
    """``root`` as the last matmul of an attention, or ``None``."""
    if not _is_call(root, MATMULS, 2):
        return None
    weights, v = root.args
    steps: list[fx.Node] = []
    dropout = None
    if (_dropout_module(weights, gm) is not None or _no_op_dropout(weights)) and _only_user(weights, root):
        dropout = weights.target if weights.op == "call_module" else None
        steps = [weights]
        user, weights = weights, weights.args[0]
    else:
        user = root
    scores = _softmax_input(weights)
    if scores is None or not _only_user(weights, user):
        return None
    steps.insert(0, weights)
    user, mask = weights, None
    if _is_call(scores, ADDS, 2) and _only_user(scores, user):
        left, right = scores.args
        inner, mask = (left, right) if _scores_or_scaled(left) else (right, left)
        if not isinstance(mask, fx.Node) or not _scores_or_scaled(inner):
            return None
        steps.insert(0, scores)
        user, scores = scores, inner
    scaling, scale = "none", 1.0
    if _scaled(scores) and _only_user(scores, user):
        a, b = scores.args
        product, scale = (a, b) if _is_call(a, MATMULS, 2) else (b, a)
        scaling = "div" if scores.target in DIVS else "mul"
        steps.insert(0, scores)
        user, scores = scores, product
    if not (_is_call(scores, MATMULS, 2) and _only_user(scores, user)):
        return None
    steps.insert(0, scores)
    q, k_t = scores.args
    if not (isinstance(q, fx.Node) and isinstance(k_t, fx.Node) and isinstance(v, fx.Node)):
        return None
    return _Attention(q, k_t, v, mask, scaling, scale, dropout, steps)


def _scaled(node) -> bool:
    """``s / c``, ``s * c`` or ``c * s`` with ``s`` a matmul and ``c`` a number or a node
    (a scale computed from a shape; a tensor there makes the fused call run the written steps)."""
    if _is_call(node, DIVS, 2):
        return _is_call(node.args[0], MATMULS, 2) and _scale_operand(node.args[1])
    if _is_call(node, MULS, 2):
        a, b = node.args
        return (_is_call(a, MATMULS, 2) and _scale_operand(b)) or (_is_call(b, MATMULS, 2) and _scale_operand(a))
    return False


def _scale_operand(c) -> bool:
    return isinstance(c, fx.Node) or (isinstance(c, (int, float)) and not isinstance(c, bool))


def _scores_or_scaled(node) -> bool:
    """A ``q @ k_t`` product, or one scaled."""
    return _is_call(node, MATMULS, 2) or _scaled(node)


def _is_last_two_transpose(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target == "transpose" and len(node.args) == 3 and not node.kwargs:
        return set(node.args[1:]) == {-1, -2}
    return node.op == "call_function" and node.target in TRANSPOSES and len(node.args) == 3 \
        and not node.kwargs and set(node.args[1:]) == {-1, -2}


def _free_path(gm: fx.GraphModule, owner: str) -> str:
    base = f"{owner}.fused_attention" if owner else "fused_attention"
    path, i = base, 1
    while hasattr(gm, path.replace(".", "_")) or _has_submodule(gm, path):
        i += 1
        path = f"{base}_{i}"
    return path


def _has_submodule(gm: fx.GraphModule, path: str) -> bool:
    try:
        gm.get_submodule(path)
        return True
    except AttributeError:
        return False


def _fuse(m: Match) -> None:
    found = _parse(m.root, m.gm)
    assert found is not None  # the rule's condition parsed it
    dropout = m.gm.get_submodule(found.dropout) if found.dropout else None
    owner = found.dropout.rpartition(".")[0] if found.dropout else ""
    path = _free_path(m.gm, owner)
    m.gm.add_submodule(path, FusedAttention(found.scaling, dropout))
    k_t = found.k_t

    def build(graph: fx.Graph) -> fx.Node:
        key = k_t.args[0] if _is_last_two_transpose(k_t) else graph.call_method("transpose", (k_t, -2, -1))
        kwargs = {"mask": found.mask} if found.mask is not None else {}
        if found.scaling != "none":
            kwargs["scale"] = found.scale
        return graph.call_module(path, (found.q, key, found.v), kwargs)
    m.replace_root(build)
    for node in reversed(found.steps):
        if not node.users:
            m.graph.erase_node(node)
    if not k_t.users and _is_last_two_transpose(k_t):
        m.graph.erase_node(k_t)
    if found.dropout and not any(n.op == "call_module" and n.target == found.dropout for n in m.graph.nodes):
        m.gm.delete_submodule(found.dropout)  # it lives on inside the fused module (as a saved file has it)


RULES = [
    Rule("attention", Pat.call(MATMULS, name="root", where=lambda n, gm: _parse(n, gm) is not None), _fuse),
    Rule("already-fused", Pat.module(SelfAttention), lambda m: None),
    Rule("already-fused", Pat.call(SDPA | {scaled_dot_product_attention}), lambda m: None),
]


@register_pass
class FuseAttention(RulePass):
    """Rewrite hand-written attention into one fused call (see the module doc)."""

    name = "fuse_attention"

    rules = RULES
