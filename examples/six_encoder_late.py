"""The paper's six-encoder in CoMERA's late stage: ranks fall, and so does the step time.

    python examples/six_encoder_late.py --data ../shared/data/sst2     # ~10 min on 2 cores

Compiles the six-encoder (6 layers, d_model 768, 12 heads, d_ff 3072, BERT
vocabulary) to CoMERA's 44.9x-smaller starting point, trains a short early
stage on SST-2, then a late stage aiming ``--late-factor`` x smaller, cutting
switched-off ranks every ``--truncate-every`` steps. Batches are padded to a
fixed ``--seq`` so that step times are comparable along the run.

Writes ````runs/six_encoder_late/six_encoder_late.json`` (ranks, ratio and median
step time at the start and the end) and ``six_encoder_late.png`` (rank
evolution, size, step time and loss over the run).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import tncompile
from tncompile.runtime.kernels.cpu_allocator import retain_freed_memory
from tncompile.testing import six_encoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import DATA_ENV, data_dir, out_dir  # noqa: E402
from demo import batches, load_sst2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAPER_RATIO = 1 / 44.9


def padded(stream, seq: int):
    for x, y in stream:
        yield F.pad(x, (0, seq - x.shape[1])), y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=data_dir("sst2"), help=f"SST-2 folder (default: ${DATA_ENV}/sst2)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--early-steps", type=int, default=100)
    ap.add_argument("--late-steps", type=int, default=500)
    ap.add_argument("--late-factor", type=float, default=4.0)
    ap.add_argument("--truncate-every", type=int, default=25)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--gate-lr", type=float, default=3e-2)
    ap.add_argument("--out", default=out_dir("six_encoder_late"),
                    help="output folder (the README's figures: --out benchmarks/results)")
    args = ap.parse_args()
    retain_freed_memory()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    print(f"loading SST-2 from {args.data} ...", flush=True)
    train = load_sst2(Path(args.data), "train", max_len=args.seq)
    print("compiling the six-encoder to CoMERA's starting size ...", flush=True)
    compiled = tncompile.compile(six_encoder(num_classes=2, max_len=128), target_ratio=PAPER_RATIO,
                                 init="random", batch_sizes=[args.batch_size * args.seq])
    start_ratio, start_ranks = compiled.ratio, {n: list(m.layout.ranks) for n, m in
                                                 compiled.tensorized_modules().items()}
    print(f"compiled: ratio {start_ratio:.5f}; training {args.early_steps} early + {args.late_steps} late steps "
          f"(a progress line every 30 s when not on a terminal)", flush=True)
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=args.lr, gate_lr=args.gate_lr, weight_decay=0.01))
    ctl = tncompile.RankController(compiled, opt, target_ratio=start_ratio / args.late_factor,
                                   truncate_every=args.truncate_every, schedule="comera")  # the paper's rule: the README's figures
    history = tncompile.fit(compiled, padded(batches(*train, args.batch_size, seed=0), args.seq), F.cross_entropy,
                            opt, ctl, early_steps=args.early_steps, late_steps=args.late_steps, log_every=5)
    total = args.early_steps + args.late_steps
    window = max(10, args.truncate_every)
    first_cut = next((e["step"] for e in history.events if e["kind"] == "truncation"), total)
    before = history.median_step_ms(2, min(first_cut, 2 + window) + 1)  # step 1 plans and warms up
    after = history.median_step_ms(total - window + 1)
    mean_rank = lambda ranks: sum(sum(r) / len(r) for r in ranks.values()) / len(ranks)  # noqa: E731
    end_ranks = {n: list(r) for n, r in ctl.ranks().items()}
    result = {
        "benchmark": "six_encoder_late", "args": vars(args),
        "ratio": {"start": start_ratio, "end": compiled.ratio},
        "mean_rank": {"start": mean_rank({n: start_ranks[n] for n in end_ranks}), "end": mean_rank(end_ranks)},
        "step_ms": {"start": before, "end": after}, "speedup": before / after,
        "ranks_start": start_ranks, "ranks_end": end_ranks,
        "history": {"step": history.step, "ratio": history.ratio, "step_ms": history.step_ms,
                    "task_loss": history.task_loss, "events": history.events},
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    png = out / "six_encoder_late.png"
    history.plot(png, title=f"six-encoder, SST-2, batch {args.batch_size}x{args.seq}: "
                            f"early {args.early_steps} + late {args.late_steps} steps")
    (out / "six_encoder_late.json").write_text(json.dumps(result, indent=1))
    print(f"ratio {start_ratio:.5f} -> {compiled.ratio:.5f} ({start_ratio / compiled.ratio:.1f}x smaller), "
          f"mean rank {result['mean_rank']['start']:.1f} -> {result['mean_rank']['end']:.1f}, "
          f"step {before:.0f} ms -> {after:.0f} ms ({before / after:.2f}x faster)")
    print(f"wrote {out / 'six_encoder_late.json'} and {png}")


if __name__ == "__main__":
    main()
