"""``measure_ways``: time the ways of every TT linear and fused block at the batch sizes
``compile(batch_sizes=...)`` names, so the first training step measures nothing.

Where the measured choice applies (``tuning.MEASURE_WAYS``, a real CPU or CUDA device, one
process), each TT linear's row ways are timed at the rows of each named batch size
(:func:`.plan_contractions.rows_at_batch_sizes`), and so are the fused feed-forward and
sibling blocks against their layers run one by one (:mod:`tncompile.runtime.ways.measured`),
in the dtype of the layers' cores and the autocast state ``compile`` runs in -- where the
timing's tensors fit in ``tuning.MEASURE_AHEAD_BYTES`` (larger batches are timed on first
use, on the user's own input). A shape measured once (this process, or the disk cache of ``tuning.WAY_CACHE_DIR``) is not timed
again. Without ``batch_sizes`` the pass does nothing: each shape is measured on first use.
TTM lookups are measured on first use too (their rows are the distinct ids of a batch:
data, not a batch size). Nothing in the program changes; the history counts the shapes
timed.
"""
from __future__ import annotations

import torch
from torch import fx, nn

from .. import tuning
from ..ir.program import CompileContext, Program
from ..runtime.fused.feed_forward import feed_forward_way_for, tt_feed_forward
from ..runtime.fused.siblings import siblings_way_for, tt_siblings
from ..runtime.layers import TTLinear
from ..runtime.ways import linear as linear_way, measured
from .infra.base import Pass, register_pass
from .infra.progress import progress
from .plan_contractions import rows_at_batch_sizes

__all__ = ["MeasureWays"]


def _real(module: nn.Module) -> torch.Tensor | None:
    """The first core of ``module`` where it lives on a device ways are timed on."""
    core = next(iter(module.cores._parameters.values()))
    return core if core.device.type in ("cpu", "cuda") else None


def _like(core: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    return torch.empty(rows, width, dtype=core.dtype, device=core.device)


def _module_of(gm: fx.GraphModule, ref) -> nn.Module | None:
    if isinstance(ref, fx.Node) and ref.op == "get_attr":
        return gm.get_submodule(ref.target)
    return None


def _rows(node: fx.Node, batch_sizes: list[int], layers: list[nn.Module]) -> tuple[list[int], int]:
    """The rows to time ``layers`` at (``node``'s, at each batch size) within
    ``tuning.MEASURE_AHEAD_BYTES``, and how many batch sizes were left to first use."""
    core = _real(layers[0])
    width = layers[0].in_features + sum(m.out_features for m in layers)
    per_row = 2 * width * core.element_size()      # input and outputs, and their gradients
    rows = sorted(rows_at_batch_sizes(node, False, batch_sizes))
    kept = [r for r in rows if r * per_row <= tuning.MEASURE_AHEAD_BYTES]
    return kept, len(rows) - len(kept)


def _work(program: Program, batch_sizes: list[int]) -> tuple[list[tuple[str, tuple]], int]:
    """``(what, arguments)`` to time -- each plain TT linear and each fused block, at each
    distinct number of rows -- and how many were left to first use for their size."""
    gm, work, seen, skipped = program.graph_module, [], set(), 0
    for node in program.graph.nodes:
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            if type(mod) is TTLinear and _real(mod) is not None and mod.layout.copies == 1:
                rows, left = _rows(node, batch_sizes, [mod])
                skipped += left
                for r in rows:
                    if (id(mod), r) not in seen:
                        seen.add((id(mod), r))
                        work.append(("linear", (mod, r)))
        elif node.op == "call_function" and node.target is tt_feed_forward:
            first, second = _module_of(gm, node.args[1]), _module_of(gm, node.args[2])
            if isinstance(first, TTLinear) and isinstance(second, TTLinear) and _real(first) is not None:
                rows, left = _rows(node, batch_sizes, [first, second])
                skipped += left
                work.extend(("feed forward", (first, second, node.args[3], r)) for r in rows)
        elif node.op == "call_function" and node.target is tt_siblings:
            layers = [_module_of(gm, ref) for ref in node.args[1]]
            if all(isinstance(m, TTLinear) for m in layers) and _real(layers[0]) is not None:
                rows, left = _rows(node, batch_sizes, layers)
                skipped += left
                work.extend(("siblings", (layers, r)) for r in rows)
    return work, skipped


def _measure(what: str, args: tuple) -> None:
    if what == "linear":
        mod, rows = args
        linear_way.choose_rows(mod, _like(_real(mod), 0, mod.in_features), rows)
    elif what == "feed forward":
        first, second, activation, rows = args
        feed_forward_way_for(_like(_real(first), rows, first.in_features), first, second, activation)
    else:
        layers, rows = args
        siblings_way_for(_like(_real(layers[0]), rows, layers[0].in_features), layers)


@register_pass
class MeasureWays(Pass):
    """Time the ways of each TT linear and fused block at ``compile(batch_sizes=...)``'s rows."""

    name = "measure_ways"

    def run(self, program: Program, ctx: CompileContext) -> Program:
        batch_sizes = list(program.options.batch_sizes or [])
        if not batch_sizes or not tuning.MEASURE_WAYS or ctx.decisions is not None:
            return program   # nothing named, measuring off, or a file being loaded: first use measures
        before = measured.stats()["measured"]
        work, skipped = _work(program, batch_sizes)
        with torch.enable_grad():
            for what, args in progress(work, "measuring ways"):
                _measure(what, args)
        timed = measured.stats()["measured"] - before
        if timed:
            self.matches["shapes timed"] += timed
        if skipped:
            self.matches["left to first use (over tuning.MEASURE_AHEAD_BYTES)"] += skipped
        return program
