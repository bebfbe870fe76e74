"""Re-measure this device's speed and check the ``prefer="speed"`` cost model against timed steps.

    python benchmarks/bench_device_speed.py [--device cuda] [--reps 15]

Re-measures the :class:`tncompile.planning.DeviceSpeed` that ``compile(prefer="speed")``
plans with (GEMM throughput, copy bandwidth, the fixed cost per TT kernel and per dense
linear step) and writes it to the cache every later ``compile`` reads. Then times one
training step (forward, ``backward(dy)`` into input and weights) of TT linears and their
dense layers -- 128->128, 128->512, 512->128 and 768->3072, ranks 1-30, over 16, 256 and
2048 rows -- interleaved, next to the model's estimate of each. Reported: the estimate
over the measured time per point, and whether the model's choice (a network only
within ``tuning.SPEED_MARGIN`` of dense) ever picked a network that measured slower.
Writes ``benchmarks/results/device_speed.json`` (``device_speed_cuda.json`` on a GPU)
and a PNG of estimated against measured times, with the host's measured bandwidth and
GEMM throughput.
"""
from __future__ import annotations


import torch
from tqdm import tqdm

from tncompile import tuning
from tncompile.formats.layout import TTLayout
from tncompile.planning import SearchPlanner, device_speed
from tncompile.runtime import TTLinear

from common import RESULTS, interleaved_ms, machine, parser, save_figure, write_json

SHAPES = [(128, 128), (128, 512), (512, 128), (768, 3072)]
ROWS = [16, 256, 2048]
RANKS = [1, 4, 16, 30]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    device = torch.device(args.device)
    speed = device_speed(device, remeasure=True)
    print(speed, flush=True)
    points = []
    cases = [(s, r) for r in ROWS for s in SHAPES]
    for (fin, fout), rows in tqdm(cases, desc="timing steps"):
        x = torch.randn(rows, fin, device=device, requires_grad=True)
        dy = torch.randn(rows, fout, device=device)
        dense = torch.nn.Linear(fin, fout).to(device)
        fns = {"dense": lambda: dense(x).backward(dy)}
        layouts = {}
        for r in RANKS:
            lay = TTLayout.for_shape(fin, fout, 3).with_ranks(r)
            layer = TTLinear(lay).to(device)
            layouts[r] = lay
            fns[r] = (lambda m=layer: m(x).backward(dy))
        ms = interleaved_ms(fns, reps=args.reps, warmup=3, device=device)
        dense_est = 1e3 * speed.dense_step_seconds(rows, fin, fout)
        for r, lay in layouts.items():
            plan = SearchPlanner().plan_contraction(lay, False, rows)
            est = 1e3 * speed.network_step_seconds(plan, fin, fout)
            chose_tt = est <= tuning.SPEED_MARGIN * dense_est
            points.append({"in": fin, "out": fout, "rows": rows, "rank": r,
                           "tt_ms": round(ms[r], 4), "tt_est_ms": round(est, 4),
                           "dense_ms": round(ms["dense"], 4), "dense_est_ms": round(dense_est, 4),
                           "model_picks_tt": chose_tt, "tt_faster": ms[r] <= ms["dense"],
                           "picked_tt_but_slower_by": round(ms[r] / ms["dense"], 3)
                           if chose_tt and ms[r] > ms["dense"] else None})
    tt_ratio = [p["tt_est_ms"] / p["tt_ms"] for p in points]
    dense_ratio = sorted({(p["in"], p["out"], p["rows"]): p["dense_est_ms"] / p["dense_ms"] for p in points}.values())
    wrong = [p for p in points if p["picked_tt_but_slower_by"] is not None]
    missed = [p for p in points if not p["model_picks_tt"] and p["tt_ms"] < tuning.SPEED_MARGIN * p["dense_ms"]]
    summary = {"tt_estimate_over_measured": [round(min(tt_ratio), 2), round(max(tt_ratio), 2)],
               "dense_estimate_over_measured": [round(dense_ratio[0], 2), round(dense_ratio[-1], 2)],
               "points": len(points), "picked_tt_but_slower": len(wrong),
               "worst_pick": max((p["picked_tt_but_slower_by"] for p in wrong), default=None),
               "kept_dense_though_tt_15pct_faster": len(missed), "speed_margin": tuning.SPEED_MARGIN}
    for k, v in summary.items():
        print(f"{k:36s} {v}")
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    png = _plot(points, RESULTS / f"device_speed{suffix}.png")
    path = write_json(f"device_speed{suffix}.json", {
        "benchmark": "device_speed", "device_speed": speed.as_dict(), "summary": summary, "points": points,
        "plot": png.name, **machine(device)})
    print(f"wrote {path} and {png}")


def _plot(points: list[dict], path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.scatter([p["tt_ms"] for p in points], [p["tt_est_ms"] for p in points], s=14, label="TT step")
    dense = {(p["in"], p["out"], p["rows"]): p for p in points}.values()
    ax.scatter([p["dense_ms"] for p in dense], [p["dense_est_ms"] for p in dense], s=14, marker="s", label="dense step")
    lo = min(min(p["tt_ms"], p["tt_est_ms"], p["dense_est_ms"]) for p in points) / 1.5
    hi = max(max(p["dense_ms"], p["dense_est_ms"]) for p in points) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="estimate = measured")
    ax.set(xscale="log", yscale="log", xlabel="measured ms per training step", ylabel="estimated ms",
           title="prefer='speed' cost model vs timed steps")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    save_figure(fig, path)
    return path


if __name__ == "__main__":
    main()
