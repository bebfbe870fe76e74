"""``decompose``: turn pending layers into trainable TT / TTM layers."""
from __future__ import annotations

import torch

from ..calibration.layer_fit import RIDGE, fit_linear_cores, fit_table_cores, output_error
from ..ir.program import CompileContext, Program
from .infra.progress import progress
from ..runtime.layers.module_kinds import linear_weight_of
from ..runtime.layers.experts import TTExperts
from ..runtime.layers.embedding_bag import TTMEmbeddingBag
from ..runtime.layers import TTLinear, TTMEmbedding, TTMTiedLinear
from .infra.base import Pass, register_pass
from .infra.pending import PendingLayer

__all__ = ["Decompose"]


@register_pass
class Decompose(Pass):
    """Build the cores of every pending layer at its assigned ranks:
    TT-SVD of the dense weight (``init="svd"``) or a variance-matched random
    draw (``init="random"``). With calibration statistics
    (``compile(calibration=...)``) each linear network is then refit to the
    layer's outputs on those inputs and each table to its rows weighted by use
    (:mod:`tncompile.calibration.layer_fit`); the errors before and after go
    into ``program.calibration_summary`` (the report shows them). Tied heads then share their embedding's cores,
    and other lookups of the same table (aliases) become the embedding itself."""

    name = "decompose"

    def requires(self, program: Program) -> None:
        missing = [n for n, m in _pending(program).items() if m.layout.ranks is None]
        if missing:
            raise ValueError(f"layers {missing} have no ranks; run assign_ranks before decompose")

    def ensures(self, program: Program) -> None:
        if _pending(program):
            raise RuntimeError(f"decompose left pending layers: {list(_pending(program))[:3]}")

    def run(self, program: Program, ctx: CompileContext) -> Program:
        opts = program.options
        gm = program.graph_module
        pending = _pending(program)
        replay = ctx.decisions is not None  # tncompile.load: the cores are loaded next, not fit here
        init = "random" if replay else opts.init
        seed = 0 if replay else opts.seed
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        built: dict[str, torch.nn.Module] = {}
        owners = [(n, m) for n, m in pending.items() if m.tied_to is None]
        stats = None if replay else ctx.calibration
        for name, mod in progress(owners, "decomposition (TT-SVD)" if stats is None else "decomposition + calibrated fit"):
            if mod.kind == "embedding_bag":
                new = TTMEmbeddingBag.from_embedding_bag(mod.dense, rank=None, layout=mod.layout,
                                                         init=init, generator=gen)
            elif mod.kind == "embedding":
                new = TTMEmbedding.from_embedding(mod.dense, rank=None, layout=mod.layout, init=init,
                                                  generator=gen)
            elif mod.kind == "experts":
                new = TTExperts.from_experts(mod.dense, rank=None, layout=mod.layout, init=init,
                                             generator=gen)
            else:
                new = TTLinear.from_linear(mod.dense, rank=None, layout=mod.layout, init=init,
                                           generator=gen)
                _share_bias(new, mod.dense)
            if stats is not None:
                _fit_to_calibration(program, name, mod, new, stats)
            new.train(mod.training)
            built[name] = new
            gm.set_submodule(name, new)
        for name, mod in pending.items():
            if mod.tied_to is None:
                continue
            if mod.tied_to not in built:
                raise ValueError(f"{name} is tied to {mod.tied_to}, which is not being decomposed")
            if mod.kind == "alias":  # another lookup of the same table: the same module
                gm.set_submodule(name, built[mod.tied_to])
                continue
            head = TTMTiedLinear(built[mod.tied_to], bias=mod.dense.bias is not None)
            # prefer="speed": inference multiplies by the merged table (a dense head's cost);
            # "size": never hold the merged table
            head.merge_in_inference = program.options.prefer == "speed"
            _share_bias(head, mod.dense)
            gm.set_submodule(name, head)
        return program


def _fit_to_calibration(program: Program, name: str, pending: PendingLayer, layer: torch.nn.Module,
                        stats) -> None:
    """Refit ``layer``'s cores to what ``pending.dense`` does on the calibration inputs."""
    if pending.kind in ("embedding", "embedding_bag"):
        counts = stats.counts_of(pending.dense.weight)
        if counts is None:
            return
        seed = program.options.seed if program.options.seed is not None else 0
        result = fit_table_cores(pending.dense.weight, layer.layout, counts, seed=seed, start=list(layer.cores))
    elif pending.kind in ("linear", "conv1d"):
        moment = stats.moment_of(pending.dense.weight)
        if moment is None:
            return
        weight = linear_weight_of(pending.dense)
        result = fit_linear_cores(weight, layer.layout, moment, start=list(layer.cores),
                                  root=stats.moments[id(pending.dense.weight)].normalized_root(RIDGE))
        held = stats.held_out_moment_of(pending.dense.weight)
        summary = program.calibration_summary.setdefault(name, {})
        summary.update(rows=stats.rows_of(pending.dense.weight), features=int(weight.shape[1]))
        if held is not None:  # the fit judged on rows it was not fit to
            summary.update(held_out_error=output_error(weight, result.cores, layer.layout, held))
    else:  # experts: TT-SVD only
        return
    dtype = layer.cores[0].dtype
    layer.set_cores([c.to(dtype) for c in result.cores])
    summary = program.calibration_summary.setdefault(name, {})
    summary.update(svd_error=result.svd_error, fit_error=result.fit_error)


def _share_bias(layer, dense) -> None:
    """The dense layer's own bias ``Parameter`` becomes the layer's: a bias the
    model shares elsewhere (HF's ``decoder.bias is predictions.bias``) stays one
    parameter, trained and counted once."""
    if isinstance(getattr(dense, "bias", None), torch.nn.Parameter):
        layer.bias = dense.bias


def _pending(program: Program) -> dict[str, PendingLayer]:
    """``name -> PendingLayer`` of every layer still awaiting its cores."""
    out: dict[str, PendingLayer] = {}
    for node, mod in program.modules():
        if isinstance(mod, PendingLayer):
            out.setdefault(node.target, mod)
    return out
