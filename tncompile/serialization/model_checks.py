"""A loaded model's tensors and layouts agree, checked before the model is returned.

A layout states the shape of every core and gate; a file can state one thing
in its layout and store another in its tensors, or inflate a number the
runtime allocates from. So for every tensorized layer of a decoded module
tree: the layout is a record of the right kind with positive, consistent
fields; every core, gate and bias has exactly the shape and a floating dtype
the layout implies; the layer's own settings (features, padding index, bag
mode) match it; and its plans are rebuilt from the layout, taking only each
plan's bucket and contraction order from the file (:func:`tncompile.planning.replay_plan`):
a plan's index names and sizes reach generated code, so none of them may
come from the file. Anything else raises :class:`~tncompile.errors.ModelFileError`
naming the layer and the field.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..errors import ModelFileError, UnsafeFileError
from ..formats.layout import TTLayout, TTMLayout
from ..planning import plan_lookup, replay_plan
from ..runtime.collapsed import CollapsedLayer
from ..runtime.embedding_bag import TTMEmbeddingBag
from ..runtime.experts import ExpertLinear, TTExperts
from ..runtime.plans import ContractionPlan, LookupPlan
from ..runtime.tt_layers import TNModule, TTLinear, TTMEmbedding, TTMTiedLinear

__all__ = ["check_model"]

MAX_BUCKET = 2**31
_BAG_MODES = ("sum", "mean", "max")


def check_model(root: nn.Module, limit: int) -> None:
    """Check every layer of ``root`` (see the module docstring); rebuild its plans.
    ``limit``: the largest size a setting may state (:class:`.graphs.GraphLimits`)."""
    for name, mod in root.named_modules(remove_duplicate=True):
        where = f"layer {name or '<root>'} ({type(mod).__name__})"
        _check_settings(mod, where, limit)
        if isinstance(mod, TTMTiedLinear):
            _check_tied(mod, where)
        elif isinstance(mod, TNModule):
            _check_network(mod, where)
            _rebuild_plans(mod, where)
        elif isinstance(mod, ExpertLinear):
            _check_experts_dense(mod, where)
        elif isinstance(mod, CollapsedLayer):
            _check_int(mod.__dict__.get("out_features"), f"{where}.out_features", low=0)


_REGISTRIES = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_plans", "layout"}


def _check_settings(mod: nn.Module, where: str, limit: int) -> None:
    """A module's plain settings (``padding``, ``kernel_size``, ``num_embeddings``, ...) state no
    size beyond what the file's tensors justify: its forward may allocate from them."""
    for key, value in mod.__dict__.items():
        if key in _REGISTRIES:
            continue
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, (tuple, list)) and len(v) <= 64:
                stack.extend(v)
            elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > limit:
                raise UnsafeFileError(f"{where}.{key}: {v:,} is larger than the file's own tensors justify "
                                      f"({limit:,})")


def _fail(where: str, what: str) -> ModelFileError:
    return ModelFileError(f"{where}: {what}")


def _check_int(v: Any, where: str, low: int = 1, high: int = 2**40) -> int:
    if not (isinstance(v, int) and not isinstance(v, bool) and low <= v <= high):
        raise _fail(where, f"{v!r} is not an integer in [{low}, {high}]")
    return v


def _check_modes(modes: Any, where: str) -> tuple[int, ...]:
    if not (isinstance(modes, tuple) and 1 <= len(modes) <= 32):
        raise _fail(where, f"{modes!r} is not a tuple of modes")
    for m in modes:
        _check_int(m, where, 1, 2**31)
    return modes


def _check_layout(layout: Any, kind: type, where: str) -> None:
    if type(layout) is not kind:
        raise _fail(f"{where}.layout", f"a {type(layout).__name__}, the layer needs a {kind.__name__}")
    if kind is TTLayout:
        ins = _check_modes(layout.in_modes, f"{where}.layout.in_modes")
        outs = _check_modes(layout.out_modes, f"{where}.layout.out_modes")
        features = ((layout.in_features, ins, "in_features"), (layout.out_features, outs, "out_features"))
        _check_int(layout.experts, f"{where}.layout.experts", 1, 2**20)
    else:
        rows = _check_modes(layout.row_modes, f"{where}.layout.row_modes")
        cols = _check_modes(layout.col_modes, f"{where}.layout.col_modes")
        if len(rows) != len(cols):
            raise _fail(f"{where}.layout", "row_modes and col_modes differ in length")
        features = ((layout.num_embeddings, rows, "num_embeddings"), (layout.embedding_dim, cols, "embedding_dim"))
    for value, modes, field in features:
        _check_int(value, f"{where}.layout.{field}")
        if math.prod(modes) < value:
            raise _fail(f"{where}.layout", f"its modes {modes} hold {math.prod(modes):,} < {field}={value:,}")
    ranks = layout.ranks
    if not (isinstance(ranks, tuple) and len(ranks) == layout.num_cores - 1):
        raise _fail(f"{where}.layout.ranks", f"{ranks!r}: the layout has {layout.num_cores} cores, so "
                                             f"{layout.num_cores - 1} ranks")
    for r in ranks:
        _check_int(r, f"{where}.layout.ranks", 1, 2**20)


def _shape_of(t: Any, where: str) -> tuple[int, ...]:
    if not isinstance(t, torch.Tensor):
        raise _fail(where, "missing")
    if not (t.is_floating_point() or t.is_complex()):
        raise _fail(where, f"dtype {t.dtype}: cores, gates and biases are floating point")
    return tuple(t.shape)


def _check_network(mod: TNModule, where: str) -> None:
    kind = TTLayout if isinstance(mod, (TTLinear, TTExperts)) else TTMLayout
    layout = mod.__dict__.get("layout")
    _check_layout(layout, kind, where)
    lead = (layout.copies,) * int(getattr(type(mod), "stacked", 0))
    cores = list(mod.cores._parameters.values()) if isinstance(getattr(mod, "cores", None), nn.Module) else None
    gates = list(mod.gates._parameters.values()) if isinstance(getattr(mod, "gates", None), nn.Module) else None
    if cores is None or gates is None:
        raise _fail(where, "its cores or gates are missing")
    want_cores = [lead + tuple(s) for s in layout.core_shapes()]
    want_gates = [lead + (r,) for r in layout.ranks]
    got_cores = [_shape_of(c, f"{where}.cores[{i}]") for i, c in enumerate(cores)]
    got_gates = [_shape_of(g, f"{where}.gates[{i}]") for i, g in enumerate(gates)]
    if got_cores != want_cores:
        raise _fail(where, f"its cores are {got_cores}, its layout ({layout.describe()}) says {want_cores}")
    if got_gates != want_gates:
        raise _fail(where, f"its gates are {got_gates}, its ranks {layout.ranks} say {want_gates}")
    dtypes = {t.dtype for t in cores + gates}
    if len(dtypes) != 1:
        raise _fail(where, f"its cores and gates mix dtypes {sorted(map(str, dtypes))}")
    if kind is TTLayout:
        for field in ("in_features", "out_features"):
            if mod.__dict__.get(field) != getattr(layout, field):
                raise _fail(f"{where}.{field}", f"{mod.__dict__.get(field)!r}, the layout says "
                                                f"{getattr(layout, field)}")
        _check_bias(mod, None if isinstance(mod, TTExperts) else (layout.out_features,), where)
    else:
        for field in ("num_embeddings", "embedding_dim"):
            if mod.__dict__.get(field) != getattr(layout, field):
                raise _fail(f"{where}.{field}", f"{mod.__dict__.get(field)!r}, the layout says "
                                                f"{getattr(layout, field)}")
        padding = mod.__dict__.get("padding_idx")
        if padding is not None:
            _check_int(padding, f"{where}.padding_idx", -layout.num_embeddings, layout.num_embeddings - 1)
        if isinstance(mod, TTMEmbeddingBag):
            if mod.__dict__.get("mode") not in _BAG_MODES:
                raise _fail(f"{where}.mode", f"{mod.__dict__.get('mode')!r} is not one of {_BAG_MODES}")
            if not isinstance(mod.__dict__.get("include_last_offset"), bool):
                raise _fail(f"{where}.include_last_offset", "must be true or false")


def _check_bias(mod: nn.Module, shape: tuple[int, ...] | None, where: str) -> None:
    bias = mod._parameters.get("bias")
    if bias is None or shape is None:
        return
    if _shape_of(bias, f"{where}.bias") != tuple(shape):
        raise _fail(f"{where}.bias", f"shape {tuple(bias.shape)}, the layer's outputs are {tuple(shape)}")


def _check_tied(mod: TTMTiedLinear, where: str) -> None:
    embedding = mod._modules.get("embedding")
    if not isinstance(embedding, TTMEmbedding):
        raise _fail(where, "a tied head without the TTM embedding it shares")
    for field, want in (("in_features", embedding.__dict__.get("embedding_dim")),
                        ("out_features", embedding.__dict__.get("num_embeddings"))):
        if mod.__dict__.get(field) != want:
            raise _fail(f"{where}.{field}", f"{mod.__dict__.get(field)!r}, its embedding says {want!r}")
    _check_bias(mod, (mod.out_features,), where)
    _rebuild_plans(mod, where)


def _check_experts_dense(mod: ExpertLinear, where: str) -> None:
    weight = mod._parameters.get("weight")
    shape = _shape_of(weight, f"{where}.weight")
    if len(shape) != 3:
        raise _fail(f"{where}.weight", f"shape {shape}: expert weights are (experts, rows, cols)")
    want = (shape[0], shape[1], shape[2]) if mod.__dict__.get("transposed") else (shape[0], shape[2], shape[1])
    got = (mod.__dict__.get("num_experts"), mod.__dict__.get("in_features"), mod.__dict__.get("out_features"))
    if got != want:
        raise _fail(where, f"(experts, in, out) = {got}, its weight says {want}")


def _rebuild_plans(mod: TNModule, where: str) -> None:
    """Replace the file's plans by plans derived from the layout: a contraction plan keeps its
    bucket and its order, a lookup plan its bucket (the split is searched again: it is cheap)."""
    plans = mod.__dict__.get("_plans")
    if plans is None:
        return
    if not isinstance(plans, dict):
        raise _fail(f"{where}.plans", "must be a dict of bucket -> plan")
    rebuilt = {}
    for bucket, plan in plans.items():
        at = f"{where}.plans[{bucket!r}]"
        _check_int(bucket, at, 1, MAX_BUCKET)
        if bucket & (bucket - 1):
            raise _fail(at, "a bucket is a power of two")
        if isinstance(plan, LookupPlan) and isinstance(mod, TTMEmbedding) and not isinstance(mod, TTMTiedLinear):
            rebuilt[bucket] = plan_lookup(mod.layout, bucket)
        elif isinstance(plan, ContractionPlan) and not (isinstance(mod, TTMEmbedding)):
            rebuilt[bucket] = _replay(mod, bucket, plan, at)
        else:
            raise _fail(at, f"a {type(plan).__name__} cannot serve a {type(mod).__name__}")
    mod.__dict__["_plans"] = rebuilt


def _replay(mod: TNModule, bucket: int, plan: ContractionPlan, where: str) -> ContractionPlan:
    steps = plan.steps
    if not isinstance(steps, list) or len(steps) > 256:
        raise _fail(where, "a plan's steps must be a list")
    pairs = []
    for k, step in enumerate(steps):
        a, b = getattr(step, "a", None), getattr(step, "b", None)
        _check_int(a, f"{where}.steps[{k}].a", 0, 512)
        _check_int(b, f"{where}.steps[{k}].b", 0, 512)
        pairs.append((a, b))
    strategy = plan.strategy if isinstance(plan.strategy, str) and len(plan.strategy) < 64 else "saved"
    try:
        return replay_plan(mod.layout, bool(getattr(mod, "transposed", False)), bucket, pairs, strategy)
    except (ValueError, KeyError, IndexError) as e:
        raise _fail(where, f"its contraction order does not contract this layer's network ({e})") from e
