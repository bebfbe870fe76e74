"""One dictionary describing a layer, shared by the dumps and the report."""
from __future__ import annotations

from typing import Any

from torch import nn

from .. import tuning
from ..formats.indices import BATCH, planner_problem
from ..runtime.kernels.plans import ContractionPlan
from ..runtime.layers import TTMTiedLinear, tied_merge_macs
from .contraction import plan_contraction
from .lookup import per_id_macs, plan_lookup

__all__ = ["layer_info", "fmt_count", "ranks_str"]


def fmt_count(n: float) -> str:
    """``1234567 -> '1.23M'``."""
    n = float(n)
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def ranks_str(ranks) -> str:
    if ranks is None:
        return "pending"
    if len(set(ranks)) == 1:
        return f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]} (x{len(ranks)})"
    return ",".join(map(str, ranks))


def layer_info(module: nn.Module) -> dict[str, Any] | None:
    """Format, layout, sizes and per-token FLOPs of a tensorized or pending layer;
    ``None`` for any other module. A planned TT layer's FLOPs are per row of its
    largest planned row count (merging cores is shared by the rows); otherwise
    those of the order planned for one token."""
    layout = getattr(module, "layout", None)
    if layout is None or not hasattr(layout, "format"):
        return None
    pending = getattr(module, "is_pending", False)  # a PendingLayer (tensorize's placeholder)
    tied = (module.kind == "tied") if pending else isinstance(module, TTMTiedLinear)
    info: dict[str, Any] = {
        "format": layout.format + ("-tied" if tied else "") + (f"x{layout.copies}" if layout.copies > 1 else ""),
        "modes": layout.modes_str(),
        "ranks": list(layout.ranks) if layout.ranks is not None else None,
        "pending": bool(pending),
        "dense_params": layout.dense_params,
        "tn_params": layout.num_params() if layout.ranks is not None else None,
    }
    if tied:
        info["tn_params"] = 0
        if pending:
            info["tied_to"] = module.tied_to
    if layout.ranks is not None:
        info["ratio"] = layout.num_params() / layout.dense_params
        if layout.format == "TTM" and not tied:
            # one id's product at the split planned for a large batch (table merges amortized)
            info["dense_flops_per_token"] = 0
            info["tn_flops_per_token"] = 2 * per_id_macs(layout, plan_lookup(layout, 4096).split)
        else:
            info["dense_flops_per_token"] = layout.dense_flops(1)
            planned = [p for p in (module.__dict__.get("_plans") or {}).values() if isinstance(p, ContractionPlan)]
            if planned:  # per row of the largest planned row count (the traced rows, or a batch size asked for)
                plan = max(planned, key=lambda p: p.rows)
                macs = plan.fwd_flops
                if tied and not pending:  # the head multiplies by the merged table when that is cheaper
                    macs = min(macs, tied_merge_macs(layout, plan.rows))
                info["tn_flops_per_token"] = 2 * macs / max(plan.rows, 1)
            else:  # not planned yet (no shapes traced): per row over the rows compile assumed
                rows = tuning.ASSUMED_ROWS
                inputs, output, sizes = planner_problem(layout, transpose=bool(tied))
                info["tn_flops_per_token"] = 2 * plan_contraction(inputs, output, {**sizes, BATCH: rows}).fwd_flops / rows
    return info
