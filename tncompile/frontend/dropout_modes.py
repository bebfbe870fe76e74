"""Dropout that a trace baked into constants, made to follow ``train()`` / ``eval()``.

A trace runs the model's Python once, so ``F.dropout(x, p, training=self.training)``
and ``F.scaled_dot_product_attention(..., dropout_p=p if self.training else 0.0)``
(every HF attention) become constants: a model compiled in ``train()`` mode kept
dropping out after ``.eval()``, one compiled in ``eval()`` mode trained without
attention dropout. ``nn.Dropout`` *modules* already follow the mode (the frontend
keeps them as ``call_module`` nodes). After tracing, :func:`follow_training_mode`
rewrites the rest:

* a functional dropout (``F.dropout``, ``torch.dropout``, ``aten.dropout``) with a
  constant ``training`` becomes a call of an ``nn.Dropout(p)`` module at
  ``<owner>.dropout_fn`` (the module whose code called it), which follows the
  mode (``training=self.training`` is what such a call means in a module);
* an attention call with a constant ``dropout_p`` reads its rate from an
  :class:`~tncompile.runtime.fused.attention.AttentionDropoutRate` module at
  ``<owner>.attention_dropout`` (``p`` in training mode, 0 in eval mode). A trace
  in eval mode shows ``dropout_p=0``; the rate then comes from the owner's
  attributes, by the names in :data:`ATTENTION_RATE_NAMES` (HF's BERT, GPT-2,
  Llama, Qwen2, Mistral, Mixtral), in that order.

What an eval-mode ``torch.export`` trace elides entirely (a functional dropout
whose ``training`` was ``False``) cannot be recovered: when the model holds an
``nn.Dropout`` with ``p > 0`` that no graph node runs or accounts for, a warning
names it and the fix (compile the model in ``train()`` mode).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..runtime.fused.attention import AttentionDropoutRate

__all__ = ["follow_training_mode", "ATTENTION_RATE_NAMES"]

aten = torch.ops.aten

# attention call -> position of dropout_p among its positional args
ATTENTION_CALLS = {F.scaled_dot_product_attention: 4, aten.scaled_dot_product_attention.default: 4}
# functional dropout -> (position of p, name of p, position of the training flag, its name)
DROPOUT_CALLS = {F.dropout: (1, "p", 2, "training"), torch.dropout: (1, "p", 2, "train"),
                 aten.dropout.default: (1, "p", 2, "train")}
DROPOUT_DEFAULTS = {F.dropout: (0.5, True)}  # p, training when the call leaves them out
# attributes of an attention module that hold its dropout rate: an nn.Dropout or a float
ATTENTION_RATE_NAMES = ("attention_dropout", "attn_dropout", "dropout", "dropout_prob", "dropout_p")


def _arg(node: fx.Node, position: int, name: str, default=None):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _set_arg(node: fx.Node, position: int, name: str, value) -> None:
    if len(node.args) > position:
        args = list(node.args)
        args[position] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def _owner(node: fx.Node) -> str:
    """Path of the module whose forward made the call ('' for the model itself)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    entry = next(reversed(stack.values()))
    path = entry[0] if isinstance(entry, tuple) else entry
    return path if isinstance(path, str) else ""


def _free_path(gm: fx.GraphModule, owner: str, leaf: str) -> str:
    base = f"{owner}.{leaf}" if owner else leaf
    path, i = base, 0
    while True:
        try:
            gm.get_submodule(path)
        except AttributeError:
            return path
        i += 1
        path = f"{base}_{i}"


def _rate_of(module: nn.Module | None) -> float | None:
    """The attention dropout rate an owner module holds (:data:`ATTENTION_RATE_NAMES`)."""
    if module is None:
        return None
    for name in ATTENTION_RATE_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, nn.Dropout):
            return float(value.p)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0:
            return float(value)
    return None


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def follow_training_mode(gm: fx.GraphModule, model: nn.Module, traced_training: bool) -> None:
    """Rewrite ``gm``'s baked dropout (see the module doc) in place.

    Parameters
    ----------
    gm : fx.GraphModule
        The fresh trace of ``model``.
    model : nn.Module
        What was traced (its modules give the rates an eval-mode trace dropped).
    traced_training : bool
        The mode ``model`` was traced in.
    """
    graph = gm.graph
    accounted: set[str] = set()  # owners whose attention rate the graph now carries
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in DROPOUT_CALLS:
            _functional_to_module(gm, node)
        elif node.target in ATTENTION_CALLS:
            owner = _owner(node)
            if _attention_rate(gm, model, node, traced_training):
                accounted.add(owner)
    graph.lint()
    gm.recompile()
    if not traced_training:
        _warn_unseen(gm, model, accounted)


def _functional_to_module(gm: fx.GraphModule, node: fx.Node) -> None:
    p_pos, p_name, t_pos, t_name = DROPOUT_CALLS[node.target]
    default_p, default_training = DROPOUT_DEFAULTS.get(node.target, (None, None))
    p = _arg(node, p_pos, p_name, default_p)
    training = _arg(node, t_pos, t_name, default_training)
    inplace = _arg(node, 3, "inplace", False) if node.target is F.dropout else False
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not isinstance(training, bool) \
            or not isinstance(inplace, bool) or not 0.0 <= p <= 1.0:
        return  # the rate or the flag is computed in the graph: it is not a baked constant
    if p == 0:
        return  # drops nothing in either mode (an eval-mode trace of ``p if self.training else 0``)
    path = _free_path(gm, _owner(node), "dropout_fn")
    gm.add_submodule(path, nn.Dropout(float(p), inplace=inplace).train(gm.training))
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(path, (node.args[0],))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _attention_rate(gm: fx.GraphModule, model: nn.Module, node: fx.Node, traced_training: bool) -> bool:
    """Feed ``node``'s ``dropout_p`` from an :class:`AttentionDropoutRate`; whether it did."""
    position = ATTENTION_CALLS[node.target]
    baked = _arg(node, position, "dropout_p", 0.0)
    if not isinstance(baked, (int, float)) or isinstance(baked, bool):
        return False  # computed in the graph
    owner = _owner(node)
    p = float(baked) if traced_training or baked > 0 else _rate_of(_module(model, owner))
    if p is None or not 0.0 < p < 1.0:
        return p is not None
    path = _free_path(gm, owner, "attention_dropout")
    gm.add_submodule(path, AttentionDropoutRate(p).train(gm.training))
    with gm.graph.inserting_before(node):
        rate = gm.graph.call_module(path, ())
    rate.meta = {"nn_module_stack": node.meta["nn_module_stack"]} if "nn_module_stack" in node.meta else {}
    _set_arg(node, position, "dropout_p", rate)
    return True


def _warn_unseen(gm: fx.GraphModule, model: nn.Module, accounted: set[str]) -> None:
    running = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    lost = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Dropout) or module.p <= 0 or path in running:
            continue
        owner = path.rpartition(".")[0]
        if owner in accounted:
            continue
        lost.append(f"{path} (p={module.p})")
    if lost:
        shown = ", ".join(lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
        warnings.warn(f"{type(model).__name__} was traced in eval mode and these dropouts did not run as modules "
                      f"in the trace: {shown}; dropout applied by function calls in eval mode leaves no trace, so "
                      "the compiled model would train without it. Call model.train() before compiling to keep "
                      "them (they still follow train()/eval() afterwards).", stacklevel=4)
