"""``tensorize``: choose the layers to compress and their TT / TTM layouts."""
from __future__ import annotations

from collections import defaultdict

from torch import nn

from .. import tuning
from ..formats.layout import TTLayout, TTMLayout
from ..ir.decisions import CompileDecisions
from ..ir.program import CompileContext, Program
from ..errors import ModelMismatchError
from ..frontend.layers import is_compressible, is_embedding, is_embedding_bag, is_experts, is_linear, kind_of
from ..runtime.layers.module_kinds import linear_weight_of
from .infra.base import Pass, register_pass
from .infra.pending import PendingLayer
from .infra.selection import select_modules

__all__ = ["Tensorize", "check_decision", "check_ties"]


@register_pass
class Tensorize(Pass):
    """Replace every selected ``nn.Linear`` / HF ``Conv1D`` / ``nn.Embedding`` /
    mixture-of-experts weight (:class:`~tncompile.runtime.layers.experts.ExpertLinear`)
    with a :class:`PendingLayer` carrying a balanced TT (linears; one network
    per expert) or TTM (embeddings) layout. Ranks are left for ``assign_ranks``.

    A layer stays dense, with the reason in ``program.notes``, when it is
    excluded, too small to gain (fewer than ``min_params`` weights, or a side
    that cannot be split into the configured number of modes), uses an
    unsupported feature (``max_norm``), or shares its weight in a way other than
    an output head tied to an embedding. A table built with ``sparse=True`` is
    compressed like any other (a recommender's model compiles unedited): its
    gradient is its cores', dense and small, which the note in the report says.

    Parameters
    ----------
    min_params : int, optional
        Layers with fewer weights than this are left dense
        (default :data:`tncompile.tuning.MIN_LAYER_PARAMS`).
    max_layer_ratio : float, optional
        A layer whose rank-1 network is larger than this share of its dense
        weight gains too little and is left dense (default
        :data:`tncompile.tuning.MAX_RANK1_RATIO`).
    """

    name = "tensorize"

    def __init__(self, min_params: int | None = None, max_layer_ratio: float | None = None):
        self._min_params = min_params
        self._max_layer_ratio = max_layer_ratio

    @property
    def min_params(self) -> int:
        return tuning.MIN_LAYER_PARAMS if self._min_params is None else self._min_params

    @property
    def max_layer_ratio(self) -> float:
        return tuning.MAX_RANK1_RATIO if self._max_layer_ratio is None else self._max_layer_ratio

    def run(self, program: Program, ctx: CompileContext) -> Program:
        opts = program.options
        modules: dict[str, nn.Module] = {}
        for node, mod in program.modules():
            if is_compressible(mod):
                modules.setdefault(node.target, mod)
        if not modules and not any(getattr(m, "is_pending", False) for _, m in program.modules()):
            raise ValueError("the model has no nn.Linear, nn.Embedding or HF Conv1D layer in its "
                             "traced graph: there is nothing to compress")
        swappable = ctx.swap_layers
        if swappable is not None:  # swap mode: only layers of the user's own tree can go back into it
            skipped = ctx.swap_skipped
            for name in [n for n in modules if n not in swappable]:
                program.notes[name] = skipped.get(
                    name, "not a layer of the model's own module tree (swap mode keeps it dense; "
                    "mode='graph' compresses it)")
                del modules[name]
        if ctx.decisions is not None:
            return self._replay(program, ctx.decisions, modules)
        selected, excluded = select_modules(modules, opts.target_modules, opts.exclude_modules)
        for name in modules:
            if name in excluded:
                program.notes[name] = "excluded by exclude_modules"
            elif name not in selected:
                program.notes[name] = "not in target_modules"

        layouts: dict[str, TTLayout | TTMLayout] = {}
        for name in selected:
            layout, reason = self._layout(modules[name], opts)
            if reason:
                program.notes[name] = reason
            else:
                layouts[name] = layout

        tied_to: dict[str, str] = {}
        by_weight: dict[int, list[str]] = defaultdict(list)
        for name, mod in modules.items():
            by_weight[id(mod.weight)].append(name)
        for group in by_weight.values():
            if len(group) == 1:
                continue
            embeddings = [n for n in group if is_embedding(modules[n])]
            heads = [n for n in group if isinstance(modules[n], nn.Linear)]
            ok = (len(embeddings) >= 1 and len(heads) + len(embeddings) == len(group)
                  and all(n in selected for n in group) and embeddings[0] in layouts
                  and len({_lookup_options(modules[n]) for n in embeddings}) == 1)
            if ok:  # one network: the first embedding owns it, other lookups and heads share it
                for other in (*embeddings[1:], *heads):
                    tied_to[other] = embeddings[0]
                    layouts.pop(other, None)
                    program.notes.pop(other, None)
                continue
            for n in group:
                layouts.pop(n, None)
                others = ", ".join(o for o in group if o != n)
                program.notes.setdefault(n, f"weight tied with {others}; kept dense because not "
                                            f"every module of the tie can be tensorized")

        for name in layouts:
            if getattr(modules[name], "sparse", False):
                program.notes[name] = SPARSE_TABLE_NOTE
        gm = program.graph_module
        for name, layout in layouts.items():
            gm.set_submodule(name, PendingLayer(modules[name], layout))
        for head, emb in tied_to.items():
            gm.set_submodule(head, PendingLayer(modules[head], layouts[emb], tied_to=emb))
        return program

    def _replay(self, program: Program, decisions: CompileDecisions, modules: dict[str, nn.Module]) -> Program:
        """``tncompile.load``: the saved layer table's layers and layouts, each checked against
        the user's model (a missing layer, another kind, shape or tie is a
        :class:`~tncompile.errors.ModelMismatchError`); every other layer stays dense."""
        decided = decisions.layers
        for name, decision in decided.items():
            check_decision(name, decision, modules, decided)
        check_ties(modules, decided)
        gm = program.graph_module
        for name, decision in decided.items():
            gm.set_submodule(name, PendingLayer(modules[name], decision.layout, tied_to=decision.tied_to))
        for name in modules:
            if name not in decided:
                program.notes[name] = "dense in the saved model"
        return program

    def _layout(self, mod: nn.Module, opts) -> tuple[TTLayout | TTMLayout | None, str | None]:
        if is_embedding(mod) or is_embedding_bag(mod):
            if mod.max_norm is not None:
                return None, "max_norm is set (TTM rows cannot be renormalized in place)"
            rows, cols, cores = mod.num_embeddings, mod.embedding_dim, opts.embedding_cores
            make = TTMLayout.for_shape
        elif is_linear(mod):
            cols, rows = linear_weight_of(mod).shape  # rows=in, cols=out
            cores = opts.cores_per_side
            make = TTLayout.for_shape
        elif is_experts(mod):  # one network per expert, of one layout
            rows, cols, cores = mod.in_features, mod.out_features, opts.cores_per_side

            def make(r, c, k, experts=mod.num_experts):
                return TTLayout.for_shape(r, c, k, experts=experts)
        else:  # pragma: no cover - filtered by the caller
            return None, "not a compressible layer"
        if not mod.weight.is_floating_point():
            return None, f"weight dtype {mod.weight.dtype} is not floating point"
        per_network = mod.weight.numel() // getattr(mod, "num_experts", 1)
        if per_network < self.min_params:
            return None, f"too small to gain ({per_network:,} weights < {self.min_params:,})"
        try:
            layout = make(rows, cols, cores)
        except ValueError as e:
            return None, f"too small to gain: {e}"
        if layout.with_ranks(1).num_params() > self.max_layer_ratio * layout.dense_params:
            return None, (f"too small to gain: even rank 1 keeps more than "
                          f"{self.max_layer_ratio:.0%} of the dense weight")
        return layout, None


SPARSE_TABLE_NOTE = ("built with sparse=True: compressed, its gradient is its cores' (dense and small), so an "
                     "optimizer that takes only sparse gradients (SparseAdam) does not fit it; SGD, Adagrad or "
                     "Adam do")


def _lookup_options(emb: nn.Embedding) -> tuple:
    """What besides the table decides a lookup's result and gradient: embeddings
    sharing a table are one network only when these agree."""
    return (emb.padding_idx, emb.max_norm, emb.scale_grad_by_freq, emb.sparse)


_DENSE_KINDS = {"linear": ("linear", "conv1d"), "tied": ("linear", "conv1d"), "alias": ("embedding",)}
_FIX = "build the model the file was saved from (same class and configuration) and pass it as model="


def check_ties(modules: dict[str, nn.Module], decided: dict) -> None:
    """The model's own ties, confirmed by the file: the layers sharing one weight are all in
    the table, as one network (its embedding) the others are tied to -- or none is. A file
    may not untie a head from its embedding, by a network of its own or by leaving it dense."""
    by_weight: dict[int, list[str]] = defaultdict(list)
    for name, mod in modules.items():
        by_weight[id(mod.weight)].append(name)
    for group in by_weight.values():
        in_table = [n for n in group if n in decided]
        owners = [n for n in in_table if decided[n].tied_to is None]
        if len(group) > 1 and in_table and (len(in_table) != len(group) or len(owners) != 1):
            raise ModelMismatchError(
                f"the model given ties {group} to one weight; the file "
                + (f"leaves {sorted(set(group) - set(in_table))} dense" if len(in_table) != len(group)
                   else f"gives {owners} networks of their own") + f", which would untie them: {_FIX}")


def check_decision(name: str, decision, modules: dict[str, nn.Module], decided: dict) -> None:
    """Whether the user's layer at ``name`` is what ``decision`` was made for: its kind,
    its weight's shape (the layout's dense shape; per expert), and for a tied head or an
    alias, its weight being the embedding's. :class:`ModelMismatchError` naming the layer."""
    mod = modules.get(name)
    if mod is None:
        raise ModelMismatchError(f"the model given has no compressible layer at {name!r}, where the file has a "
                                 f"{decision.kind} network: {_FIX}")
    kind = kind_of(mod)
    if kind not in _DENSE_KINDS.get(decision.kind, (decision.kind,)):
        raise ModelMismatchError(f"the model given has a {kind} at {name!r}, the file a {decision.kind}: {_FIX}")
    layout = decision.layout
    if isinstance(layout, TTMLayout):
        want = (layout.num_embeddings, layout.embedding_dim)
        got = tuple(mod.weight.shape)
    elif is_experts(mod):
        want = (layout.experts, layout.in_features, layout.out_features)
        got = (mod.num_experts, mod.in_features, mod.out_features)
    else:
        want = (layout.out_features, layout.in_features)
        got = tuple(linear_weight_of(mod).shape)
    if decision.kind == "tied":  # a head [vocab, dim]: the embedding's table
        want = (layout.num_embeddings, layout.embedding_dim)
    if got != want:
        raise ModelMismatchError(f"the model given has a {kind} of shape {got} at {name!r}, the file's network "
                                 f"stands for {want}: {_FIX}")
    if decision.tied_to is not None:
        owner = modules.get(decision.tied_to)
        if owner is None or owner.weight is not mod.weight or decided.get(decision.tied_to) is None:
            raise ModelMismatchError(f"the file ties {name!r} to the embedding {decision.tied_to!r}; in the model "
                                     f"given they do not share one weight: {_FIX}")
