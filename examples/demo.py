"""tncompile demo: compile CoMERA's six-encoder transformer ~45x smaller and train it.

    python examples/demo.py                          # generated task
    python examples/demo.py --data ../shared/data/sst2   # SST-2 (BERT vocab beside it)
    TNCOMPILE_DATA=../shared/data python examples/demo.py  # the same

Steps: build the paper's model (6 layers, d_model 768, 12 heads, d_ff 3072,
vocab 30522, sequence 128, 3 classes); compile it to the paper's starting
size (1/44.9 of the parameters); print the report; train a few hundred steps
with a progress bar; report accuracy; then measure one training step of the
compiled and of the dense model at the same shape, each in a fresh process,
for step time and peak memory.
"""
from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import statistics
import time
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import tncompile
from tncompile.runtime.kernels.cpu_allocator import release_freed_memory, retain_freed_memory
from tncompile.zoo import six_encoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import DATA_ENV, data_dir  # noqa: E402

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


def generated_task(n: int, seed: int):
    """Which of three marker tokens occurs most often in a random sequence."""
    g = torch.Generator().manual_seed(seed)
    markers = torch.tensor([1000, 2000, 3000])
    ids, labels = [], []
    for _ in range(n):
        length = int(torch.randint(16, 65, (1,), generator=g))
        seq = torch.randint(5000, 30000, (length,), generator=g)
        label = int(torch.randint(0, 3, (1,), generator=g))
        pos = torch.randperm(length, generator=g)
        seq[pos[:3]] = markers[label]
        for k, other in enumerate(markers[torch.arange(3) != label]):
            if torch.rand(1, generator=g) < 0.5:
                seq[pos[3 + k]] = other
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


# ------------------------------------------------------------------ measurement
def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field))


def measure_step(kind: str, batch: int, steps: int, threads: int, queue) -> None:
    """In a fresh process: median train-step time and peak memory above the
    resident model (activations, gradients, optimizer state, workspace). Freed memory
    is kept for reuse (tncompile turns that on for its CPU layers; the dense model gets
    it too), and what building and compiling freed is given back before the baseline
    is read: otherwise the steps reuse it unseen and the compiled model's peak shrinks
    to nearly nothing."""
    torch.set_num_threads(threads)
    retain_freed_memory()  # reuse freed CPU memory (both models alike), as the runtime recommends
    torch.manual_seed(0)
    model = six_encoder()
    x = torch.randint(1, 30522, (batch, SEQ))
    if kind == "compiled":
        model = tncompile.compile(model, target_ratio=PAPER_RATIO, init="random", example_inputs=(x,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    y = torch.randint(0, 3, (batch,))
    release_freed_memory()  # what building and compiling freed is not part of the baseline
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS counter
        base = _rss_kb("VmRSS")
    except OSError:
        base = None
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    peak = (_rss_kb("VmHWM") - base) / 1024 if base is not None else float("nan")
    queue.put((kind, statistics.median(times[1:]), peak))


def compare(batch: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    results = {}
    for kind in ("compiled", "dense"):
        q = ctx.Queue()
        p = ctx.Process(target=measure_step, args=(kind, batch, steps, torch.get_num_threads(), q))
        p.start()
        k, t, mem = q.get()
        p.join()
        results[k] = (t, mem)
    return results


# ------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=data_dir("sst2") if os.environ.get(DATA_ENV) else None,
                    help=f"SST-2 folder (train.tsv, dev.tsv; ../bert-base-uncased/vocab.txt beside it); "
                         f"default ${DATA_ENV}/sst2 when {DATA_ENV} is set, else a generated task")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--measure-batch", type=int, default=8, help="batch for the step-time comparison")
    ap.add_argument("--measure-steps", type=int, default=3)
    args = ap.parse_args()
    retain_freed_memory()
    torch.manual_seed(0)

    if args.data:
        data = Path(args.data)
        train = load_sst2(data, "train")
        held_out = load_sst2(data, "dev")
        task = f"SST-2 ({len(train[0]):,} train / {len(held_out[0])} dev sentences)"
    else:
        train, held_out = generated_task(20000, seed=1), generated_task(1000, seed=2)
        task = "generated task (majority marker token, 3 classes)"

    dense = six_encoder()
    t = time.perf_counter()
    compiled = tncompile.compile(dense, target_ratio=PAPER_RATIO, init="random")
    print(f"compiled in {time.perf_counter() - t:.1f}s: {compiled.ratio:.5f} of the parameters "
          f"({1 / compiled.ratio:.1f}x smaller; the paper's starting point is 44.9x)\n")
    print(compiled.report(), "\n")

    print(f"training on {task} for {args.steps} steps, batch {args.batch_size}")
    opt = torch.optim.AdamW(compiled.parameters(), lr=args.lr)
    stream = batches(*train, args.batch_size, seed=0)
    compiled.train()
    bar = tqdm(range(args.steps), desc="train", unit="step")
    ema = None
    for _ in bar:
        x, y = next(stream)
        loss = F.cross_entropy(compiled(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    acc = accuracy(compiled, *held_out)
    print(f"held-out accuracy after {args.steps} steps: {acc:.3f}\n")

    print(f"one training step at batch {args.measure_batch} x {SEQ} tokens "
          f"(median of {args.measure_steps}, each model in a fresh process, {torch.get_num_threads()} threads, "
          f"freed memory retained):")
    res = compare(args.measure_batch, args.measure_steps)
    (tc, mc), (td, md) = res["compiled"], res["dense"]
    print(f"  {'':10s} {'step time':>10s} {'peak memory above the loaded model':>36s}")
    print(f"  {'dense':10s} {td:9.3f}s {md:34.0f}MB")
    print(f"  {'compiled':10s} {tc:9.3f}s {mc:34.0f}MB")
    print(f"  compiled: {td / tc:.2f}x faster per step, {md / mc:.2f}x less peak training memory, "
          f"{1 / compiled.ratio:.1f}x fewer parameters")


if __name__ == "__main__":
    main()
