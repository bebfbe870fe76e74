"""tncompile in about three minutes on 2 cores: compress, look, time, train.

    python examples/demo.py                              # SST-2 when ../shared/data is there
    python examples/demo.py --data ../shared/data/sst2   # the same, explicitly
    python examples/demo.py --data none                  # a generated task (noisy, 3 classes)

1. CoMERA's six-encoder (6 layers, d_model 768, 12 heads, d_ff 3072, vocab 30522,
   sequence 128) compiled to the paper's starting size, 1/44.9 of the parameters; its
   report.
2. One whole training step (forward, backward, AdamW) of it and of the dense model at
   ``--measure-batch`` x 128 tokens, interleaved in this process: the step-time ratio.
3. A small encoder (2 layers, d_model 128, BERT's vocabulary) trained dense and compressed
   (``--ratio``, 0.1) from the same initial weights on the same batches; held-out accuracy
   every ``--eval-every`` steps, printed as a table and plotted to
   ``runs/demo/demo.png`` (``--out``), with the figures in ``demo.json``.
4. What to run next.
"""
from __future__ import annotations

import argparse
import csv
import copy
import json
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
from tncompile.zoo import six_encoder, small_encoder

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
def step_times(models: dict, batch: int, rounds: int) -> dict[str, float]:
    """Median seconds of one AdamW training step per model, the models taking turns
    (one warm-up step each first): a ratio from one run on one loaded host."""
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
    return {k: statistics.median(v) for k, v in times.items()}


def train_side_by_side(models: dict, train, held_out, steps: int, batch: int, lr: float, every: int) -> list[dict]:
    """Train each model on the same batches; held-out accuracy every ``every`` steps."""
    opts = {k: torch.optim.AdamW(m.parameters(), lr=lr) for k, m in models.items()}
    stream = batches(*train, batch, seed=0)
    rows = [{"step": 0, **{k: accuracy(m, *held_out) for k, m in models.items()}}]
    bar = tqdm(range(1, steps + 1), desc="train dense + compressed", unit="step")
    for step in bar:
        x, y = next(stream)
        for k, m in models.items():
            loss = F.cross_entropy(m(x), y)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
        if step % every == 0 or step == steps:
            rows.append({"step": step, **{k: accuracy(m, *held_out) for k, m in models.items()}})
            bar.set_postfix({k: f"{v:.3f}" for k, v in rows[-1].items() if k != "step"})
    return rows


def plot(rows: list[dict], task: str, ratio: float, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["dense"] for r in rows], marker="o", label="dense")
    ax.plot(steps, [r["compressed"] for r in rows], marker="s", label=f"tncompile, {1 / ratio:.0f}x smaller")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(task, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
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
    ap.add_argument("--steps", type=int, default=600, help="training steps of each small model")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ratio", type=float, default=0.1, help="target_ratio of the small model")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--measure-batch", type=int, default=8, help="batch of the six-encoder step-time comparison")
    ap.add_argument("--measure-rounds", type=int, default=2)
    ap.add_argument("--out", default=out_dir("demo"))
    ap.add_argument("--quick", action="store_true", help="a few steps of everything (a smoke run)")
    args = ap.parse_args()
    data = None if args.data in (None, "", "none") else args.data
    if args.quick:
        args.steps, args.eval_every, args.measure_batch, args.measure_rounds = 20, 10, 2, 1
    retain_freed_memory()
    torch.manual_seed(0)
    started = time.perf_counter()

    # 1. the paper's model, compressed: the report
    dense = six_encoder()
    t = time.perf_counter()
    compiled = tncompile.compile(dense, target_ratio=PAPER_RATIO, init="random")
    print(f"1. CoMERA's six-encoder compiled in {time.perf_counter() - t:.1f}s: {compiled.ratio:.5f} of the "
          f"parameters ({1 / compiled.ratio:.1f}x smaller; the paper starts at 44.9x)\n")
    print(compiled.report(), "\n")

    # 2. one whole training step against dense
    times = step_times({"dense": dense, "compressed": compiled}, args.measure_batch, args.measure_rounds)
    print(f"2. one training step (forward, backward, AdamW) at {args.measure_batch} x {SEQ} tokens, "
          f"{torch.get_num_threads()} threads, median of {args.measure_rounds} interleaved:")
    print(f"   dense {times['dense']:.3f}s   compressed {times['compressed']:.3f}s   "
          f"-> {times['dense'] / times['compressed']:.2f}x faster\n")
    del dense, compiled

    # 3. train a small model both ways, same init, same batches
    train, held_out, task, classes = task_data(data, args.steps * args.batch_size, args.quick)
    small = small_encoder(vocab_size=30522, d_model=128, n_layers=2, n_heads=4, d_ff=512, max_len=64,
                          num_classes=classes)
    with warnings.catch_warnings():  # at this size the networks are not faster on a CPU: said below, once
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        small_compressed = tncompile.compile(copy.deepcopy(small), target_ratio=args.ratio)
    print(f"3. {task}: a 2-layer encoder, dense ({sum(p.numel() for p in small.parameters()):,} parameters) and "
          f"compressed to {small_compressed.ratio:.3f} of them, trained {args.steps} steps of {args.batch_size} "
          "(a model this small is for accuracy, not speed: its networks are too small to beat dense GEMMs on "
          "a CPU; step 2 is where the speed is)")
    rows = train_side_by_side({"dense": small, "compressed": small_compressed}, train, held_out, args.steps,
                              args.batch_size, args.lr, args.eval_every)
    print("\n   | step | dense | compressed |\n   |---|---|---|")
    for r in rows:
        print(f"   | {r['step']} | {r['dense']:.3f} | {r['compressed']:.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    drew = plot(rows, task, small_compressed.ratio, out / "demo.png")
    (out / "demo.json").write_text(json.dumps({
        "task": task, "ratio": small_compressed.ratio, "accuracy": rows, "six_encoder_ratio": PAPER_RATIO,
        "step_seconds": times, "measure_batch": args.measure_batch, "threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - started, 1)}, indent=1))
    print(f"\n   held-out accuracy plotted to {out / 'demo.png'}" if drew else "\n   (pip install matplotlib for the plot)")
    print(f"   the whole demo took {time.perf_counter() - started:.0f}s\n")
    print("4. next: rank-adaptive training (CoMERA's early and late stages) on SST-2 -- "
          "python examples/sst2.py --data ../shared/data/sst2 --quick; your own model: README's Use section")


if __name__ == "__main__":
    main()
