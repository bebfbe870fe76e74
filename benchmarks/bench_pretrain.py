"""Pretraining quality on a real code corpus: dense against TT, low-rank and GaLore, each at
its own tuned learning rate (issue 66).

    python benchmarks/bench_pretrain.py                      # sweep, full runs, report (hours on a CPU)
    python benchmarks/bench_pretrain.py --phases time        # the timing pass: run it on a quiet machine
    python benchmarks/bench_pretrain.py --phases report      # table, PNG and JSON from the finished rows
    python benchmarks/bench_pretrain.py --device cuda        # the same study on a GPU (minutes)
    python benchmarks/bench_pretrain.py --objective mlm      # the seeds' case: a masked LM, dense vs TT at 1/4.23
    python benchmarks/bench_pretrain.py --phases ablation    # what TT's quality depends on (after the sweep)

**Corpus.** ``../shared/data/python-code/``: the CPython standard library split by file
into train (two shards), valid and test. A byte-level BPE (vocabulary 8,192) is trained on
the train shards alone (:mod:`pretrain_corpus`, cached); every split is encoded once and
cached.

**Model.** A Llama-style causal LM from a ``transformers`` config: hidden 256, 4 layers,
SwiGLU FFN 688, 4 heads, tied embedding; 5.26M parameters. 16 x 256 tokens a step.

**Variants** (:mod:`pretrain_models`): ``dense``; ``tt0.25`` and ``tt0.1`` (compiled at 1.5x
the target with ``init="random"``, cut to it by tncompile's default rank-adaptive budget
schedule); ``lowrank0.25`` (tncompile's 2-core form, no adaptation); ``galore`` (GaLore's
AdamW: rank = width / 4, update gap 200, scale 0.25); ``tt0.25-measured`` (``tt0.25`` with
``linear_cores="measured"``: each linear's 2-, 4- or 6-core network chosen by timing). AdamW betas (0.9, 0.95), no weight
decay, gradient clipping at 1.0, warm-up over 10% of the steps then cosine to 10% of the
peak: the same for every variant.

**Protocol.**

1. *Sweep*: each variant at learning rates 1.5e-3, 3e-3 and 6e-3 for an eighth of the
   full run's tokens (seed 0, its own warm-up and cosine over that horizon), scored on the
   whole valid split. When the best is at the grid's edge the grid extends by a factor 2
   past it (twice at most).
2. *Full*: each variant at its best rate for ``--epochs`` (default 1: every train window
   once, 8.5M tokens), 3 seeds for dense and tt0.25, 2 for the others. A seed draws every
   initialization (TT's cores included) and the batch order; all variants of a seed see
   the same batches. The valid split's loss at 8 points on the way; the whole test split
   at the end.
3. *Time* (separate, on a quiet machine): each variant's training step (optimizer
   included) in a fresh process: median of 10 steps after 3 warm-ups, FLOPs per token
   (``torch.utils.flop_counter``, forward and backward), peak RSS. TT is timed at its
   start ranks and at a finished run's end ranks; its wall-time axis interpolates between
   them by parameter count.
4. *Report*: the table (test perplexity at equal tokens over the seeds; valid perplexity
   at equal wall time), the count baselines (:mod:`count_baselines`), ``pretrain.json``
   and ``pretrain.png`` in ``benchmarks/results/``.

**Ablations** (``--phases ablation``, after ``tt0.25``'s and ``tt0.1``'s sweeps): each at its
base variant's best learning rate, seed 0, the sweep's horizon, against that sweep's row:
``+torchinit`` (cores at PyTorch's default scales, as ``init="random"`` drew them before
this study: a std-1 embedding table against dense's 0.02), ``+direct`` (compiled at the
target, no rank adaptation) and ``+dense-embedding`` (as ``+direct`` with the tied table
dense and the linears at the target of their own parameters: a larger model, to show how
much of the gap is the table's compression).

**The seeds' case** (``--objective mlm``): CoMERA pre-trains CodeBERT, a RoBERTa masked LM,
at 4.23x compression. A ``RobertaForMaskedLM`` of the same width (hidden 256, 4 layers,
GELU FFN 1024, tied decoder; the tokenizer reserves ``<pad>`` and ``<mask>``), 15% of the
tokens masked afresh each step (80/10/10), dense against ``tt0.2364`` (1/4.23 of dense's
parameters) by the same protocol, 2 seeds each; scored by masked-token accuracy and
perplexity on the whole test split (its masks fixed by one seed for every model). Rows in
``runs/pretrain-mlm``; ``pretrain_mlm.json`` and ``pretrain_mlm.png``.

**Resuming.** Every run checkpoints into ``--run-dir`` (default ``runs/pretrain``) every
``--checkpoint-minutes`` and continues from there when the command runs again; a finished
row is a file there and is never rerun. Quality at equal tokens does not depend on the
machine's load, so the quality phases may run in the background; their wall times are
kept (``wall_s_under_load``) but the timing phase's figures are the ones reported.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common import RESULTS, machine, parser, read_row, save_figure, write_result
from pretrain_loop import RunSpec, epoch_steps, train_run
from pretrain_models import MLM_SPECIAL_TOKENS, ModelShape, TT_HEADROOM, variant_kind

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "python-code"
VARIANTS = ("dense", "tt0.25", "tt0.1", "lowrank0.25", "galore", "tt0.25-measured")
LR_GRID = (1.5e-3, 3e-3, 6e-3)
GRID_EXTENSIONS = 2
SWEEP_FRACTION = 8
SEEDS = {"dense": 3, "tt0.25": 3}
DEFAULT_SEEDS = 2
MLM_VARIANTS = ("dense", f"tt{1 / 4.23:.4f}")
ABLATED = ("tt0.25", "tt0.1")
MLM_FFN = 1024
PROTOCOL_VERSION = 1
MAX_ROW_BYTES = 8 << 20


def seeds_of(variant: str, objective: str = "clm") -> int:
    return SEEDS.get(variant, DEFAULT_SEEDS) if objective == "clm" else DEFAULT_SEEDS


@dataclass
class Study:
    """The study's plan and its finished rows (one JSON file each in ``run_dir / "rows"``)."""
    corpus: dict[str, torch.Tensor]
    shape: ModelShape
    batch: int
    epochs: float
    run_dir: Path
    device: str = "cpu"
    corpus_id: str = ""
    checkpoint_s: float = 300.0
    eval_points: int = 8
    lr_grid: tuple[float, ...] = LR_GRID
    sweep_fraction: int = SWEEP_FRACTION
    objective: str = "clm"
    log: Any = print
    rows: dict[str, dict] = field(default_factory=dict)

    @property
    def protocol(self) -> dict[str, Any]:
        """What a row's numbers depend on; a row of another protocol is never mixed in."""
        return {"version": PROTOCOL_VERSION, "shape": self.shape.as_dict(), "batch": self.batch,
                "epochs": self.epochs, "full_steps": self.full_steps, "sweep_steps": self.sweep_steps,
                "corpus": self.corpus_id, "tokens": {k: int(v.numel()) for k, v in self.corpus.items()},
                "tt_headroom": TT_HEADROOM, "eval_points": self.eval_points} | (
            {"objective": self.objective} if self.objective != "clm" else {})

    @property
    def full_steps(self) -> int:
        return max(1, round(self.epochs * epoch_steps(self.corpus["train"].numel(), self.shape.seq, self.batch)))

    @property
    def sweep_steps(self) -> int:
        return max(1, self.full_steps // self.sweep_fraction)

    # ------------------------------------------------------------------ rows
    def row_path(self, key: str) -> Path:
        return self.run_dir / "rows" / f"{key}.json"

    def checkpoint_path(self, key: str) -> Path:
        return self.run_dir / "checkpoints" / f"{key}.ckpt"

    def finished(self, key: str) -> dict | None:
        """The finished row ``key``, read back and checked; ``None`` when it has not run."""
        if key in self.rows:
            return self.rows[key]
        path = self.row_path(key)
        row = read_row(path, self.protocol, MAX_ROW_BYTES, differs="model, batch, corpus or horizon")
        if row is None:
            return None
        if not (isinstance(row, dict) and row.get("key") == key and _finite_or_inf(row.get("valid_loss"))
                and _finite_or_inf(row.get("test_loss")) and isinstance(row.get("curve"), list)):
            raise ValueError(f"{path}: not a finished row {key!r}; delete it to run the row again")
        self.rows[key] = row
        return row

    def run(self, spec: RunSpec) -> dict:
        """Row ``spec.key``: read if finished, else trained (continuing a checkpoint) and written."""
        done = self.finished(spec.key)
        if done is not None:
            return done
        from tncompile.files import private_folder, write_replacing
        from tqdm import tqdm
        private_folder(self.run_dir / "rows")
        private_folder(self.run_dir / "checkpoints")
        with tqdm(total=spec.steps, desc=spec.key, leave=False, mininterval=10) as bar:
            row = train_run(spec, self.corpus, self.checkpoint_path(spec.key), self.device, self.checkpoint_s,
                            progress=bar.update)
        write_replacing(self.row_path(spec.key), json.dumps({"protocol": self.protocol, "row": row}))
        self.rows[spec.key] = row
        accuracy = f", test masked accuracy {row['test_accuracy']:.4f}" if "test_accuracy" in row else ""
        self.log(f"{spec.key}: valid ppl {_ppl(row['valid_loss']):.2f}, test ppl {_ppl(row['test_loss']):.2f}{accuracy}, "
                 f"{row['params_end']:,} parameters" + (" (diverged)" if row["diverged"] else ""))
        return row

    # --------------------------------------------------------------- phases
    def spec(self, phase: str, variant: str, lr: float, seed: int) -> RunSpec:
        full = phase == "full"   # sweep and ablation rows: the sweep's horizon, valid at the end only
        return RunSpec(key=f"{phase}-{variant}-lr{lr:.2e}-s{seed}", variant=variant, lr=lr, seed=seed,
                       steps=self.full_steps if full else self.sweep_steps, batch=self.batch, shape=self.shape,
                       eval_points=self.eval_points, curve_valid=full, objective=self.objective)

    def sweep(self, variant: str) -> float:
        """The best peak learning rate of ``variant`` (lowest valid loss over the grid, the
        grid extended past an edge that wins)."""
        grid = sorted(self.lr_grid)
        for extension in range(GRID_EXTENSIONS + 1):
            losses = {lr: self.run(self.spec("sweep", variant, lr, 0))["valid_loss"] for lr in grid}
            best = min(grid, key=lambda lr: losses[lr])
            if extension == GRID_EXTENSIONS or not math.isfinite(losses[best]):
                return best
            if best == grid[0]:
                grid.insert(0, grid[0] / 2)
            elif best == grid[-1]:
                grid.append(grid[-1] * 2)
            else:
                return best
        return best

    def sweep_table(self, variant: str) -> dict[str, float]:
        prefix = f"sweep-{variant}-lr"
        return {key[len(prefix):].split("-s")[0]: row["valid_loss"] for key, row in self.rows.items()
                if key.startswith(prefix)}

    def full(self, variants: list[str], best_lr: dict[str, float]) -> None:
        """The full runs, seed by seed (every variant's seed 0 first)."""
        for seed in range(max(seeds_of(v, self.objective) for v in variants)):
            for variant in variants:
                if seed < seeds_of(variant, self.objective):
                    self.run(self.spec("full", variant, best_lr[variant], seed))

    def ablations(self, bases: tuple[str, ...] = ABLATED, train: bool = True) -> list[dict]:
        """Each ablation of ``bases`` at its base's best swept learning rate (seed 0, the
        sweep's horizon) beside the base's own sweep row; bases not swept yet are left out.
        ``train=False``: only ablations whose rows are all finished (read, never trained)."""
        from pretrain_models import ABLATIONS
        out = []
        for base in bases:
            table = study_sweep_rows(self, base)
            if not table:
                if train:
                    self.log(f"ablation: {base} has no finished sweep yet; run its sweep first")
                continue
            lr = float(min(table, key=table.get))
            specs = {base + s: self.spec("ablation", base + s, lr, 0) for s in ABLATIONS}
            rows = {k: self.run(spec) if train else self.finished(spec.key) for k, spec in specs.items()}
            if all(r is not None for r in rows.values()):
                out.append({"base": base, "lr": lr, "valid_ppl": {base: _ppl(table[f"{lr:.2e}"])} | {
                    k: _ppl(r["valid_loss"]) for k, r in rows.items()}})
        return out

    def read_full_rows(self, variants: list[str], best_lr: dict[str, float]) -> None:
        """Read every finished full row of ``variants`` at their best rates into :attr:`rows`."""
        for variant in variants:
            if variant in best_lr:
                for seed in range(seeds_of(variant, self.objective)):
                    self.finished(self.spec("full", variant, best_lr[variant], seed).key)

    def full_rows(self, variant: str) -> list[dict]:
        return [row for key, row in sorted(self.rows.items()) if key.startswith(f"full-{variant}-lr")]


def _finite_or_inf(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (math.isfinite(x) or x == math.inf)


def _ppl(loss: float) -> float:
    return math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf


# ----------------------------------------------------------------- corpus
def load_corpus(data: Path, vocab: int, special_tokens: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], str]:
    """``({"train", "valid", "test"}: int64 ids, corpus id)``, the tokenizer trained on the
    train shards alone (``special_tokens`` reserve the first ids)."""
    from pretrain_corpus import corpus_key, corpus_tokenizer, encoded_split
    train_files = sorted(data.glob("train-*.txt"))
    if not train_files or not (data / "valid.txt").exists() or not (data / "test.txt").exists():
        raise FileNotFoundError(f"{data}: expected train-*.txt, valid.txt and test.txt (the python-code corpus); "
                                "pass --data")
    tokenizer = corpus_tokenizer(train_files, vocab, special_tokens=special_tokens)
    key = corpus_key(train_files, vocab, special_tokens)
    splits = {"train": torch.cat([encoded_split(tokenizer, f, key, vocab) for f in train_files]),
              "valid": encoded_split(tokenizer, data / "valid.txt", key, vocab),
              "test": encoded_split(tokenizer, data / "test.txt", key, vocab)}
    return splits, key


def count_baselines(study: Study) -> dict[str, float]:
    """Test perplexity of the count models (trigram weights fit on valid), cached in the run folder."""
    from count_baselines import CountBaselines
    from tncompile.files import read_bounded, write_replacing
    path = study.run_dir / "count_baselines.json"
    if path.exists():
        try:
            data = json.loads(read_bounded(path, 1 << 16))
            if data.get("protocol") == study.protocol and all(
                    isinstance(data["test_ppl"].get(k), float) for k in ("unigram", "bigram", "trigram")):
                return data["test_ppl"] | {"trigram_valid": data["trigram_valid"]}
        except (OSError, ValueError, AttributeError, KeyError):
            pass
    counts = CountBaselines.fit(study.corpus["train"], study.shape.vocab)
    counts.tune(study.corpus["valid"])
    test = {k: counts.perplexity(study.corpus["test"], k) for k in ("unigram", "bigram", "trigram")}
    valid = counts.perplexity(study.corpus["valid"], "trigram")
    write_replacing(path, json.dumps({"protocol": study.protocol, "test_ppl": test, "trigram_valid": valid}))
    return test | {"trigram_valid": valid}


# ----------------------------------------------------------------- timing
def time_variant(variant: str, shape: ModelShape, batch: int, checkpoint: Path | None, steps: int,
                 device: str, objective: str = "clm") -> dict[str, Any]:
    """One variant's training step in this process: median seconds of 10 steps after 3
    warm-ups, FLOPs per token of forward + backward, peak RSS. ``checkpoint``: time the
    model a finished run left (TT's end ranks)."""
    import resource
    from torch.utils.flop_counter import FlopCounterMode
    from pretrain_checkpoint import load_run
    from pretrain_loop import _step, train_batch
    from pretrain_models import build
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if checkpoint is not None:
        run, _ = load_run(checkpoint, variant, shape, 1e-3, steps, device, objective)
    else:
        run = build(variant, shape, 1e-3, 0, steps, device, objective)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(2, shape.vocab, (batch * (shape.seq + 1) * 2,), generator=g)
    x, y = train_batch(stream, 0, batch, shape.seq, 0, device, objective, shape.vocab)

    def one() -> float:
        began = time.perf_counter()
        _step(run, x, y, 0.1)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - began
    for _ in range(3):
        one()
    times = [one() for _ in range(10)]
    step_s = statistics.median(times)
    projection_s = None
    if variant == "galore":   # one step in 200 also recomputes each projection (an SVD per matrix)
        for state in run.optimizer.state.values():
            if "projector" in state:
                state["step"] = 200 * (state["step"] // 200 + 1)
        projection_s = one()
        step_s += (projection_s - step_s) / 200
    with FlopCounterMode(display=False) as counter:
        logits = run.model(input_ids=x).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                          ignore_index=-100).backward()
    run.optimizer.zero_grad(set_to_none=True)
    return {"variant": variant, "form": "end" if checkpoint is not None else "start", "params": run.params(),
            "step_s": step_s, "step_s_spread": [min(times), max(times)], "projection_step_s": projection_s,
            "tokens_per_s": batch * shape.seq / step_s,
            "flops_per_token": counter.get_total_flops() / (batch * shape.seq),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_model_mb": rss_before, "device": device}


def timing_pass(study: Study, variants: list[str], threads: int | None) -> list[dict]:
    """Each variant (and each TT variant's end form) timed in a fresh process."""
    from tncompile.testing import HostLoad
    jobs = []
    for variant in variants:
        jobs.append((variant, None))
        finished = [key for key in study.rows if key.startswith(f"full-{variant}-lr") and key.endswith("-s0")]
        if variant_kind(variant)[0] == "tt" and finished:   # TT's end ranks, from a finished run
            jobs.append((variant, study.checkpoint_path(finished[0])))
    results = []
    for variant, checkpoint in jobs:
        command = [sys.executable, __file__, "--time-one", variant, "--device", study.device,
                   "--run-dir", str(study.run_dir), "--shape", json.dumps(study.shape.as_dict()),
                   "--batch", str(study.batch), "--steps-for-time", str(study.full_steps),
                   "--objective", study.objective]
        if checkpoint is not None:
            command += ["--checkpoint", str(checkpoint)]
        if threads:
            command += ["--threads", str(threads)]
        with HostLoad() as load:
            out = subprocess.run(command, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"timing {variant} failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result["host_load"] = load.as_dict()
        study.log(f"time {variant} ({result['form']}): {result['step_s']:.3f} s a step, "
                  f"{result['tokens_per_s']:,.0f} tokens/s, {result['flops_per_token'] / 1e6:.1f} MFLOP/token, "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB" + (" [host busy]" if load.busy else ""))
        results.append(result)
    return results


# ----------------------------------------------------------------- report
def wall_axis(variant: str, curve: list[dict], timings: list[dict]) -> list[float] | None:
    """Seconds of training each curve point took at the timing pass's step times (TT's
    step time interpolated by its parameter count between its start and end forms);
    ``None`` without a timing of ``variant``."""
    mine = sorted((t for t in timings if t["variant"] == variant), key=lambda t: t["params"])
    if not mine:
        return None

    def step_time(params: float) -> float:
        if len(mine) == 1 or params >= mine[-1]["params"]:
            return mine[-1]["step_s"] if params >= mine[-1]["params"] else mine[0]["step_s"]
        if params <= mine[0]["params"]:
            return mine[0]["step_s"]
        share = (params - mine[0]["params"]) / (mine[-1]["params"] - mine[0]["params"])
        return mine[0]["step_s"] + share * (mine[-1]["step_s"] - mine[0]["step_s"])
    seconds, previous_step, previous_params, out = 0.0, 0, None, []
    for point in curve:
        params = point["params"] if previous_params is None else (point["params"] + previous_params) / 2
        seconds += (point["step"] - previous_step) * step_time(params)
        previous_step, previous_params = point["step"], point["params"]
        out.append(seconds)
    return out


def loss_at_wall(curve: list[dict], walls: list[float], seconds: float) -> float:
    """Valid loss at ``seconds`` of training, linear between curve points (the last point's
    loss past the end)."""
    points = [(w, p["valid_loss"]) for w, p in zip(walls, curve) if "valid_loss" in p]
    for (w0, l0), (w1, l1) in zip(points, points[1:]):
        if w1 >= seconds:
            return l0 + (l1 - l0) * max(0.0, seconds - w0) / max(w1 - w0, 1e-12)
    return points[-1][1] if points[0][0] < seconds else points[0][1]


def summarize(study: Study, variants: list[str], best_lr: dict[str, float], timings: list[dict],
              counts: dict[str, float]) -> tuple[list[dict], str]:
    """Rows of the summary table and the table as text."""
    rows, dense_ppl = [], None
    walls_done = {}
    for variant in variants:
        runs = study.full_rows(variant)
        if runs:
            walls = [wall_axis(variant, r["curve"], timings) for r in runs]
            if all(w is not None for w in walls):
                walls_done[variant] = statistics.mean(w[-1] for w in walls)
    equal_wall = min(walls_done.values()) if walls_done else None
    for variant in variants:
        runs = study.full_rows(variant)
        if not runs:
            continue
        test = [_ppl(r["test_loss"]) for r in runs]
        row = {"variant": variant, "lr": best_lr.get(variant), "seeds": len(runs), "devices": sorted({r["device"] for r in runs}),
               "params_start": statistics.mean(r["params_start"] for r in runs),
               "params_end": statistics.mean(r["params_end"] for r in runs),
               "tokens": runs[0]["tokens"], "test_ppl": statistics.mean(test), "test_ppl_min": min(test),
               "test_ppl_max": max(test), "test_ppl_seeds": test,
               "valid_ppl": statistics.mean(_ppl(r["valid_loss"]) for r in runs)}
        if all("test_accuracy" in r for r in runs):
            accuracy = [r["test_accuracy"] for r in runs]
            row |= {"test_accuracy": statistics.mean(accuracy), "test_accuracy_min": min(accuracy),
                    "test_accuracy_max": max(accuracy), "test_accuracy_seeds": accuracy}
        timing = [t for t in timings if t["variant"] == variant]
        if timing:
            start = min(timing, key=lambda t: -t["params"])
            row |= {"step_s": start["step_s"], "tokens_per_s": start["tokens_per_s"],
                    "flops_per_token": start["flops_per_token"], "peak_rss_mb": start["peak_rss_mb"]}
            if len(timing) > 1:
                end = min(timing, key=lambda t: t["params"])
                row |= {"step_s_end": end["step_s"], "flops_per_token_end": end["flops_per_token"]}
        if equal_wall is not None and variant in walls_done:
            walls = [wall_axis(variant, r["curve"], timings) for r in runs]
            row["valid_ppl_at_equal_wall"] = statistics.mean(
                _ppl(loss_at_wall(r["curve"], w, equal_wall)) for r, w in zip(runs, walls))
            row["train_s"] = walls_done[variant]
        if variant == "dense":
            dense_ppl = row["test_ppl"]
        rows.append(row)
    dense_accuracy = next((r.get("test_accuracy") for r in rows if r["variant"] == "dense"), None)
    for row in rows:
        row["test_ppl_vs_dense"] = row["test_ppl"] / dense_ppl if dense_ppl else None
        if dense_accuracy is not None and "test_accuracy" in row:
            row["test_accuracy_points_vs_dense"] = 100 * (row["test_accuracy"] - dense_accuracy)
    scored = "masked tokens of the " if study.objective == "mlm" else ""
    lines = [f"test perplexity, {scored}whole test split ({study.corpus['test'].numel():,} tokens), after "
             f"{study.full_steps} steps = {rows[0]['tokens'] / 1e6 if rows else 0:.2f}M tokens"
             + (f"; equal wall time = {equal_wall:.0f} s (timing pass)" if equal_wall else ""),
             f"{'variant':<12} {'lr':>8} {'seeds':>5} {'params':>14} {'test ppl':>20} {'x dense':>8} "
             f"{'ppl @ equal wall':>17} {'step s':>7} {'MFLOP/tok':>10}"]
    for row in rows:
        spread = f"{row['test_ppl']:.2f} [{row['test_ppl_min']:.2f}, {row['test_ppl_max']:.2f}]"
        lines.append(f"{row['variant']:<12} {row['lr']:>8.2e} {row['seeds']:>5} "
                     f"{row['params_start'] / 1e6:>5.2f}->{row['params_end'] / 1e6:<5.2f}M {spread:>20} "
                     f"{row['test_ppl_vs_dense'] or 0:>8.3f} {row.get('valid_ppl_at_equal_wall', math.nan):>17.2f} "
                     f"{row.get('step_s', math.nan):>7.3f} {row.get('flops_per_token', math.nan) / 1e6:>10.1f}")
    for row in rows:
        if "test_accuracy" in row:
            lines.append(f"{row['variant']}: masked-token accuracy on test {100 * row['test_accuracy']:.2f}% "
                         f"[{100 * row['test_accuracy_min']:.2f}, {100 * row['test_accuracy_max']:.2f}]"
                         + (f", {row['test_accuracy_points_vs_dense']:+.2f} points against dense"
                            if "test_accuracy_points_vs_dense" in row else ""))
    if counts:
        lines.append(f"count baselines, test perplexity: trigram {counts['trigram']:.2f} (valid "
                     f"{counts['trigram_valid']:.2f}), bigram {counts['bigram']:.2f}, unigram {counts['unigram']:.2f}")
        if dense_ppl:
            lines.append(f"dense against the count trigram on test: {dense_ppl:.2f} vs {counts['trigram']:.2f} "
                         f"({100 * (dense_ppl / counts['trigram'] - 1):+.1f}%)")
    return rows, "\n".join(lines)


def plot(study: Study, variants: list[str], timings: list[dict], counts: dict[str, float], path: Path) -> None:
    """Valid perplexity against tokens and against the timing pass's wall seconds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, variant in enumerate(variants):
        for j, run in enumerate(study.full_rows(variant)):
            points = [p for p in run["curve"] if "valid_loss" in p]
            label = variant if j == 0 else None
            axes[0].plot([p["tokens"] / 1e6 for p in points], [_ppl(p["valid_loss"]) for p in points],
                         color=f"C{i}", alpha=0.8, label=label)
            walls = wall_axis(variant, run["curve"], timings)
            if walls is not None:
                keep = [w for w, p in zip(walls, run["curve"]) if "valid_loss" in p]
                axes[1].plot(keep, [_ppl(p["valid_loss"]) for p in points], color=f"C{i}", alpha=0.8, label=label)
    for ax in axes:
        if counts:
            ax.axhline(counts["trigram_valid"], color="gray", ls="--", lw=1, label="count trigram")
        ax.set_yscale("log")
        ax.set_ylabel("valid perplexity")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_xlabel("training tokens (millions)")
    axes[1].set_xlabel(f"training seconds at the timing pass's step times ({study.device})")
    axes[0].legend()
    model = "RoBERTa-style masked LM" if study.objective == "mlm" else "Llama-style causal LM"
    fig.suptitle(f"{model} on the CPython stdlib, each variant at its best learning rate")
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--phases", default="sweep,full,report",
                   help="comma list of sweep, full, time, report, ablation")
    p.add_argument("--objective", default="clm", choices=("clm", "mlm"),
                   help="clm: the Llama study; mlm: the masked-LM case (its own variants, folder and files)")
    p.add_argument("--variants", default=None, help=f"default {','.join(VARIANTS)} (mlm: {','.join(MLM_VARIANTS)})")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--run-dir", default=None, help="default runs/pretrain (mlm: runs/pretrain-mlm)")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--results", default=str(RESULTS), help="folder of pretrain.json and pretrain.png")
    p.add_argument("--shape", default=None, help=argparse_hidden())
    p.add_argument("--time-one", default=None, help=argparse_hidden())
    p.add_argument("--checkpoint", default=None, help=argparse_hidden())
    p.add_argument("--steps-for-time", type=int, default=None, help=argparse_hidden())
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    mlm = args.objective == "mlm"
    shape = ModelShape(**json.loads(args.shape)) if args.shape else ModelShape(vocab=args.vocab,
                                                                               ffn=MLM_FFN if mlm else 688)
    if args.time_one:   # one timing job, in its own process
        checkpoint = Path(args.checkpoint) if args.checkpoint else None
        print(json.dumps(time_variant(args.time_one, shape, args.batch, checkpoint, args.steps_for_time,
                                      args.device, args.objective)))
        return
    variants = [v for v in (args.variants or ",".join(MLM_VARIANTS if mlm else VARIANTS)).split(",") if v]
    run_dir = Path(args.run_dir or ("runs/pretrain-mlm" if mlm else "runs/pretrain"))
    for v in variants:
        variant_kind(v)
    phases = set(args.phases.split(","))
    unknown = phases - {"sweep", "full", "time", "report", "ablation"}
    if unknown:
        raise SystemExit(f"--phases: unknown {sorted(unknown)}; choose among sweep, full, time, report, ablation")
    corpus, corpus_id = load_corpus(Path(args.data), args.vocab, MLM_SPECIAL_TOKENS if mlm else ())
    study = Study(corpus, shape, args.batch, args.epochs, run_dir, args.device, corpus_id,
                  checkpoint_s=60 * args.checkpoint_minutes, objective=args.objective)
    print(f"corpus: {corpus['train'].numel():,} train, {corpus['valid'].numel():,} valid, "
          f"{corpus['test'].numel():,} test tokens; {study.full_steps} steps a full run, {study.sweep_steps} a "
          f"sweep run; rows in {study.run_dir}", flush=True)
    best_lr = {}
    for variant in variants:   # the sweep runs in the sweep and full phases; the others read its rows
        if phases & {"sweep", "full"}:
            best_lr[variant] = study.sweep(variant)
        else:
            table = {float(k): v for k, v in study_sweep_rows(study, variant).items()}
            if table:
                best_lr[variant] = min(table, key=table.get)
        if variant in best_lr:
            print(f"{variant}: best peak lr {best_lr[variant]:.2e}", flush=True)
    if "full" in phases:
        study.full(variants, best_lr)
    if "ablation" in phases:
        for entry in study.ablations():
            print(f"ablation at {entry['base']}'s best lr {entry['lr']:.2e} (valid ppl after {study.sweep_steps} "
                  "steps): " + ", ".join(f"{k} {v:.2f}" for k, v in entry["valid_ppl"].items()), flush=True)
    timing_file = study.run_dir / "timing.json"
    if "time" in phases:
        study.read_full_rows(variants, best_lr)
        timings = timing_pass(study, variants, args.threads)
        from tncompile.files import write_replacing
        write_replacing(timing_file, json.dumps({"protocol": study.protocol, "machine": machine(args.device),
                                                 "timings": timings}))
    if "report" in phases:
        report(study, variants, best_lr, timing_file, args)


def argparse_hidden() -> str:
    import argparse
    return argparse.SUPPRESS


def study_sweep_rows(study: Study, variant: str) -> dict[str, float]:
    """Valid loss by learning rate of ``variant``'s finished sweep rows (read from the run folder)."""
    folder = study.run_dir / "rows"
    for path in sorted(folder.glob(f"sweep-{variant}-lr*-s0.json")) if folder.exists() else []:
        study.finished(path.stem)
    return study.sweep_table(variant)


def report(study: Study, variants: list[str], best_lr: dict[str, float], timing_file: Path, args) -> None:
    from tncompile.files import read_bounded
    study.read_full_rows(variants, best_lr)
    timings, timing_machine = [], None
    if timing_file.exists():
        data = json.loads(read_bounded(timing_file, MAX_ROW_BYTES))
        if data.get("protocol") == study.protocol:
            timings, timing_machine = data["timings"], data["machine"]
    counts = count_baselines(study) if study.objective == "clm" else {}
    rows, table = summarize(study, variants, best_lr, timings, counts)
    print(table)
    sweeps = {v: {k: _ppl(loss) for k, loss in study_sweep_rows(study, v).items()} for v in variants}
    ablations = study.ablations(train=False)
    for entry in ablations:
        print(f"ablation at {entry['base']}'s best lr {entry['lr']:.2e}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in entry["valid_ppl"].items()))
    print("sweep (valid perplexity after", study.sweep_steps, "steps):",
          json.dumps({v: {k: round(x, 2) for k, x in t.items()} for v, t in sweeps.items()}))
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    stem = "pretrain_mlm" if study.objective == "mlm" else "pretrain"
    plot(study, variants, timings, counts, results / f"{stem}.png")
    path = results / f"{stem}.json"
    write_result(path, {
        "machine": machine(args.device), "timing_machine": timing_machine, "protocol": study.protocol,
        "command": "python benchmarks/bench_pretrain.py " + " ".join(sys.argv[1:]),
        "count_baselines_test_ppl": counts, "sweep_valid_ppl": sweeps, "best_lr": best_lr, "ablations": ablations,
        "summary": rows, "table": table, "timings": timings,
        "runs": [study.rows[k] for k in sorted(study.rows) if k.startswith("full-")]})
    print("wrote", path, "and", results / f"{stem}.png")


if __name__ == "__main__":
    main()
