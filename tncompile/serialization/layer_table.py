"""The layer table: one row per compressed layer, to and from a file, every field checked.

A row is data: the layer's path in the model, its kind, its layout (modes and ranks),
whether rank adaptation collapsed it, which embedding a tied head or alias shares, and
the names of the tensors holding its cores and gates. Reading one back
(:func:`decisions_from_rows`) accepts only exact types, values from fixed sets and sizes
within bounds, and checks every layout against the tensors the file holds before
anything is built: a layout's cores must be exactly the file's tensors of those names,
so rebuilding the model allocates no more than the file already holds.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..errors import ModelFileError
from ..formats.layout import TTLayout, TTMLayout
from ..ir.decisions import LAYER_KINDS, CompileDecisions, LayerDecision
from ..ir.program import Program
from ..runtime import CollapsedLayer, TNModule, TTMEmbedding, TTMEmbeddingBag, TTMTiedLinear
from ..runtime.layers.experts import TTExperts
from .fields import boolean, choice, exact_keys, integer, module_path, names

__all__ = ["decisions_of", "table_rows", "decisions_from_rows", "MAX_LAYERS"]

MAX_LAYERS = 20_000  # a 1B-parameter model has a few hundred; the table fits the 16 MiB header
MAX_MODES = 16          # modes per side of a network
MAX_MODE = 2**20
MAX_FEATURES = 2**31 - 1
MAX_EXPERTS = 2**16


# ----------------------------------------------------------------- from a model
def decisions_of(program: Program) -> CompileDecisions:
    """The decisions that rebuild ``program``'s current layers: every TT/TTM layer and every
    layer rank adaptation collapsed, keyed by its path in the program's graph."""
    modules = [(node.target, m) for node, m in program.modules()]
    first_path: dict[int, str] = {}
    for path, m in modules:
        first_path.setdefault(id(m), path)
    layers: dict[str, LayerDecision] = {}
    for path, m in modules:
        if path in layers:
            continue
        if isinstance(m, TNModule):
            layers[path] = _decision(path, m, first_path)
        elif isinstance(m, CollapsedLayer):
            layers[path] = _collapsed_decision(path, m, program, first_path[id(m)])
    return CompileDecisions(layers)


def _decision(path: str, m: TNModule, first_path: dict[int, str]) -> LayerDecision:
    owner = first_path[id(m)]
    if isinstance(m, TTMTiedLinear):
        return LayerDecision("tied", m.layout, tied_to=first_path[id(m.embedding)])
    if owner != path:  # the same table looked up from a second place
        return LayerDecision("alias", m.layout, tied_to=owner)
    kind = ("experts" if isinstance(m, TTExperts) else "embedding_bag" if isinstance(m, TTMEmbeddingBag)
            else "embedding" if isinstance(m, TTMEmbedding) else "linear")
    return LayerDecision(kind, m.layout)


def _collapsed_decision(path: str, m: CollapsedLayer, program: Program, owner: str) -> LayerDecision:
    """A collapsed layer is rebuilt at rank 1 from its modes (recorded when it collapsed)
    and collapsed again; its ranks mean nothing once collapsed."""
    layout = program.collapsed_layouts.get(path)
    if layout is None:
        raise ValueError(f"{path}: a collapsed layer without its recorded layout cannot be saved")
    tied_to = program.collapsed_ties.get(path)
    if tied_to is not None:
        return LayerDecision("tied", layout.with_ranks(1), tied_to=tied_to, collapsed=True)
    if owner != path:
        return LayerDecision("alias", layout.with_ranks(1), tied_to=owner, collapsed=True)
    return LayerDecision(m.kind, layout.with_ranks(1), collapsed=True)


def table_rows(decisions: CompileDecisions, program: Program, model: nn.Module) -> list[dict[str, Any]]:
    """JSON rows of ``decisions``: the names of each layer's cores and gates are their
    ``state_dict`` names in ``model`` (found by identity: a swapped subclass keeps its
    network one level down)."""
    state_name: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        state_name.setdefault(id(t), name)
    modules = {node.target: m for node, m in program.modules()}
    rows = []
    for path, d in decisions.layers.items():
        row: dict[str, Any] = {"path": path, "kind": d.kind, "layout": _layout_row(d.layout),
                               "collapsed": d.collapsed, "tied_to": d.tied_to, "cores": [], "gates": []}
        layer = modules.get(path)
        if isinstance(layer, TNModule) and d.tied_to is None:
            row["cores"] = [state_name[id(p)] for p in layer.cores._parameters.values()]
            row["gates"] = [state_name[id(p)] for p in layer.gates._parameters.values()]
        rows.append(row)
    return rows


def _layout_row(layout: TTLayout | TTMLayout) -> dict[str, Any]:
    if isinstance(layout, TTLayout):
        return {"format": "TT", "in_features": layout.in_features, "out_features": layout.out_features,
                "in_modes": list(layout.in_modes), "out_modes": list(layout.out_modes),
                "ranks": list(layout.ranks), "experts": layout.experts}
    return {"format": "TTM", "num_embeddings": layout.num_embeddings, "embedding_dim": layout.embedding_dim,
            "row_modes": list(layout.row_modes), "col_modes": list(layout.col_modes), "ranks": list(layout.ranks)}


# ----------------------------------------------------------------- from a file
def decisions_from_rows(rows: Any, tensors: dict[str, torch.Tensor], where: str) -> CompileDecisions:
    """The checked decisions of a file's layer table (see the module doc); ``ModelFileError``
    naming the row and field for anything out of type, set or bounds, or any layout that
    disagrees with the file's tensors."""
    if not isinstance(rows, list) or len(rows) > MAX_LAYERS:
        raise ModelFileError(f"{where}: the layer table must be a list of at most {MAX_LAYERS:,} rows")
    layers: dict[str, LayerDecision] = {}
    claimed: set[str] = set()
    for i, row in enumerate(rows):
        at = f"{where}: layer table row {i}"
        exact_keys(row, {"path", "kind", "layout", "collapsed", "tied_to", "cores", "gates"}, at)
        path = module_path(row["path"], f"{at}: path")
        if path in layers:
            raise ModelFileError(f"{at}: the path {path!r} appears twice")
        kind = choice(row["kind"], LAYER_KINDS, f"{at}: kind")
        collapsed = boolean(row["collapsed"], f"{at}: collapsed")
        tied_to = None if row["tied_to"] is None else module_path(row["tied_to"], f"{at}: tied_to")
        layout = _layout(row["layout"], kind, f"{at} ({path}): layout")
        try:
            decision = LayerDecision(kind, layout, tied_to=tied_to, collapsed=collapsed)
        except ValueError as e:
            raise ModelFileError(f"{at} ({path}): {e}") from e
        shared = tied_to is not None or collapsed
        cores = names(row["cores"], 0 if shared else layout.num_cores, f"{at} ({path}): cores")
        gates = names(row["gates"], 0 if shared else layout.num_cores - 1, f"{at} ({path}): gates")
        lead = (layout.experts,) if kind == "experts" else ()
        for name, shape in [*zip(cores, layout.core_shapes()), *zip(gates, ((r,) for r in layout.ranks))]:
            _check_tensor(tensors, name, lead + tuple(shape), f"{at} ({path})")
            if name in claimed:
                raise ModelFileError(f"{at} ({path}): the tensor {name!r} belongs to two layers")
            claimed.add(name)
        if kind == "experts" and not isinstance(layout, TTLayout):
            raise ModelFileError(f"{at} ({path}): experts have a TT layout")
        layers[path] = decision
    for path, d in layers.items():
        if d.tied_to is not None:
            owner = layers.get(d.tied_to)
            if owner is None or owner.kind != "embedding" or owner.layout != d.layout or owner.collapsed != d.collapsed:
                raise ModelFileError(f"{where}: {path!r} is tied to {d.tied_to!r}, which is not an embedding of the "
                                     "same layout in the table")
    return CompileDecisions(layers)


def _check_tensor(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], at: str) -> None:
    t = tensors.get(name)
    if t is None:
        raise ModelFileError(f"{at}: the file has no tensor {name!r}")
    if tuple(t.shape) != shape:
        raise ModelFileError(f"{at}: the tensor {name!r} is {tuple(t.shape)}, its layout makes it {shape}")


def _layout(data: Any, kind: str, at: str) -> TTLayout | TTMLayout:
    if not isinstance(data, dict):
        raise ModelFileError(f"{at}: must be an object")
    fmt = choice(data.get("format"), ("TT", "TTM"), f"{at}: format")
    if (fmt == "TTM") != (kind in ("embedding", "embedding_bag", "tied", "alias")):
        raise ModelFileError(f"{at}: a {kind} layer does not have a {fmt} layout")
    if fmt == "TT":
        exact_keys(data, {"format", "in_features", "out_features", "in_modes", "out_modes", "ranks", "experts"}, at)
        in_f = integer(data["in_features"], 1, MAX_FEATURES, f"{at}: in_features")
        out_f = integer(data["out_features"], 1, MAX_FEATURES, f"{at}: out_features")
        in_modes = _modes(data["in_modes"], in_f, f"{at}: in_modes")
        out_modes = _modes(data["out_modes"], out_f, f"{at}: out_modes")
        experts = integer(data["experts"], 1, MAX_EXPERTS, f"{at}: experts")
        if experts != 1 and kind != "experts":
            raise ModelFileError(f"{at}: only an experts layer holds several networks")
        layout = TTLayout(ranks=None, in_features=in_f, out_features=out_f, in_modes=in_modes,
                          out_modes=out_modes, experts=experts)
    else:
        exact_keys(data, {"format", "num_embeddings", "embedding_dim", "row_modes", "col_modes", "ranks"}, at)
        rows = integer(data["num_embeddings"], 1, MAX_FEATURES, f"{at}: num_embeddings")
        cols = integer(data["embedding_dim"], 1, MAX_FEATURES, f"{at}: embedding_dim")
        row_modes = _modes(data["row_modes"], rows, f"{at}: row_modes")
        col_modes = _modes(data["col_modes"], cols, f"{at}: col_modes")
        if len(row_modes) != len(col_modes):
            raise ModelFileError(f"{at}: row_modes and col_modes differ in length")
        layout = TTMLayout(ranks=None, num_embeddings=rows, embedding_dim=cols, row_modes=row_modes,
                           col_modes=col_modes)
    if layout.num_cores < 2:
        raise ModelFileError(f"{at}: a network of {layout.num_cores} core(s)")
    ranks = data["ranks"]
    bounds = layout.rank_bounds()
    if not isinstance(ranks, list) or len(ranks) != len(bounds):
        raise ModelFileError(f"{at}: ranks must be a list of {len(bounds)} ints")
    return replace(layout, ranks=tuple(integer(r, 1, b, f"{at}: ranks[{k}]")
                                       for k, (r, b) in enumerate(zip(ranks, bounds))))


def _modes(data: Any, features: int, at: str) -> tuple[int, ...]:
    """Mode sizes whose product pads ``features`` by at most double."""
    if not isinstance(data, list) or not 1 <= len(data) <= MAX_MODES:
        raise ModelFileError(f"{at}: must be a list of 1 to {MAX_MODES} ints")
    modes = tuple(integer(m, 1, MAX_MODE, f"{at}[{k}]") for k, m in enumerate(data))
    padded = math.prod(modes)
    if not features <= padded <= 2 * features:
        raise ModelFileError(f"{at}: the modes' product {padded:,} does not pad {features:,} (at most double)")
    return modes
