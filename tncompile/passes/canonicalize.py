"""``canonicalize``: one spelling for each op the later passes look for.

torch.fx and torch.export spell the same thing many ways (``nn.GELU()``,
``F.gelu``, ``aten.gelu.default``; ``nn.ReLU``, ``F.relu``, ``torch.relu``,
``x.relu()``, ``aten.relu.default`` and their in-place forms; ``F.dropout``,
``torch.dropout``, ``aten.dropout.default``; ``F.linear`` on a module's own
weight). After this pass there is one form each, so that later passes match
one pattern:

========== ==========================================================
op         canonical form
========== ==========================================================
GELU       ``F.gelu(x, approximate="none" | "tanh")``; also the tanh
           formula written out (HF's ``gelu_new``, GPT-2's:
           ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``)
ReLU       ``torch.relu(x)``
dropout    ``nn.Dropout`` modules stay modules (they follow ``train()`` /
           ``eval()``); every functional spelling becomes
           ``F.dropout(x, p=p, training=t, inplace=False)``
linear     a ``call_module`` of an ``nn.Linear`` when the weight (and bias)
           are one module's own; otherwise ``F.linear(x, w, b)``
embedding  a ``call_module`` of an ``nn.Embedding`` when ``F.embedding``
           reads the weight of a module fx traced into (a subclass with a
           forward of its own: its other operations stay around the call)
========== ==========================================================

In-place spellings (``nn.ReLU(inplace=True)``, ``relu_``, ``dropout(...,
inplace=True)``) become out-of-place only when nothing else reads their
input, which is when the two are indistinguishable; otherwise they are left as
they are. Module spellings whose class overrides ``forward`` are left alone.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..ir.modules import rehome_reads
from ..ir.program import Program
from ..runtime.layers.module_kinds import embedding_on, linear_on, runs_as
from .infra.base import Pass, register_pass
from .infra.rule_pass import CANONICALIZE
from .infra.rules import Match, Pat, Rule, apply_rules

__all__ = ["Canonicalize", "GELU", "RELU", "DROPOUT", "activation_of", "tanh_gelu_formula"]

aten = torch.ops.aten

GELU = F.gelu            # the canonical targets
RELU = torch.relu
DROPOUT = F.dropout


def _sole_reader(node: fx.Node, gm: fx.GraphModule) -> bool:
    """The node's input is read by nothing else (so in place and out of place agree)."""
    x = node.args[0] if node.args else None
    return isinstance(x, fx.Node) and len(x.users) == 1


def _arg(node: fx.Node, position: int, name: str, default):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _call(match: Match, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    return match.replace_root(lambda g: g.call_function(target, args, kwargs or {}))


# ---------------------------------------------------------------- GELU
def _gelu_module(m: Match) -> None:
    mod = m.module("gelu")
    _call(m, GELU, (m.root.args[0],), {"approximate": mod.approximate})


def _gelu_function(m: Match) -> None:
    _call(m, GELU, (m.root.args[0],), {"approximate": m.root.kwargs.get("approximate", "none")})


_MUL = {operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar}
_ADD = {operator.add, torch.add, aten.add.Tensor, aten.add.Scalar}
_POW = {operator.pow, torch.pow, aten.pow.Tensor_Scalar}
_TANH = {torch.tanh, aten.tanh.default}


def _operands(node, targets) -> tuple | None:
    """``(a, b)`` of a binary ``call_function`` of one of ``targets`` (no other arguments)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets \
            and len(node.args) == 2 and not node.kwargs:
        return node.args
    return None


def _times_constant(node, targets, value: float) -> fx.Node | None:
    """``x`` of ``op(x, c)`` or ``op(c, x)`` with ``c`` the number ``value`` (to 1e-6)."""
    pair = _operands(node, targets)
    for x, c in (pair, pair[::-1]) if pair else ():
        if isinstance(x, fx.Node) and isinstance(c, (int, float)) and not isinstance(c, bool) \
                and abs(c - value) <= 1e-6 * abs(value):
            return x
    return None


def tanh_gelu_formula(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(x, the formula's inner nodes)`` when ``node`` computes
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (operands in either order),
    every inner node read only by the formula; else ``None``."""
    pair = _operands(node, _MUL)
    for half, rest in (pair, pair[::-1]) if pair else ():
        x = _times_constant(half, _MUL, 0.5)
        t = _times_constant(rest, _ADD, 1.0)
        if x is None or t is None or t.op != "call_function" or t.target not in _TANH or len(t.args) != 1:
            continue
        inner = _times_constant(t.args[0], _MUL, math.sqrt(2.0 / math.pi))
        terms = _operands(inner, _ADD)
        for xx, cubic in (terms, terms[::-1]) if terms else ():
            power = _times_constant(cubic, _MUL, 0.044715)
            if xx is x and _operands(power, _POW) in ((x, 3), (x, 3.0)):
                nodes = [half, rest, t, t.args[0], inner, cubic, power]
                if all(len(n.users) == 1 for n in nodes):
                    return x, nodes
    return None


def _tanh_gelu(m: Match) -> None:
    x, nodes = tanh_gelu_formula(m.root)
    m.nodes.update({f"formula_{i}": n for i, n in enumerate(nodes)})
    _call(m, GELU, (x,), {"approximate": "tanh"})


def _is_canonical_gelu(node: fx.Node, gm) -> bool:
    return node.target is GELU and len(node.args) == 1 and set(node.kwargs) == {"approximate"}


# ---------------------------------------------------------------- ReLU
def _relu(m: Match) -> None:
    _call(m, RELU, (m.root.args[0],))


def _relu_module_ok(node: fx.Node, gm) -> bool:
    return not gm.get_submodule(node.target).inplace or _sole_reader(node, gm)


def _relu_function_ok(node: fx.Node, gm) -> bool:
    return not _arg(node, 1, "inplace", False) or _sole_reader(node, gm)


# ---------------------------------------------------------------- dropout
def _dropout(training_name: str):
    def rewrite(m: Match) -> None:
        n = m.root
        _call(m, DROPOUT, (n.args[0],), {"p": _arg(n, 1, "p", 0.5),
                                         "training": _arg(n, 2, training_name, True), "inplace": False})
    return rewrite


def _dropout_ok(inplace_position: int | None):
    def ok(node: fx.Node, gm) -> bool:
        if node.target is DROPOUT and len(node.args) == 1 and \
                set(node.kwargs) == {"p", "training", "inplace"} and node.kwargs["inplace"] is False:
            return False  # already canonical
        inplace = _arg(node, inplace_position, "inplace", False) if inplace_position is not None else False
        return not inplace or _sole_reader(node, gm)
    return ok


# ---------------------------------------------------------------- linear
def _owner_of(node: fx.Node, gm: fx.GraphModule, attr: str) -> str | None:
    """The module path whose ``attr`` a ``get_attr`` node reads (``"a.b"`` for ``a.b.weight``)."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    path, _, leaf = node.target.rpartition(".")
    return path if leaf == attr and path else None


def _linear_module_at(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The path of the module a linear call's weight and bias both belong to,
    when that module is (or can stand as) an ``nn.Linear``; else ``None``."""
    w, b = _arg(node, 1, "weight", None), _arg(node, 2, "bias", None)
    path = _owner_of(w, gm, "weight")
    if path is None or (b is not None and _owner_of(b, gm, "bias") != path):
        return None
    try:
        mod = gm.get_submodule(path)
    except AttributeError:
        return None
    if runs_as(mod, nn.Linear):
        return path if (mod.bias is None) == (b is None) else None
    # fx copies a get_attr's owner as a bare nn.Module holding just the tensors read
    if type(mod) is nn.Module and not mod._modules and not mod._buffers and \
            set(mod._parameters) == ({"weight", "bias"} if b is not None else {"weight"}) and \
            mod.weight.dim() == 2:
        return path
    return None


def _fold_linear(m: Match) -> None:
    gm, node = m.gm, m.root
    path = _linear_module_at(gm, node)
    reads = [a for a in (_arg(node, 1, "weight", None), _arg(node, 2, "bias", None)) if a is not None]
    mod = gm.get_submodule(path)
    if not runs_as(mod, nn.Linear):  # stand a real nn.Linear on the same parameters
        gm.set_submodule(path, linear_on(mod.weight, mod._parameters.get("bias"), mod.training))
    m.replace_root(lambda g: g.call_module(path, (node.args[0],)))
    for read in reads:  # the weight and bias reads, unless something else uses them too
        if not read.users:
            m.graph.erase_node(read)


# ---------------------------------------------------------------- embedding
_EMBEDDINGS = {F.embedding: (1, 0, ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")),
               aten.embedding.default: (0, 1, ("padding_idx", "scale_grad_by_freq", "sparse"))}


def _embedding_module_at(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The path of the container fx made for the module whose weight an
    embedding call reads (a bare ``nn.Module`` holding that weight), else ``None``."""
    weight_at, _, _ = _EMBEDDINGS[node.target]
    path = _owner_of(_arg(node, weight_at, "weight", None), gm, "weight")
    if path is None:
        return None
    try:
        mod = gm.get_submodule(path)
    except AttributeError:
        return None
    if type(mod) is not nn.Module or mod._modules or mod.weight.dim() != 2:
        return None
    return path


def _fold_embedding(m: Match) -> None:
    gm, node = m.gm, m.root
    weight_at, ids_at, options = _EMBEDDINGS[node.target]
    path = _embedding_module_at(node, gm)
    read = _arg(node, weight_at, "weight", None)
    holder = gm.get_submodule(path)
    values = {name: _arg(node, 2 + i, name, None) for i, name in enumerate(options)}
    padding = values["padding_idx"]
    emb = embedding_on(holder.weight, None if padding in (None, -1) else padding, values.get("max_norm"),
                       values.get("norm_type") or 2.0, bool(values["scale_grad_by_freq"]), bool(values["sparse"]),
                       holder.training)
    rehome_reads(gm, path, keep=("weight",))  # other tensors the traced forward reads stay reachable
    gm.set_submodule(path, emb)
    ids = _arg(node, ids_at, "input" if node.target is F.embedding else "indices", None)
    m.replace_root(lambda g: g.call_module(path, (ids,)))
    if not read.users:
        m.graph.erase_node(read)


def _canonical_linear(m: Match) -> None:
    n = m.root
    _call(m, F.linear, (n.args[0], _arg(n, 1, "weight", None), _arg(n, 2, "bias", None)))


_LINEARS = {F.linear, aten.linear.default}

RULES = [
    Rule("gelu-module", Pat.module(nn.GELU, name="gelu", nargs=1, kwargs=()), _gelu_module),
    Rule("gelu-function", Pat.call({GELU, aten.gelu.default}, nargs=1, kwargs=("approximate",),
                                   where=lambda n, gm: not _is_canonical_gelu(n, gm)), _gelu_function),
    Rule("gelu-tanh-formula", Pat.call(_MUL, where=lambda n, gm: tanh_gelu_formula(n) is not None), _tanh_gelu),
    Rule("relu-module", Pat.module(nn.ReLU, nargs=1, kwargs=(), where=_relu_module_ok), _relu),
    Rule("relu-function", Pat.call({F.relu, aten.relu.default}, kwargs=("inplace",), where=_relu_function_ok),
         _relu),
    Rule("relu-method", Pat.method("relu", nargs=1, kwargs=()), _relu),
    Rule("relu-inplace", Pat.call({torch.relu_, F.relu_, aten.relu_.default}, nargs=1, where=_sole_reader),
         _relu),
    Rule("relu-inplace-method", Pat.method("relu_", nargs=1, kwargs=(), where=_sole_reader), _relu),
    Rule("dropout-function", Pat.call(DROPOUT, kwargs=("p", "training", "inplace"), where=_dropout_ok(3)),
         _dropout("training")),
    Rule("dropout-torch", Pat.call({torch.dropout, aten.dropout.default}, kwargs=("p", "train"),
                                   where=_dropout_ok(None)), _dropout("train")),
    Rule("linear-module", Pat.call(_LINEARS, kwargs=("weight", "bias"),
                                   where=lambda n, gm: _linear_module_at(gm, n) is not None), _fold_linear),
    Rule("linear-function", Pat.call({aten.linear.default}, kwargs=("weight", "bias")), _canonical_linear),
    Rule("embedding-module", Pat.call(set(_EMBEDDINGS), where=lambda n, gm: _embedding_module_at(n, gm) is not None),
         _fold_embedding),
]


@register_pass
class Canonicalize(Pass):
    """Rewrite every spelling of GELU, ReLU, dropout and linear to one form
    (see the module doc). Runs first in the default pipeline."""

    name = CANONICALIZE

    def run(self, program: Program) -> Program:
        apply_rules(program.graph_module, RULES, self.matches)
        program.graph_module.delete_all_unused_submodules()
        return program

    def ensures(self, program: Program) -> None:
        left = [n.format_node() for n in program.graph.nodes
                if n.op == "call_function" and n.target in (aten.gelu.default, aten.relu.default,
                                                            aten.dropout.default, aten.linear.default)]
        if left:
            raise RuntimeError(f"canonicalize left non-canonical ops: {left[:3]}")


def activation_of(node: fx.Node) -> str | None:
    """The activation a canonical node applies: ``"gelu"``, ``"gelu_tanh"``,
    ``"relu"``, or ``None``."""
    if node.op != "call_function":
        return None
    if _is_canonical_gelu(node, None):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(node.kwargs["approximate"])
    if node.target is RELU and len(node.args) == 1 and not node.kwargs:
        return "relu"
    return None
