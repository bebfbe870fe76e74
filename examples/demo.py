"""tncompile in under three minutes of CPU time on 2 cores: compress, look, time, train, cut, save.

    python examples/demo.py                              # SST-2 when ../shared/data is there
    python examples/demo.py --data ../shared/data/sst2   # the same, explicitly
    python examples/demo.py --data none                  # a generated task (noisy, 3 classes)

1. CoMERA's six-encoder (6 layers, d_model 768, 12 heads, d_ff 3072, vocab 30522,
   sequence 128) compiled to the paper's starting size, 1/44.9 of the parameters; its
   report, whose speed line estimates the compressed layers alone.
2. One whole training step (forward, backward, AdamW) of it and of the dense model at
   ``--measure-batch`` x 128 tokens, interleaved in this process over ``--measure-rounds``
   rounds: the measured step-time ratio of the whole model, beside the estimate.
3. A small encoder (2 layers, d_model 128, BERT's vocabulary) trained dense and compressed
   (``--ratio``, 0.1) from the same initial weights on the same batches, the compressed one
   rank-adaptively (CoMERA's early stage, then a late stage cutting its ranks toward half
   its size, for real). Held-out accuracy with its 95% noise band, printed as a table and
   plotted to ``runs/demo/demo.png`` (``--out``), figures in ``demo.json``. The number of
   steps fits the demo's CPU-time budget (``--cpu-budget``, 150 s) on this host.
4. The cut model saved (``tncompile.save``) and loaded onto a fresh dense model: the same
   outputs. Then the CPU time the demo took, and what to run next.
"""
from __future__ import annotations

import argparse
import csv
import copy
import json
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import tncompile
from tncompile.runtime.kernels.cpu_allocator import retain_freed_memory
from tncompile.testing import six_encoder, small_encoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import DATA_ENV, data_dir, out_dir  # noqa: E402

PAPER_RATIO = 1 / 44.9   # the official CoMERA code's starting ranks give a 44.9x smaller model
SEQ = 128


# ------------------------------------------------------------------ data
def load_sst2(data_dir: Path, split: str, max_rows: int | None = None, max_len: int = SEQ):
    """Token ids and labels of SST-2, tokenized with the BERT vocab next to it
    (truncated to ``max_len`` tokens)."""
    try:
        from tokenizers import BertWordPieceTokenizer
    except ImportError as e:
        raise SystemExit("the SST-2 demo needs `tokenizers`: pip install -e '.[examples]'") from e
    vocab = data_dir.parent / "bert-base-uncased" / "vocab.txt"
    if not (data_dir / f"{split}.tsv").exists() or not vocab.exists():
        raise SystemExit(f"expected {data_dir}/{split}.tsv and {vocab}")
    tok = BertWordPieceTokenizer(str(vocab), lowercase=True)
    tok.enable_truncation(max_len)
    with open(data_dir / f"{split}.tsv", newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    rows = rows[:max_rows] if max_rows else rows
    ids = [e.ids for e in tok.encode_batch([r[0] for r in rows])]
    return ids, [int(r[1]) for r in rows]


def generated_task(n: int, seed: int, noise: float = 0.15):
    """Which of three marker tokens occurs most often in a random sequence -- with clutter
    and noise, so that it is not trivial: the label's marker appears 2-3 times, each other
    marker 0-2 times (ties go to the label), and a ``noise`` share of labels is redrawn at
    random (the best possible held-out accuracy is about ``1 - noise * 2/3``)."""
    g = torch.Generator().manual_seed(seed)
    markers = torch.tensor([1000, 2000, 3000])
    ids, labels = [], []
    for _ in range(n):
        length = int(torch.randint(16, 65, (1,), generator=g))
        seq = torch.randint(5000, 30000, (length,), generator=g)
        label = int(torch.randint(0, 3, (1,), generator=g))
        counts = [int(torch.randint(0, 3, (1,), generator=g)) for _ in range(3)]
        counts[label] = max(2 + int(torch.randint(0, 2, (1,), generator=g)), max(counts))
        pos = iter(torch.randperm(length, generator=g).tolist())
        for marker, count in zip(markers, counts):
            for _ in range(count):
                seq[next(pos)] = marker
        flip, redrawn = float(torch.rand(1, generator=g)), int(torch.randint(0, 3, (1,), generator=g))
        if flip < noise:  # both drawn for every row: the sequences do not depend on the noise
            label = redrawn
        ids.append(seq.tolist())
        labels.append(label)
    return ids, labels


def batches(ids, labels, batch_size: int, seed: int):
    """Endless shuffled batches padded (with id 0) to their longest sequence."""
    g = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(len(ids), generator=g).split(batch_size):
            yield collate([ids[i] for i in idx], [labels[i] for i in idx])


def collate(seqs, labels):
    width = max(len(s) for s in seqs)
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = torch.tensor(s)
    return x, torch.tensor(labels)


@torch.no_grad()
def accuracy(model, ids, labels, batch_size=64) -> float:
    model.eval()
    hits = 0
    for i in range(0, len(ids), batch_size):
        x, y = collate(ids[i: i + batch_size], labels[i: i + batch_size])
        hits += (model(x).argmax(-1) == y).sum().item()
    model.train()
    return hits / len(ids)


# ------------------------------------------------------------------ the demo's steps
def step_times(models: dict, batch: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of one AdamW training step per model and round, the models taking turns
    (one warm-up step each first): ratios from one run on one loaded host."""
    x = torch.randint(1, 30522, (batch, SEQ))
    y = torch.randint(0, 3, (batch,))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 1):
        for k, m in models.items():
            t = time.perf_counter()
            loss = F.cross_entropy(m(x), y)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
            if r:
                times[k].append(time.perf_counter() - t)
    return times


def train_side_by_side(models: dict, train, held_out, batch: int, lr: float, cpu_seconds: float,
                       max_steps: int, evals: int = 6) -> tuple[list[dict], tncompile.RankController, dict]:
    """Train ``dense`` and ``compressed`` on the same batches; the compressed one
    rank-adaptively (early stage a third of the steps, then the late stage cutting toward
    half its ratio). The steps fit ``cpu_seconds`` of CPU time: the first ten measure
    what a step of both costs here. Held-out accuracy ``evals`` times."""
    dense, compressed = models["dense"], models["compressed"]
    opts = {"dense": torch.optim.AdamW(dense.parameters(), lr=lr),
            "compressed": torch.optim.AdamW(tncompile.param_groups(compressed, lr=lr, gate_lr=10 * lr))}
    stream = batches(*train, batch, seed=0)
    rows = [{"step": 0, **{k: accuracy(m, *held_out) for k, m in models.items()}, "compressed_ratio": compressed.ratio}]
    ctl, steps, step, start, marks = None, max_steps, 0, cpu_seconds_used(), set()
    bar = tqdm(total=max_steps, desc="train dense + compressed", unit="step")
    while step < steps:
        x, y = next(stream)
        for k, m in models.items():
            loss = F.cross_entropy(m(x), y)
            if k == "compressed" and ctl is not None:
                loss = loss + ctl.penalty(loss)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
        step += 1
        if ctl is not None:
            ctl.step()
        elif step == 10:  # what a step costs here sizes the run
            per_step = (cpu_seconds_used() - start) / step
            steps = max(60, min(max_steps, int(cpu_seconds / per_step)))
            marks = {round(steps * (k + 1) / evals) for k in range(evals)}
            bar.total = steps
            ctl = tncompile.RankController(compressed, opts["compressed"], target_ratio=compressed.ratio / 2,
                                           early_steps=(steps - step) // 3, late_steps=steps - step - (steps - step) // 3,
                                           truncate_every=max(5, (steps - step) // 12))
            ranks_before = ctl.ranks()
        bar.update(1)
        if step in marks:
            rows.append({"step": step, **{k: accuracy(m, *held_out) for k, m in models.items()},
                         "compressed_ratio": compressed.ratio})
            bar.set_postfix({k: f"{v:.3f}" for k, v in rows[-1].items() if k in models})
    bar.close()
    return rows, ctl, ranks_before


def cpu_seconds_used() -> float:
    """CPU seconds this process and the children it waited for (the native kernels' one-time
    build) have used since it started: what the demo's budget counts."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def noise_band(accuracy_: float, n: int) -> float:
    """Half-width of the 95% interval of an accuracy measured on ``n`` held-out rows."""
    return 1.96 * (accuracy_ * (1 - accuracy_) / n) ** 0.5


def plot(rows: list[dict], task: str, n: int, path: Path) -> bool:
    """Held-out accuracy of both models (95% bands shaded) and, on the right axis, the
    compressed model's ratio as rank adaptation cuts it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    steps = [r["step"] for r in rows]
    for key, marker in (("dense", "o"), ("compressed", "s")):
        acc = [r[key] for r in rows]
        ax.plot(steps, acc, marker=marker, label=key)
        ax.fill_between(steps, [a - noise_band(a, n) for a in acc], [a + noise_band(a, n) for a in acc], alpha=0.15)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (95% band)")
    ax.set_title(task, fontsize=9)
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(steps, [r["compressed_ratio"] for r in rows], color="gray", linestyle="--", label="compressed ratio")
    right.set_ylabel("compressed model's ratio")
    lines = ax.get_legend_handles_labels()
    extra = right.get_legend_handles_labels()
    ax.legend(lines[0] + extra[0], lines[1] + extra[1], fontsize=8, loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def task_data(data: str | None, train_rows: int, quick: bool):
    if data:
        held_out = load_sst2(Path(data), "dev", max_rows=200 if quick else None, max_len=64)
        train = load_sst2(Path(data), "train", max_rows=train_rows, max_len=64)
        return train, held_out, f"SST-2 ({len(train[0]):,} train / {len(held_out[0])} dev sentences)", 2
    train, held_out = generated_task(train_rows, seed=1), generated_task(300 if quick else 1000, seed=2)
    return train, held_out, "generated task (noisy majority marker, 3 classes)", 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_data = data_dir("sst2") if (Path(data_dir("sst2")) / "train.tsv").exists() else None
    ap.add_argument("--data", default=default_data,
                    help=f"SST-2 folder (train.tsv, dev.tsv; ../bert-base-uncased/vocab.txt beside it), or 'none' "
                         f"for a generated task; default ${DATA_ENV}/sst2 or ../shared/data/sst2 when present")
    ap.add_argument("--cpu-budget", type=float, default=150.0,
                    help="CPU seconds the whole demo may take (the training steps are sized to it)")
    ap.add_argument("--max-steps", type=int, default=600, help="at most this many training steps")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ratio", type=float, default=0.1, help="target_ratio of the small model")
    ap.add_argument("--measure-batch", type=int, default=4, help="batch of the six-encoder step-time comparison")
    ap.add_argument("--measure-rounds", type=int, default=5)
    ap.add_argument("--out", default=out_dir("demo"))
    ap.add_argument("--quick", action="store_true", help="a few steps of everything (a smoke run)")
    args = ap.parse_args()
    data = None if args.data in (None, "", "none") else args.data
    if args.quick:
        args.max_steps, args.measure_batch, args.measure_rounds, args.cpu_budget = 60, 2, 3, 20.0
    retain_freed_memory()
    torch.manual_seed(0)
    started = time.perf_counter()

    # 1. the paper's model, compressed: the report
    dense = six_encoder()
    t = time.perf_counter()
    compiled = tncompile.compile(dense, target_ratio=PAPER_RATIO, init="random")
    print(f"1. CoMERA's six-encoder compiled in {time.perf_counter() - t:.1f}s: {compiled.ratio:.5f} of the "
          f"parameters ({1 / compiled.ratio:.1f}x smaller; the paper starts at 44.9x)\n")
    report = compiled.report()
    print(report, "\n")

    # 2. one whole training step against dense, measured
    times = step_times({"dense": dense, "compressed": compiled}, args.measure_batch, args.measure_rounds)
    ratios = sorted(d / c for d, c in zip(times["dense"], times["compressed"]))
    dense_s, compressed_s = statistics.median(times["dense"]), statistics.median(times["compressed"])
    print(f"2. one whole training step (forward, backward, AdamW) at {args.measure_batch} x {SEQ} tokens, "
          f"{torch.get_num_threads()} threads, {args.measure_rounds} interleaved rounds:")
    print(f"   dense {dense_s:.3f}s   compressed {compressed_s:.3f}s   -> {dense_s / compressed_s:.2f}x faster "
          f"(median; {ratios[0]:.2f}-{ratios[-1]:.2f}x over the rounds)")
    if report.speed is not None:
        print(f"   the report's {report.speed.speedup:.2f}x is an estimate for the compressed layers alone (their "
              "forward and backward, from this host's measured GEMM speed and bandwidth); the step measured here is "
              "the whole model, embeddings, attention, norms, loss and AdamW included, which compression leaves as "
              "they were (and the host's load and cache sizes, which no estimate knows)\n")
    del dense, compiled

    # 3. train a small model both ways, same init, same batches; the compressed one cuts its ranks
    train, held_out, task, classes = task_data(data, args.max_steps * args.batch_size, args.quick)
    small = small_encoder(vocab_size=30522, d_model=128, n_layers=2, n_heads=4, d_ff=512, max_len=64,
                          num_classes=classes)
    with warnings.catch_warnings():  # at this size the networks are not faster on a CPU: said below, once
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        small_compressed = tncompile.compile(copy.deepcopy(small), target_ratio=args.ratio)
    compiled_ratio = small_compressed.ratio
    budget = 0.9 * args.cpu_budget - cpu_seconds_used()  # a tenth left for the evaluations and the save
    print(f"3. {task}: a 2-layer encoder, dense ({sum(p.numel() for p in small.parameters()):,} parameters) and "
          f"compressed to {compiled_ratio:.3f} of them, trained on the same batches of {args.batch_size}; the "
          "compressed one rank-adaptively (early stage, then a late stage cutting ranks toward half its size). "
          "(A model this small is for accuracy, not speed: its networks are too small to beat dense GEMMs on a "
          "CPU; step 2 is where the speed is.)")
    rows, ctl, ranks_before = train_side_by_side({"dense": small, "compressed": small_compressed}, train, held_out,
                                                 args.batch_size, args.lr, max(budget, 1.0), args.max_steps)
    n = len(held_out[0])
    print(f"\n   trained {rows[-1]['step']} steps (sized to the {args.cpu_budget:.0f} s CPU budget on this host)\n"
          "   | step | dense | compressed | compressed ratio |\n   |---|---|---|---|")
    for r in rows:
        print(f"   | {r['step']} | {r['dense']:.3f} | {r['compressed']:.3f} | {r['compressed_ratio']:.4f} |")
    dense_acc, comp_acc = rows[-1]["dense"], rows[-1]["compressed"]
    band = (noise_band(dense_acc, n) ** 2 + noise_band(comp_acc, n) ** 2) ** 0.5
    verdict = ("within the noise of one run on this held-out set" if abs(dense_acc - comp_acc) <= band
               else "beyond the noise of one run on this held-out set")
    print(f"   held-out accuracy: dense {dense_acc:.3f} ± {noise_band(dense_acc, n):.3f}, compressed "
          f"{comp_acc:.3f} ± {noise_band(comp_acc, n):.3f} (95%, {n} rows): the difference, "
          f"{100 * (comp_acc - dense_acc):+.1f} points, is {verdict}")
    after = ctl.ranks()
    name = max(after, key=lambda k: sum(ranks_before[k]) - sum(after[k]))
    print(f"   rank adaptation: ratio {compiled_ratio:.4f} -> {small_compressed.ratio:.4f}, "
          f"{sum(sum(r) for r in ranks_before.values())} -> {sum(sum(r) for r in after.values())} ranks in all; "
          f"{name}: {ranks_before[name]} -> {after[name]} (cut out of the cores, not masked)")

    # 4. save the cut model, load it onto a fresh dense one
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tncompile.save(small_compressed, out / "compressed.tnc")
    fresh = small_encoder(vocab_size=30522, d_model=128, n_layers=2, n_heads=4, d_ff=512, max_len=64,
                          num_classes=classes)
    loaded = tncompile.load(out / "compressed.tnc", model=fresh)
    x, _ = collate(held_out[0][:16], held_out[1][:16])
    small_compressed.eval(), loaded.eval()
    with torch.no_grad():
        same = torch.equal(loaded(x), small_compressed(x))
    dense_bytes = sum(p.numel() * p.element_size() for p in small.parameters())
    print(f"\n4. saved to {out / 'compressed.tnc'} ({(out / 'compressed.tnc').stat().st_size / 1e6:.2f} MB; the dense "
          f"model's weights are {dense_bytes / 1e6:.1f} MB) and loaded onto a fresh model: "
          f"{'the same outputs' if same else 'DIFFERENT outputs'}")
    drew = plot(rows, task, n, out / "demo.png")
    cpu = cpu_seconds_used()
    (out / "demo.json").write_text(json.dumps({
        "task": task, "ratio": compiled_ratio, "ratio_after_adaptation": small_compressed.ratio, "accuracy": rows,
        "held_out_rows": n, "six_encoder_ratio": PAPER_RATIO, "step_seconds": times,
        "measure_batch": args.measure_batch, "threads": torch.get_num_threads(), "loaded_same_outputs": same,
        "seconds": round(time.perf_counter() - started, 1), "cpu_seconds": round(cpu, 1)}, indent=1))
    print(f"   held-out accuracy plotted to {out / 'demo.png'}" if drew else "   (pip install matplotlib for the plot)")
    built = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"   the whole demo took {time.perf_counter() - started:.0f} s, {cpu:.0f} s of CPU time on "
          f"{torch.get_num_threads()} threads (imports included"
          + (f"; {built.ru_utime + built.ru_stime:.0f} s of it building the native kernels, once per machine"
             if built.ru_utime + built.ru_stime > 1 else "") + ")\n")
    print("5. next: rank-adaptive training (CoMERA's early and late stages) on SST-2 -- "
          "python examples/sst2.py --data ../shared/data/sst2 --quick; your own model: README's Use section")


if __name__ == "__main__":
    main()
