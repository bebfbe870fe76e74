"""``choose_cores``: each TT linear's network chosen by measurement among 2-, 4- and
6-core layouts (1, 2 or 3 cores a side; 2 cores is the low-rank ``W = A B``).

``compile(linear_cores="measured")`` puts this pass right after ``assign_ranks``. For each
linear network, every layout the layer's shape allows is given the largest uniform rank
within the parameters ``assign_ranks`` gave the layer (its share of the budget), built on
the model's device in the model's dtype, and its training step's forward + backward is
timed on the rows the layer was planned for (median of ``tuning.CORE_CHOICE_REPEATS`` runs
after a warm-up; once a process per layout, rows, device and dtype). The fastest is kept. With calibration data (``compile(calibration=...)``)
each candidate is also fit to the layer's outputs (:func:`~tncompile.calibration.layer_fit.fit_linear_cores`)
and the one with the lowest held-out output error among those within
``tuning.CORE_CHOICE_TIME_SLACK`` of the fastest is kept.

``program.core_choices`` keeps every candidate's cores, ranks, parameters, measured
milliseconds (and error); the report prints the choice per layer. A loaded model's
layouts come from its file: the pass then does nothing.
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import tuning
from ..calibration.layer_fit import RIDGE, fit_linear_cores, output_error
from ..formats.factorization import tt_from_linear_weight
from ..formats.layout import TTLayout
from ..ir.program import CompileContext, Program
from ..runtime.layers import TTLinear
from ..runtime.layers.module_kinds import linear_weight_of
from .infra.base import Pass, register_pass
from .infra.pending import PendingLayer
from .infra.progress import progress

__all__ = ["ChooseCores", "CORE_CHOICES"]

#: cores a side of the candidates: 2-, 4- and 6-core networks
CORE_CHOICES = (1, 2, 3)
#: ``(modes, ranks, rows, device, dtype) -> ms`` measured in this process: every compile of
#: one shape chooses alike (another compile of the same model, each seed of a study)
_MEASURED: dict[tuple, float] = {}


@register_pass
class ChooseCores(Pass):
    """Per TT linear: the fastest of its 2-, 4- and 6-core layouts within its parameter
    share, measured on the device (with calibration: the best held-out fit among the
    nearly fastest)."""

    name = "choose_cores"

    def requires(self, program: Program) -> None:
        missing = [n for n, m in _linears(program).items() if m.layout.ranks is None]
        if missing:
            raise ValueError(f"layers {missing[:3]} have no ranks; run assign_ranks before choose_cores")

    def run(self, program: Program, ctx: CompileContext) -> Program:
        if ctx.decisions is not None:   # tncompile.load: the file's layouts stand
            return program
        layers = _linears(program)
        rows = program.speed_estimates.get("rows", {})
        stats = ctx.calibration
        choices: dict[str, dict] = {}
        measured = _MEASURED   # layers of one shape and budget are timed once a process
        for name, pending in progress(list(layers.items()), "choosing each linear's cores"):
            budget = pending.layout.num_params()
            n_rows = rows.get(name, tuning.ASSUMED_ROWS)
            device, dtype = pending.weight.device, pending.weight.dtype
            candidates = []
            for layout in candidate_layouts(pending.layout, budget):
                key = (layout.in_modes, layout.out_modes, tuple(layout.ranks), n_rows, str(device), dtype)
                if key not in measured:
                    measured[key] = step_ms(layout, n_rows, device, dtype, bias=getattr(pending.dense, "bias", None)
                                            is not None)
                entry = {"cores": len(layout.core_shapes()), "ranks": list(layout.ranks),
                         "params": layout.num_params(), "ms": measured[key], "layout": layout}
                if stats is not None:
                    entry["held_out_error"] = _held_out_error(stats, pending, layout)
                candidates.append(entry)
            if not candidates:
                continue
            chosen = _pick(candidates)
            pending.layout = chosen["layout"]
            choices[name] = {"rows": n_rows, "chosen": chosen["cores"],
                             "candidates": [{k: v for k, v in c.items() if k != "layout"} for c in candidates]}
            program.notes[name] = "; ".join(filter(None, [program.notes.get(name, ""), _describe(choices[name])]))
        program.core_choices = choices
        return program


def candidate_layouts(assigned: TTLayout, budget: int) -> list[TTLayout]:
    """Every 2-, 4- and 6-core layout of ``assigned``'s shape at the largest uniform rank
    whose parameters stay within ``budget`` (the assigned layout itself for its own core
    count); a layout whose rank 1 is over the budget is left out."""
    out = []
    per_side = len(assigned.in_modes)
    for cores in CORE_CHOICES:
        if cores == per_side:
            out.append(assigned)
            continue
        try:
            base = TTLayout.for_shape(assigned.in_features, assigned.out_features, cores, experts=assigned.experts)
        except ValueError:
            continue
        if base.with_ranks(1).num_params() <= budget:
            out.append(base.with_ranks(base.largest_rank_within(budget)))
    return sorted(out, key=lambda lay: len(lay.core_shapes()))


def step_ms(layout: TTLayout, rows: int, device: torch.device, dtype: torch.dtype, bias: bool = False) -> float:
    """Milliseconds of one forward + backward of a ``layout`` network over ``rows`` rows (its
    input's gradient and its cores'): the median of ``tuning.CORE_CHOICE_REPEATS`` runs after
    one warm-up (the first call also races the layer's ways)."""
    layer = TTLinear(layout, bias=bias, device=device, dtype=dtype)
    with torch.no_grad():
        layer.reset_parameters()
    x = torch.randn(rows, layout.in_features, device=device, dtype=dtype, requires_grad=True)
    params = [p for p in layer.parameters() if p.requires_grad]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once() -> float:
        start = time.perf_counter()
        out = layer(x)
        torch.autograd.grad(out, [x, *params], torch.ones_like(out))
        sync()
        return time.perf_counter() - start
    once()
    return 1e3 * statistics.median(once() for _ in range(tuning.CORE_CHOICE_REPEATS))


def _held_out_error(stats, pending: PendingLayer, layout: TTLayout) -> float | None:
    """The calibrated fit's relative output error on held-out calibration rows (``None``
    without a held-out part)."""
    moment = stats.moment_of(pending.dense.weight)
    held = stats.held_out_moment_of(pending.dense.weight)
    if moment is None or held is None:
        return None
    weight = linear_weight_of(pending.dense)
    fit = fit_linear_cores(weight, layout, moment, start=tt_from_linear_weight(weight, layout),
                           root=stats.moments[id(pending.dense.weight)].normalized_root(RIDGE))
    return float(output_error(weight, fit.cores, layout, held))


def _pick(candidates: list[dict]) -> dict:
    fastest = min(candidates, key=lambda c: c["ms"])
    errors = [c for c in candidates if c.get("held_out_error") is not None
              and c["ms"] <= tuning.CORE_CHOICE_TIME_SLACK * fastest["ms"]]
    return min(errors, key=lambda c: c["held_out_error"]) if errors else fastest


def _describe(choice: dict) -> str:
    parts = []
    for c in choice["candidates"]:
        error = f", err {c['held_out_error']:.3f}" if c.get("held_out_error") is not None else ""
        mark = "*" if c["cores"] == choice["chosen"] else ""
        parts.append(f"{mark}{c['cores']} cores r{max(c['ranks'])} {c['ms']:.2f} ms{error}")
    return f"cores by fwd+bwd at {choice['rows']} rows: " + " | ".join(parts)


def _linears(program: Program) -> dict[str, PendingLayer]:
    """``name -> pending TT linear`` (one network per layer: not experts, not tied heads)."""
    out: dict[str, PendingLayer] = {}
    for node, mod in program.modules():
        if isinstance(mod, PendingLayer) and mod.tied_to is None and mod.kind in ("linear", "conv1d") \
                and isinstance(mod.layout, TTLayout) and mod.layout.experts == 1:
            out.setdefault(node.target, mod)
    return out
