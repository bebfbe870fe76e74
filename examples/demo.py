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
from tncompile.testing import HostLoad, six_encoder, small_encoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import DATA_ENV, data_dir, out_dir  # noqa: E402

PAPER_RATIO = 1 / 44.9   # the official CoMERA code's starting ranks give a 44.9x smaller model
SEQ = 128
EVALS = 6              # held-out evaluations per run: each sixth of the steps
MIN_SEEDS = 3          # the fewest seeds a run-to-run band (and so a claim) comes from
CONVERGED_GAIN = 0.02  # converged: a model gains at most 2 points over the last third of its steps


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


def batches(ids, labels, batch_size: int, seed: int, pool: int = 32):
    """Endless shuffled batches padded (with id 0) to their longest sequence, grouped by
    length: each run of ``pool`` batches' worth of shuffled rows is sorted by length and
    cut into batches, whose order is shuffled again, so a batch pads little (what HF's
    ``group_by_length`` does) while every row is still seen once per epoch."""
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(ids), generator=g).tolist()
        for start in range(0, len(order), pool * batch_size):
            chunk = sorted(order[start: start + pool * batch_size], key=lambda i: len(ids[i]))
            cut = [chunk[i: i + batch_size] for i in range(0, len(chunk), batch_size)]
            for k in torch.randperm(len(cut), generator=g).tolist():
                yield collate([ids[i] for i in cut[k]], [labels[i] for i in cut[k]])


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


def small_models(d_model: int, classes: int, ratio: float, seed: int):
    """The small encoder at ``d_model`` (2 layers, BERT's vocabulary, no dropout) and its
    compressed copy, both from the weights ``seed`` draws."""
    torch.manual_seed(seed)
    dense = small_encoder(vocab_size=30522, d_model=d_model, n_layers=2, n_heads=4, d_ff=4 * d_model,
                          max_len=64, num_classes=classes, dropout=0.0)
    with warnings.catch_warnings():  # at this size the networks are not faster on a CPU: said in step 3, once
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        compressed = tncompile.compile(copy.deepcopy(dense), target_ratio=ratio)
    return dense, compressed


def step_cpu_seconds(d_model: int, classes: int, ratio: float, train, batch: int, lr: float) -> float:
    """CPU seconds one training step of both models costs at ``d_model`` here (4 steps timed
    after 4 warm-up steps, which measure the compressed layers' ways, on throwaway models)."""
    models = dict(zip(("dense", "compressed"), small_models(d_model, classes, ratio, seed=10_000)))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=lr) for k, m in models.items()}
    stream = batches(*train, batch, seed=10_000)
    for i in range(8):
        if i == 4:
            start = cpu_seconds_used(children=False)
        x, y = next(stream)
        for k, m in models.items():
            loss = F.cross_entropy(m(x), y)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
    return (cpu_seconds_used(children=False) - start) / 4


def choose_d_model(d_model: int, budget: float, steps: int, seeds: int, cost) -> tuple[int, float]:
    """The widest of ``d_model``, ``d_model / 2``, ... (down to 8) whose ``seeds`` runs of
    ``steps`` steps fit ``budget`` CPU seconds by ``cost(d_model)`` (seconds per step), and
    its estimated total: a budget that binds shrinks the model, never the steps, so the
    comparison stays at the regime it was sized for. Where even width 16 does not fit, 16
    (narrower, the layers are too small to compress)."""
    while True:
        total = 1.15 * cost(d_model) * steps * seeds  # evaluations and rank cuts on top of the steps
        if total <= budget or d_model <= 16:
            return d_model, total
        d_model //= 2


def train_seed(seed: int, d_model: int, classes: int, train, held_out, args, bar) -> dict:
    """Train the dense and the compressed small encoder of ``seed`` on the same batches for
    ``args.steps`` steps, the compressed one rank-adaptively (early stage a third of the
    steps, then the late stage cutting its ranks toward half its ratio). Held-out accuracy
    at step 0 and at each sixth of the steps."""
    dense, compressed = small_models(d_model, classes, args.ratio, seed)
    models = {"dense": dense, "compressed": compressed}
    lr = args.lr
    opts = {"dense": torch.optim.AdamW(dense.parameters(), lr=lr),
            "compressed": torch.optim.AdamW(tncompile.param_groups(compressed, lr=lr, gate_lr=10 * lr))}
    steps = args.steps
    ctl = tncompile.RankController(compressed, opts["compressed"], target_ratio=compressed.ratio / 2,
                                   early_steps=steps // 3, late_steps=steps - steps // 3,
                                   truncate_every=max(5, steps // 12))
    ranks_before, compiled_ratio = ctl.ranks(), compressed.ratio
    marks = {round(steps * k / EVALS) for k in range(1, EVALS + 1)}
    rows = [{"step": 0, **{k: accuracy(m, *held_out) for k, m in models.items()}, "compressed_ratio": compiled_ratio}]
    stream = batches(*train, args.batch_size, seed=seed)
    for step in range(1, steps + 1):
        x, y = next(stream)
        for k, m in models.items():
            loss = F.cross_entropy(m(x), y)
            if k == "compressed":
                loss = loss + ctl.penalty(loss)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
        ctl.step()
        bar.update(1)
        if step in marks:
            rows.append({"step": step, **{k: accuracy(m, *held_out) for k, m in models.items()},
                         "compressed_ratio": compressed.ratio})
            bar.set_postfix({"seed": seed, **{k: f"{v:.3f}" for k, v in rows[-1].items() if k in models}})
    return {"seed": seed, "rows": rows, "dense": dense, "compressed": compressed, "compiled_ratio": compiled_ratio,
            "ranks_before": ranks_before, "ranks_after": ctl.ranks()}


def t_quantile(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    table = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)
    if df <= len(table):
        return table[df - 1]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))  # Cornish-Fisher


def seed_band(values: list[float]) -> tuple[float, float | None]:
    """Mean of per-seed ``values`` and the half-width of its 95% interval over the seeds
    (``None`` below two seeds)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, t_quantile(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5


def comparison_verdict(dense: list[float], compressed: list[float], gains: dict[str, float]) -> tuple[str | None, str]:
    """What the final held-out accuracies of ``dense`` and ``compressed`` (one per seed,
    same seeds) support, and the sentence saying it.

    The claim is ``"within"`` or ``"beyond"`` the run-to-run band of the paired differences
    only with at least ``MIN_SEEDS`` seeds and where both models reached the converged
    regime (``gains``: each model's seed-mean accuracy gain over the last third of the
    steps, at most ``CONVERGED_GAIN``); otherwise ``None``, and the sentence says why.
    """
    diffs = [c - d for c, d in zip(compressed, dense)]
    mean, half = seed_band(diffs)
    still_learning = {k: g for k, g in gains.items() if g > CONVERGED_GAIN}
    if len(diffs) < MIN_SEEDS:
        return None, (f"the difference is {100 * mean:+.1f} points; {len(diffs)} seed(s) give no run-to-run band, "
                      f"so no claim is made (run --seeds {MIN_SEEDS} or more)")
    if still_learning:
        names = ", ".join(f"{k} gained {100 * g:+.1f} points" for k, g in still_learning.items())
        return None, (f"the difference is {100 * mean:+.1f} ± {100 * half:.1f} points over {len(diffs)} seeds, but "
                      f"training had not converged ({names} over the last third of the steps; the converged "
                      f"regime is at most {100 * CONVERGED_GAIN:.0f}): no claim is made (raise --steps)")
    claim = "within" if abs(mean) <= half else "beyond"
    return claim, (f"the difference, {100 * mean:+.1f} ± {100 * half:.1f} points (95% over {len(diffs)} seeds, "
                   f"paired), is {claim} the run-to-run noise")


def cpu_seconds_used(children: bool = True) -> float:
    """CPU seconds this process has used since it started and, with ``children``, the
    children it waited for (the native kernels' one-time build)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + (kids.ru_utime + kids.ru_stime if children else 0.0)


def mean_rows(runs: list[dict]) -> list[dict]:
    """The seeds' held-out accuracy rows averaged step by step, with each model's 95%
    half-width over the seeds (``None`` for one seed)."""
    rows = []
    for at in zip(*(run["rows"] for run in runs)):
        row = {"step": at[0]["step"]}
        for key in ("dense", "compressed", "compressed_ratio"):
            row[key], half = seed_band([r[key] for r in at])
            if key != "compressed_ratio":
                row[f"{key}_band"] = half
        rows.append(row)
    return rows


def plot(rows: list[dict], task: str, seeds: int, path: Path) -> bool:
    """Held-out accuracy of both models, the mean over the seeds with its 95% band shaded,
    and, on the right axis, the compressed model's ratio as rank adaptation cuts it."""
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
        if seeds > 1:
            half = [r[f"{key}_band"] for r in rows]
            ax.fill_between(steps, [a - h for a, h in zip(acc, half)], [a + h for a, h in zip(acc, half)], alpha=0.15)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"held-out accuracy (mean of {seeds} seeds" + (", 95% band)" if seeds > 1 else ")"))
    ax.set_title(task, fontsize=9)
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(steps, [r["compressed_ratio"] for r in rows], color="gray", linestyle="--", label="compressed ratio")
    right.set_ylabel("compressed model's ratio")
    lines = ax.get_legend_handles_labels()
    extra = right.get_legend_handles_labels()
    ax.legend(lines[0] + extra[0], lines[1] + extra[1], fontsize=8, loc="lower center")
    fig.tight_layout()
    from tncompile.files import write_figure
    write_figure(fig, path, dpi=120)   # whole or not at all; a link there is replaced
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
                    help="CPU seconds the demo may take, the native kernels' one-time build aside; where the "
                         "training would not fit, the small model is made narrower (never trained for fewer steps)")
    ap.add_argument("--steps", type=int, default=300,
                    help="training steps per seed (SST-2 reaches its plateau by then at the defaults)")
    ap.add_argument("--seeds", type=int, default=MIN_SEEDS, help="seeds to train both models with (the band's runs)")
    ap.add_argument("--d-model", type=int, default=32, help="width of the small encoder (before the budget)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--ratio", type=float, default=0.1, help="target_ratio of the small model")
    ap.add_argument("--measure-batch", type=int, default=4, help="batch of the six-encoder step-time comparison")
    ap.add_argument("--measure-rounds", type=int, default=5)
    ap.add_argument("--out", default=out_dir("demo"))
    ap.add_argument("--quick", action="store_true", help="a few steps of everything (a smoke run: no claim)")
    args = ap.parse_args()
    data = None if args.data in (None, "", "none") else args.data
    if args.quick:
        args.steps, args.d_model, args.measure_batch, args.measure_rounds, args.cpu_budget = 30, 16, 2, 3, 40.0
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

    # 2. one whole training step against dense, measured; the host's load beside it
    with HostLoad() as load:
        times = step_times({"dense": dense, "compressed": compiled}, args.measure_batch, args.measure_rounds)
    ratios = sorted(d / c for d, c in zip(times["dense"], times["compressed"]))
    dense_s, compressed_s = statistics.median(times["dense"]), statistics.median(times["compressed"])
    print(f"2. one whole training step (forward, backward, AdamW) at {args.measure_batch} x {SEQ} tokens, "
          f"{torch.get_num_threads()} threads, {args.measure_rounds} interleaved rounds:")
    print(f"   dense {dense_s:.3f}s   compressed {compressed_s:.3f}s   -> {dense_s / compressed_s:.2f}x faster "
          f"(median; {ratios[0]:.2f}-{ratios[-1]:.2f}x over the rounds)")
    if load.busy:
        print(f"   WARNING: the host was busy while these steps were timed ({load.describe()}): the times "
              "and their ratio are unreliable; rerun on a quiet host")
    if report.speed is not None:
        print(f"   the report's {report.speed.speedup:.2f}x is an estimate for the compressed layers alone (their "
              "forward and backward, from this host's measured GEMM speed and bandwidth); the step measured here is "
              "the whole model, embeddings, attention, norms, loss and AdamW included, which compression leaves as "
              "they were (and the host's load and cache sizes, which no estimate knows)\n")
    del dense, compiled

    # 3. train a small model both ways over several seeds; the compressed one cuts its ranks
    train, held_out, task, classes = task_data(data, args.steps * args.batch_size, args.quick)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small costs less CPU on one thread than on two
    budget = 0.9 * args.cpu_budget - cpu_seconds_used(children=False)  # a tenth left for the save
    d_model, estimate = choose_d_model(args.d_model, budget, args.steps, args.seeds,
                                       lambda d: step_cpu_seconds(d, classes, args.ratio, train, args.batch_size,
                                                                  args.lr))
    if d_model < args.d_model:
        print(f"   (the CPU budget binds: the small model is {d_model} wide instead of {args.d_model}, so that "
              f"{args.seeds} seeds x {args.steps} steps fit; the steps are never cut)")
    print(f"3. {task}: a 2-layer encoder of width {d_model}, dense and compressed (target_ratio {args.ratio}), "
          f"trained from the same weights on the same batches of {args.batch_size} for {args.steps} steps, "
          f"over {args.seeds} seeds; the compressed one rank-adaptively (early stage, then a late stage cutting "
          f"ranks toward half its size). (A model this small is for accuracy, not speed: its networks are too "
          "small to beat dense GEMMs on a CPU; step 2 is where the speed is.)")
    bar = tqdm(total=args.steps * args.seeds, desc=f"train dense + compressed, {args.seeds} seeds", unit="step")
    runs = [train_seed(seed, d_model, classes, train, held_out, args, bar) for seed in range(args.seeds)]
    bar.close()
    torch.set_num_threads(threads)
    rows, n = mean_rows(runs), len(held_out[0])
    print(f"\n   trained {args.steps} steps per seed, {args.seeds} seeds; held-out accuracy ({n} rows), mean over "
          "the seeds (± 95% band over them)\n"
          "   | step | dense | compressed | compressed ratio |\n   |---|---|---|---|")

    def cell(r, key):
        return f"{r[key]:.3f}" + (f" ± {r[key + '_band']:.3f}" if r[key + "_band"] is not None else "")
    for r in rows:
        print(f"   | {r['step']} | {cell(r, 'dense')} | {cell(r, 'compressed')} | {r['compressed_ratio']:.4f} |")
    two_thirds = next(r for r in rows if r["step"] >= round(args.steps * 2 / 3))
    gains = {k: rows[-1][k] - two_thirds[k] for k in ("dense", "compressed")}
    print(f"   over the last third of the steps dense gained {100 * gains['dense']:+.1f} and compressed "
          f"{100 * gains['compressed']:+.1f} points (converged regime: at most {100 * CONVERGED_GAIN:.0f})")
    claim, sentence = comparison_verdict([run["rows"][-1]["dense"] for run in runs],
                                         [run["rows"][-1]["compressed"] for run in runs], gains)
    print(f"   held-out accuracy: dense {rows[-1]['dense']:.3f}, compressed {rows[-1]['compressed']:.3f}: {sentence}")
    last = runs[-1]
    before, after = last["ranks_before"], last["ranks_after"]
    name = max(after, key=lambda k: sum(before[k]) - sum(after[k]))
    print(f"   rank adaptation (seed {last['seed']}): ratio {last['compiled_ratio']:.4f} -> "
          f"{last['compressed'].ratio:.4f}, {sum(sum(r) for r in before.values())} -> "
          f"{sum(sum(r) for r in after.values())} ranks in all; {name}: {before[name]} -> {after[name]} "
          "(cut out of the cores, not masked)")

    # 4. save the cut model, load it onto a fresh dense one
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    small_compressed = last["compressed"]
    tncompile.save(small_compressed, out / "compressed.tnc")
    fresh = small_encoder(vocab_size=30522, d_model=d_model, n_layers=2, n_heads=4, d_ff=4 * d_model, max_len=64,
                          num_classes=classes, dropout=0.0)
    loaded = tncompile.load(out / "compressed.tnc", model=fresh)
    x, _ = collate(held_out[0][:16], held_out[1][:16])
    small_compressed.eval(), loaded.eval()
    with torch.no_grad():
        same = torch.equal(loaded(x), small_compressed(x))
    dense_bytes = sum(p.numel() * p.element_size() for p in last["dense"].parameters())
    print(f"\n4. saved to {out / 'compressed.tnc'} ({(out / 'compressed.tnc').stat().st_size / 1e6:.2f} MB; the dense "
          f"model's weights are {dense_bytes / 1e6:.1f} MB) and loaded onto a fresh model: "
          f"{'the same outputs' if same else 'DIFFERENT outputs'}")
    drew = plot(rows, task, args.seeds, out / "demo.png")
    cpu, built = cpu_seconds_used(children=False), resource.getrusage(resource.RUSAGE_CHILDREN)
    build_cpu = built.ru_utime + built.ru_stime
    from tncompile.files import write_replacing
    write_replacing(out / "demo.json", json.dumps({
        "task": task, "d_model": d_model, "steps": args.steps, "seeds": args.seeds, "batch_size": args.batch_size,
        "ratio": last["compiled_ratio"], "ratio_after_adaptation": small_compressed.ratio, "accuracy": rows,
        "accuracy_by_seed": [run["rows"] for run in runs], "gain_over_last_third": gains, "claim": claim,
        "held_out_rows": n, "six_encoder_ratio": PAPER_RATIO, "step_seconds": times, "host_load": load.as_dict(),
        "measure_batch": args.measure_batch, "threads": threads, "loaded_same_outputs": same,
        "estimated_training_cpu_seconds": round(estimate, 1),
        "seconds": round(time.perf_counter() - started, 1), "cpu_seconds": round(cpu, 1),
        "native_build_cpu_seconds": round(build_cpu, 1)}, indent=1), mode=None)
    print(f"   held-out accuracy plotted to {out / 'demo.png'}" if drew else "   (pip install matplotlib for the plot)")
    print(f"   the whole demo took {time.perf_counter() - started:.0f} s, {cpu:.0f} s of CPU time (imports included"
          + (f"; building the native kernels, once per machine, took {build_cpu:.0f} s more"
             if build_cpu > 1 else "") + ")\n")
    print("5. next: rank-adaptive training (CoMERA's early and late stages) on SST-2 -- "
          "python examples/sst2.py --data ../shared/data/sst2 --quick; your own model: README's Use section")


if __name__ == "__main__":
    main()
