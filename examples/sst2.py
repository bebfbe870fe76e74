"""SST-2 from scratch: dense vs tncompile (early stage) vs rank-adapted (late stage).

    python examples/sst2.py --data ../shared/data/sst2          # ~25 min on 2 cores (writes runs/sst2/)
    python examples/sst2.py --data ../shared/data/sst2 --quick  # ~30 s smoke run

A 4-layer transformer classifier (d_model 256, 4 heads, d_ff 1024, BERT's
30,522-token vocabulary, 64 tokens) is trained three ways from the same
initial weights and the same batches:

1. **dense**: the plain model, AdamW, ``--dense-steps`` steps;
2. **early**: ``tncompile.compile(model, target_ratio=0.05)`` (20x smaller),
   trained ``--early-steps`` steps in CoMERA's early stage (l1 on the rank
   gates, l2 on the cores; switched-off ranks are cut every 100 steps);
3. **late**: the same run continued ``--late-steps`` steps in the late stage,
   aiming at a further ``--late-factor`` x smaller model (``--schedule budget``,
   the default, ends at or below it; ``--schedule comera`` is the paper's rule).

Dev accuracy, whole-model ratio and the train-step time at a fixed
32 x 64 batch (dense / after early / after late, interleaved in one run) go to
``runs/sst2/sst2.json`` (``--out`` to change; the README's table used
``--out benchmarks/results``); the rank evolution to ``sst2_ranks.png``.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import tncompile
from tncompile.runtime.kernels.cpu_allocator import retain_freed_memory
from tncompile.testing import SixEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import DATA_ENV, data_dir, out_dir  # noqa: E402
from demo import accuracy, batches, collate, load_sst2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 64
CONFIG = dict(vocab_size=30522, d_model=256, n_layers=4, n_heads=4, d_ff=1024, max_len=MAX_LEN,
              num_classes=2, dropout=0.1)


def warmup(optimizer, steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / steps))


def train_dense(model, stream, steps: int, lr: float, warmup_steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = warmup(opt, warmup_steps)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="dense", unit="step", dynamic_ncols=True)
    for _ in bar:
        x, y = next(stream)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{statistics.fmean(losses[-50:]):.3f}", refresh=False)
    return losses


def step_times(models: dict, batch, rounds: int, steps_per_round: int) -> dict[str, float]:
    """Median train-step time (forward, backward, AdamW) of each model at one
    fixed batch, interleaved round-robin so that machine noise hits all alike."""
    x, y = batch
    runs = {}
    for name, model in models.items():
        model = copy.deepcopy(model).train()
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-6))
    times: dict[str, list[float]] = {n: [] for n in models}
    for r in range(rounds + 1):
        order = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
        for name in order:
            model, opt = runs[name]
            for _ in range(steps_per_round):
                t = time.perf_counter()
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if r:  # round 0 warms up (plans, allocator)
                    times[name].append(time.perf_counter() - t)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=data_dir("sst2"), help=f"SST-2 folder (default: ${DATA_ENV}/sst2)")
    ap.add_argument("--dense-steps", type=int, default=2000)
    ap.add_argument("--early-steps", type=int, default=2000)
    ap.add_argument("--late-steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW (1e-3 diverges for this post-norm model)")
    ap.add_argument("--gate-lr", type=float, default=1e-2)
    ap.add_argument("--target-ratio", type=float, default=0.05, help="compile size (whole model)")
    ap.add_argument("--late-factor", type=float, default=4.0, help="late stage: this much smaller again")
    ap.add_argument("--schedule", choices=("budget", "comera"), default="budget",
                    help="late-stage rule: 'budget' (tncompile's default: cuts fall to the target, then recovery "
                         "steps) or 'comera' (the paper's loss-trading rule)")
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test): 500 rows, 12 steps each")
    ap.add_argument("--out", default=out_dir("sst2"),
                    help="output folder (the README's figures: --out benchmarks/results)")
    args = ap.parse_args()
    if args.quick:
        args.dense_steps = args.early_steps = args.late_steps = 12
    retain_freed_memory()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    data = Path(args.data)
    train = load_sst2(data, "train", max_rows=500 if args.quick else None, max_len=MAX_LEN)
    dev = load_sst2(data, "dev", max_len=MAX_LEN)
    print(f"SST-2: {len(train[0]):,} train / {len(dev[0])} dev sentences, {torch.get_num_threads()} threads")

    torch.manual_seed(0)
    initial = SixEncoder(**CONFIG)
    dense = copy.deepcopy(initial)
    warm = max(1, min(200, args.dense_steps // 10))

    # ---------------------------------------------------------------- dense
    t0 = time.perf_counter()
    dense_losses = train_dense(dense, batches(*train, args.batch_size, seed=0), args.dense_steps, args.lr, warm)
    dense_minutes = (time.perf_counter() - t0) / 60
    dense_acc = accuracy(dense, *dev)
    print(f"dense: dev accuracy {dense_acc:.4f} ({dense_minutes:.1f} min)")

    # ---------------------------------------------------------------- compiled
    compiled = tncompile.compile(initial, target_ratio=args.target_ratio, init="random",
                                 batch_sizes=[args.batch_size * MAX_LEN])
    compiled_ratio = compiled.ratio
    print(compiled.report())
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=args.lr, gate_lr=args.gate_lr, weight_decay=0.01))
    sched = warmup(opt, warm)
    ctl = tncompile.RankController(compiled, opt, target_ratio=compiled_ratio / args.late_factor,
                                   truncate_every=100, schedule=args.schedule)
    stream = batches(*train, args.batch_size, seed=0)

    def dev_accuracy(model):
        return {"dev_acc": accuracy(model, *dev)}

    t0 = time.perf_counter()
    history = tncompile.fit(compiled, stream, F.cross_entropy, opt, ctl, early_steps=args.early_steps,
                            late_steps=0, eval_fn=dev_accuracy, scheduler=sched)
    early_minutes = (time.perf_counter() - t0) / 60
    early_acc, early_ratio = history.evals[-1][1]["dev_acc"], compiled.ratio
    after_early = copy.deepcopy(compiled)
    print(f"early: dev accuracy {early_acc:.4f}, ratio {early_ratio:.5f} ({1 / early_ratio:.1f}x smaller)")

    # the late stage aims a further late_factor x below where the early stage ended
    ctl.target_ratio = early_ratio / args.late_factor
    t0 = time.perf_counter()
    # fit continues at the controller's step, skipping the batches it has seen: give it the stream anew
    stream = batches(*train, args.batch_size, seed=0)
    history = tncompile.fit(compiled, stream, F.cross_entropy, opt, ctl, early_steps=args.early_steps,
                            late_steps=args.late_steps, eval_fn=dev_accuracy,
                            eval_every=max(1, args.late_steps // 4), history=history, scheduler=sched)
    late_minutes = (time.perf_counter() - t0) / 60
    late_acc, late_ratio = history.evals[-1][1]["dev_acc"], compiled.ratio
    print(f"late: dev accuracy {late_acc:.4f}, ratio {late_ratio:.6f} ({1 / late_ratio:.1f}x smaller)")

    # ---------------------------------------------------------------- timing
    probe = collate(train[0][: args.batch_size], train[1][: args.batch_size])
    probe = (torch.nn.functional.pad(probe[0], (0, MAX_LEN - probe[0].shape[1])), probe[1])
    times = step_times({"dense": dense, "early": after_early, "late": compiled}, probe,
                       rounds=1 if args.quick else 5, steps_per_round=3)

    rows = [
        {"model": "dense", "dev_acc": dense_acc, "ratio": 1.0, "params": tncompile.ir.program.count_params(dense),
         "step_ms": times["dense"], "train_minutes": dense_minutes, "steps": args.dense_steps},
        {"model": "compiled, early stage", "dev_acc": early_acc, "ratio": early_ratio,
         "params": round(early_ratio * compiled.program.original_params), "step_ms": times["early"],
         "train_minutes": early_minutes, "steps": args.early_steps},
        {"model": "compiled, late stage", "dev_acc": late_acc, "ratio": late_ratio,
         "params": round(late_ratio * compiled.program.original_params), "step_ms": times["late"],
         "train_minutes": late_minutes, "steps": args.late_steps},
    ]
    print(f"\n| model | dev acc | ratio | x smaller | step ms (32x{MAX_LEN}) | speed-up vs dense |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dev_acc']:.4f} | {r['ratio']:.5f} | {1 / r['ratio']:.1f} | "
              f"{r['step_ms']:.1f} | {times['dense'] / r['step_ms']:.2f}x |")
    print(f"late vs early step time: {times['early'] / times['late']:.2f}x faster after truncation")

    tag = "sst2-quick" if args.quick else "sst2"
    png = out / f"{tag}_ranks.png"
    history.plot(png, title=f"SST-2: rank evolution (early {args.early_steps} + late {args.late_steps} steps)")
    result = {"benchmark": "sst2", "config": CONFIG, "args": vars(args), "compiled_ratio": compiled_ratio,
              "rows": rows, "late_vs_early_speedup": times["early"] / times["late"],
              "final_ranks": {k: list(v) for k, v in ctl.ranks().items()},
              "dense_loss_tail": statistics.fmean(dense_losses[-100:]),
              "history": {"step": history.step[::10], "task_loss": history.task_loss[::10],
                          "ratio": history.ratio[::10], "events": history.events, "evals": history.evals},
              "torch": torch.__version__, "threads": torch.get_num_threads(), "plot": str(png)}
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / f'{tag}.json'} and {png}")


if __name__ == "__main__":
    main()
