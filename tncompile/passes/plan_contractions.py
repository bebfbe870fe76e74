"""``plan_contractions``: pick a contraction order per layer and batch-size bucket."""
from __future__ import annotations

from math import prod

from torch import fx

from ..ir.program import CompileContext, Program
from .infra.progress import progress
from ..formats.layout import TTLayout
from ..runtime.layers.experts import experts_rows
from ..runtime.kernels.plans import bucket_of
from ..runtime.layers import TNModule, TTMEmbedding
from .infra.base import Pass, register_pass

__all__ = ["PlanContractions", "example_rows", "rows_at_batch_sizes"]


def example_rows(node: fx.Node, lookup: bool) -> tuple[int, int] | None:
    """``(batch, rows)`` the layer saw when traced: rows = batch x the other leading
    dims (for an embedding lookup: x every dim of the ids). A layer passed to a
    fused call (``get_attr``) sees the rows of that call's input."""
    if node.op == "get_attr" and node.users:
        node = next(iter(node.users))
    arg = node.args[0] if node.args else None
    meta = getattr(arg, "meta", {}) if isinstance(arg, fx.Node) else {}
    val = meta.get("val", meta.get("tensor_meta"))
    shape = getattr(val, "shape", None)
    if not shape or (len(shape) < 2 and not lookup):
        return None
    try:
        lead = shape if lookup else shape[:-1]
    except TypeError:
        return None
    try:
        dims = [int(d) for d in lead]
    except (TypeError, ValueError):  # symbolic sizes from torch.export
        hints = [getattr(getattr(d, "node", None), "hint", None) for d in lead]
        if any(h is None for h in hints):
            return None
        dims = [int(h) for h in hints]
    return dims[0], prod(dims)


def rows_at_batch_sizes(node: fx.Node, lookup: bool, batch_sizes: list[int]) -> set[int]:
    """The rows a layer multiplies at each of ``batch_sizes``: each batch size times the
    non-batch leading dims it saw when traced (the batch sizes themselves where the trace
    says nothing)."""
    example = example_rows(node, lookup)
    if example is None:
        return set(batch_sizes)
    batch, traced = example
    return {b * (traced // max(batch, 1)) for b in batch_sizes}


@register_pass
class PlanContractions(Pass):
    """Plan every TT network (and every TTM lookup) for the buckets it will see.

    Buckets are powers of two of the number of rows a layer multiplies. From
    ``compile(batch_sizes=...)``: each batch size times the non-batch leading
    dims seen at trace time (e.g. the sequence length); plus the traced rows
    themselves. Other sizes are planned on first use and cached. Plans live
    on the layers (``layer.plans``) and are shown in the IR dump. Loading a file
    plans nothing ahead: each bucket is planned on its first use.
    """

    name = "plan_contractions"

    def run(self, program: Program, ctx: CompileContext) -> Program:
        if ctx.decisions is not None:
            # tncompile.load: a file's layouts and batch sizes would size the search; every
            # bucket is planned on first use instead (as a bucket nobody named is), so
            # loading costs no planning
            return program
        batch_sizes = list(program.options.batch_sizes or [])
        work: list[tuple[TNModule, int]] = []
        seen: set[tuple[int, int]] = set()
        for node, mod in program.modules():
            if not isinstance(mod, TNModule):
                continue
            lookup = isinstance(mod, TTMEmbedding)
            example = example_rows(node, lookup)
            rows = rows_at_batch_sizes(node, lookup, batch_sizes) | ({example[1]} if example is not None else set())
            copies = mod.layout.copies if isinstance(mod.layout, TTLayout) else 1
            for r in {experts_rows(r, copies) for r in rows}:  # an expert multiplies its share of the rows
                key = (id(mod), bucket_of(r))
                if key not in seen:
                    seen.add(key)
                    work.append((mod, bucket_of(r)))
        for mod, bucket in progress(work, "contraction planning"):
            if bucket not in mod.plans:
                mod.plan_bucket(bucket)
        return program
