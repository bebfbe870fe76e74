"""``CompiledModel.report()``: per-layer sizes and costs as a table."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from ..formats.layout import TTLayout
from ..planning.speed_model import layer_step_seconds, lookup_step_seconds, merge_family
from ..planning.layer_info import fmt_count, layer_info, ranks_str
from .host_time import LayerTime, MeasuredSummary, time_cells

__all__ = ["Report", "LayerRow", "SpeedSummary", "build_report", "speed_summary"]


@dataclass
class LayerRow:
    """One compressible layer of the model."""

    name: str
    format: str            # "TT", "TTM", "TTM-tied" or "dense"
    modes: str
    ranks: list[int] | None
    dense_params: int
    params: int            # parameters it holds now (0 for a tied head)
    flops_dense: int | None = None   # per token
    flops_now: int | None = None
    note: str = ""
    calibration: dict | None = None
    #: estimated seconds per row (per id: a TTM embedding) of a training step (dense layer,
    #: network now) over the rows
    #: ``prefer="speed"`` planned with (:class:`~tncompile.planning.DeviceSpeed`)
    time_dense: float | None = None
    time_now: float | None = None  # relative output errors on calibration data (compile(calibration=...))
    #: measured forward + backward on the layer's input in the model (``report(inputs)``)
    measured: LayerTime | None = None
    #: the way its last eager call ran (:class:`~tncompile.runtime.ways.linear.LinearWay`)
    ran_as: str = ""

    @property
    def ratio(self) -> float:
        return self.params / self.dense_params if self.dense_params else 1.0


@dataclass
class Report:
    """What compilation did. ``str(report)`` is a table; fields are data."""

    rows: list[LayerRow]
    original_params: int
    params: int
    other_params: int = 0
    history: list = field(default_factory=list)
    speed_device: str = ""
    #: the estimated training step of the compressed layers (TT linears, TTM embeddings)
    #: against their dense layers (:func:`speed_summary`), ``None`` where no layer was timed
    speed: "SpeedSummary | None" = None
    #: the measured layer times together (``report(inputs)``), ``None`` when not measured
    measured: MeasuredSummary | None = None
    #: process-wide settings tncompile made that shaped those times (``report(inputs)`` on CPU:
    #: the allocator)
    process_notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.params / self.original_params

    def as_dicts(self) -> list[dict]:
        return [dict(vars(r), ratio=r.ratio, measured=asdict(r.measured) if r.measured else None) for r in self.rows]

    def __str__(self) -> str:
        calibrated = any(r.calibration for r in self.rows)
        ran = any(r.ran_as for r in self.rows)
        timed = any(r.time_now is not None for r in self.rows)
        measured = self.measured is not None
        wall = measured and self.measured.shows_wall
        head = ("layer", "format", "modes", "ranks", "dense", "compiled", "ratio", "flops/tok",
                *(("step/tok (est.)",) if timed else ()),
                *(("host (dense)",) if measured else ()), *(("wall (dense)",) if wall else ()),
                *(("calib. error",) if calibrated else ()), *(("ran as",) if ran else ()), "note")
        body = []
        for r in self.rows:
            flops = (f"{fmt_count(r.flops_dense)}->{fmt_count(r.flops_now)}"
                     if r.flops_dense and r.flops_now is not None else
                     (f"lookup {fmt_count(r.flops_now)}" if r.flops_now else ""))
            extra = ((f"{_ns(r.time_dense)}->{_ns(r.time_now)}" if r.time_now is not None else "",) if timed else ()) + \
                (time_cells(r.measured, wall) if measured else ()) + \
                ((_calibration_cell(r.calibration),) if calibrated else ()) + ((r.ran_as,) if ran else ())
            body.append((r.name, r.format, r.modes, ranks_str(r.ranks) if r.ranks else "",
                         f"{r.dense_params:,}", f"{r.params:,}", f"{r.ratio:.2%}", flops, *extra, r.note))
        body.append(("(rest: norms, biases, dense layers)", "", "", "", "", f"{self.other_params:,}", "", "",
                     *(("",) if timed else ()), *(("",) * (measured + wall)), *(("",) if calibrated else ()),
                     *(("",) if ran else ()), ""))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]

        def line(cells):
            return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

        sep = "-" * min(sum(widths) + 2 * len(widths), 160)
        out = [line(head), sep, *map(line, body), sep,
               f"total: {self.original_params:,} -> {self.params:,} params  "
               f"ratio {self.ratio:.4f}  ({self.original_params / max(self.params, 1):.1f}x smaller)"]
        if ran:
            out.append("ran as: how each TT linear and TTM embedding's last eager call ran, or the fused block it ran in "
                       "(tncompile.runtime.ways: linear.choose(layer, x), lookup.choose(layer, ids), "
                       "feed_forward.choose and siblings.choose say it for any input)")
        if timed:
            out.append(f"step/tok (est.): a training step's time per row, dense -> network, on {self.speed_device} "
                       "at the rows each layer was planned for")
        if self.speed is not None:
            out.extend(self.speed.lines())
        if measured:
            out.extend(self.measured.lines())
        out.extend(self.process_notes)
        if calibrated:
            out.append("calib. error: relative output error on the calibration data -- est.: rank allocation's "
                       "estimate at the chosen rank; TT-SVD's -> after the calibrated fit (on the rows it was fit "
                       "to); held-out: the fit on calibration rows held out from it (what new inputs see)")
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))


@dataclass(frozen=True)
class SpeedSummary:
    """What ``prefer="speed"``'s cost model estimates for the model's TT linears and TTM
    embeddings, each over the rows (ids) it was traced with, on one device.

    Attributes
    ----------
    device : str
        The :class:`~tncompile.planning.DeviceSpeed` the estimates are for.
    layers : int
        How many compressed layers were estimated.
    seconds, dense_seconds : float
        One training step of all of them, as compiled and as their dense layers.
    slower : tuple of str
        The layers estimated slower than their dense layer (names in the model).
    ratio_without_slower : float
        The model's ratio with those kept dense: ``compile(..., target_ratio=that,
        exclude_modules=list(slower))`` gives a model whose every compressed layer is
        estimated no slower than dense.
    """

    device: str
    layers: int
    seconds: float
    dense_seconds: float
    slower: tuple[str, ...]
    ratio_without_slower: float

    @property
    def speedup(self) -> float:
        """Estimated dense step time over compiled step time of these layers (> 1: faster)."""
        return self.dense_seconds / self.seconds

    def lines(self) -> list[str]:
        out = [f"speed (est., {self.device}): the {self.layers} compressed layers' training step "
               f"{_ms(self.seconds)} vs {_ms(self.dense_seconds)} as dense layers: {self.speedup:.2f}x dense"]
        if self.slower:
            names = ", ".join(repr(n) for n in self.slower[:4]) + (", ..." if len(self.slower) > 4 else "")
            out.append(f"  {len(self.slower)} of them estimated slower than dense (see notes); keeping them dense "
                       f"(exclude_modules=report.speed.slower: [{names}]) gives ratio "
                       f"{self.ratio_without_slower:.4f}")
        return out


def speed_summary(rows: list[LayerRow], program, params: int) -> SpeedSummary | None:
    """:class:`SpeedSummary` from the timed rows (``time_dense`` / ``time_now`` per row
    times the rows each layer was planned for); ``None`` without timed rows."""
    est = program.speed_estimates
    planned = _planned_rows(est)
    timed = [r for r in rows if r.time_now is not None and r.name in planned]
    if not timed:
        return None
    slower = tuple(r.name for r in timed if r.time_now > r.time_dense)
    back = sum(r.dense_params - r.params for r in timed if r.name in slower)
    return SpeedSummary(device=est["speed"].device, layers=len(timed),
                        seconds=sum(r.time_now * planned[r.name] for r in timed),
                        dense_seconds=sum(r.time_dense * planned[r.name] for r in timed),
                        slower=slower, ratio_without_slower=(params + back) / program.original_params)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def _ns(seconds: float) -> str:
    return f"{seconds * 1e9:,.0f}ns"


def _step_times_per_row(program, name: str, layout, sharing: dict) -> tuple[float | None, float | None]:
    """Estimated training-step seconds per row (dense, network) of a planned TT linear,
    or per id of a TTM embedding; ``sharing``: TT linears per :func:`merge_family` (they
    merge their cores in one batch, :mod:`tncompile.runtime.layers.factor_groups`)."""
    est = program.speed_estimates
    fmt = getattr(layout, "format", None)
    rows = _planned_rows(est).get(name)
    if rows is None or fmt not in ("TT", "TTM") or layout.ranks is None:
        return None, None
    if fmt == "TT":
        network, dense = layer_step_seconds(layout, rows, est["speed"], sharing=sharing.get(merge_family(layout), 1))
    else:
        network, dense = lookup_step_seconds(layout, rows, est["speed"], sparse=name in est.get("sparse_tables", ()))
    return dense / rows, network / rows


def _planned_rows(est: dict) -> dict[str, int]:
    """Rows each TT linear, ids each TTM embedding was judged at."""
    return {**est.get("rows", {}), **est.get("ids", {})}


def _calibration_cell(errors: dict | None) -> str:
    if not errors:
        return ""
    parts = []
    if "estimated_error" in errors:
        parts.append(f"est. {errors['estimated_error']:.3g}")
    if "svd_error" in errors:
        parts.append(f"{errors['svd_error']:.3g}->{errors['fit_error']:.3g}")
    if "held_out_error" in errors:
        parts.append(f"held-out {errors['held_out_error']:.3g}")
    return ", ".join(parts)


def build_report(program) -> Report:
    """Rows for every tensorized, pending or deliberately dense compressible layer."""
    rows: list[LayerRow] = []
    seen = set()
    counted: set[int] = set()
    first_name: dict[int, str] = {}  # a module called under several names (a shared table's lookups)
    distinct = {id(mod): mod for _, mod in program.modules()}.values()
    sharing = Counter(merge_family(mod.layout) for mod in distinct
                      if isinstance(getattr(mod, "layout", None), TTLayout) and mod.layout.ranks is not None)
    for node, mod in program.modules():
        if node.target in seen:
            continue
        seen.add(node.target)
        info = layer_info(mod)
        if info is not None:
            tn = info["tn_params"] if info["tn_params"] is not None else info["dense_params"]
            shared = first_name.setdefault(id(mod), node.target)
            alias = shared != node.target or getattr(mod, "kind", None) == "alias"
            if alias:
                tn = 0
            rows.append(LayerRow(node.target, info["format"], info["modes"], info["ranks"],
                                 info["dense_params"], tn,
                                 info.get("dense_flops_per_token"), info.get("tn_flops_per_token"),
                                 "; ".join(filter(None, [
                                     "pending" if info["pending"] else "",
                                     f"same network as {getattr(mod, 'tied_to', None) or shared}" if alias else
                                     ("shares cores with its embedding" if "tied" in info["format"] else ""),
                                     program.notes.get(node.target, "")])),
                                 calibration=dict(program.calibration_summary.get(node.target, {}))
                                 or None, ran_as=getattr(getattr(mod, "ran_as", None), "value", ""),
                                 **dict(zip(("time_dense", "time_now"),
                                                     _step_times_per_row(program, node.target, mod.layout,
                                                                         sharing)))))
        elif node.target in program.notes and hasattr(mod, "dense_params"):  # collapsed by rank adaptation
            rows.append(LayerRow(node.target, "removed", "", None, mod.dense_params, 0, note=program.notes[node.target]))
        elif node.target in program.notes:
            w = getattr(mod, "weight", None)
            n = w.numel() if w is not None else 0
            held = 0 if id(w) in counted else n  # a tied weight is counted once
            counted.add(id(w))
            rows.append(LayerRow(node.target, "dense", "", None, n, held, note=program.notes[node.target]))
    total = program.num_params()
    in_rows = sum(r.params for r in rows)
    est = program.speed_estimates
    ids = est.get("ids", {})
    for r in rows:  # the planner notes the linears it judged; lookups are only estimated
        if r.format == "TTM" and r.time_now is not None and r.time_now > r.time_dense and r.name in ids:
            r.note = "; ".join(filter(None, [r.note, (
                f"slower than dense at {ids[r.name]} ids: est. {_us(r.time_now * ids[r.name])} vs "
                f"{_us(r.time_dense * ids[r.name])} a step on {est['speed'].device} (lookups are not kept dense "
                "for speed: exclude_modules does)")]))
    return Report(rows, program.original_params, total, other_params=total - in_rows,
                  history=list(program.history), speed_device=est["speed"].device if "speed" in est else "",
                  speed=speed_summary(rows, program, total))
