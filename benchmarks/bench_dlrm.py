"""The recommender case (issue 67): a DLRM on Criteo compressed about 99x, against dense.

    python benchmarks/bench_dlrm.py                               # every phase, then the report
    python benchmarks/bench_dlrm.py --phases quality              # log-loss / AUC and RMSE over seeds
    python benchmarks/bench_dlrm.py --phases measure              # memory and step time: on a quiet machine
    python benchmarks/bench_dlrm.py --phases report               # the table and dlrm.json from the rows

**Model** (:mod:`dlrm_model`): DLRM as the reference implementation's Kaggle configuration
writes it -- bottom MLP 13-512-256-64-16 over the log-transformed counts, 26
``nn.EmbeddingBag`` tables of 16 columns (sum bags, ``sparse=True``, drawn U(+-1/sqrt(rows))),
each field's values hashed into ``--buckets`` rows (DLRM's ``max-ind-range``; default
1,000,000, so the tables hold 416M of the model's 416.5M parameters, 1.66 GB in fp32), dot
interactions, top MLP 367-512-256-1.

**Variants**, each with the optimizer its user takes:

* ``dense-sgd``: the tables' gradients sparse, plain SGD (the reference implementation's);
* ``dense-adagrad``: the tables' gradients sparse, Adagrad (a dense accumulator per table);
* ``tt``: ``tncompile.compile(..., init="random")`` of the whole model at 1.5x the target
  (``--ratio``, default 1/99 of dense's parameters), then tncompile's default rank-adaptive
  schedule (``RankController``, budget schedule) cuts it to the target; Adagrad;
* ``tt-tables``: the same with only the tables compressed (the MLPs dense);
* ``tt-fused`` (size, memory and step time only): ``tt`` with the fused Adagrad
  (``tncompile.param_groups(..., implementation="fused")``; ``tt`` takes its default, ``"foreach"``), which
  its dense gradients allow and a sparse-gradient table's do not; the same update as
  ``tt``'s up to rounding, so its quality is ``tt``'s.

**Protocol.** Criteo's sample (``../shared/data/criteo/train_head10800.txt``) is its first
900 lines twelve times over, so only its 900 distinct rows are used (split as it is, every
test row would be a training row, and a model scores log-loss 0.0001). They are split in
file order: the first 80% train (720), the next 10% valid, the last 10% test (90 rows
each). Batch 128. Each variant's learning rate and epochs (2 or 8) are chosen on the valid
split's log-loss at seed 0 over its grid (SGD 0.03 / 0.1 / 0.3, Adagrad 0.01 / 0.03 / 0.1),
the rate extended past a winning edge by 3x, twice at most; then 5 seeds at that choice (a
seed draws every initialization, TT's cores included, and the batch order), scored on the
whole test split: log-loss, ROC AUC, and the log-loss of always predicting the train
split's positive rate (how much was learned at all). 90 test rows cannot separate models
that close: the report says so, and MovieLens is the quality check that can.

**MovieLens-100k** (``--datasets movielens``), a second, independent check: the same DLRM
class on the user, movie and occupation tables (32 columns) with age, gender and genre
features, ratings regressed (MSE) on ``u1.base`` (its last 10%, drawn by seed 0, as
valid), scored by RMSE on ``u1.test`` beside predicting the mean rating. 3 epochs at batch
256 (the grid's only value), Adam (grid 1e-3 / 3e-3 / 1e-2), dense against ``tt`` at each
of ``--ml-ratios`` (default 0.1 and 0.3: these tables are 30k and 54k weights, 1/99 of
which leaves rank 1). The MLPs here are under compile's 4,096-weight floor, so ``tt`` is
the tables-only variant too.

**Measure** (``--phases measure``; a quiet machine): each variant, each batch of
``--batches`` (default 128 and 2048), in a fresh process: peak memory -- the process's
peak resident set from the start of training (reset after the model and optimizer are
built, the compressed variants' dense model already freed) over 3 warm-up and 15 timed
steps, and the same less the process's own overhead (its resident set at that start
less the bytes of the parameters, buffers and optimizer state then held: the CPU's analogue
of ``torch.cuda.max_memory_allocated``) -- and the median time of a whole training step
(forward, loss, backward, optimizer; at the TT variants' start ranks also the rank
controller's penalty and step, with no cut during the measurement). The TT variants are
measured at their start ranks (1.5x the target, the first part of training) and at the
target (after the last cut, without the controller). The last round also profiles 3 more
steps (``torch.profiler``: the top operators by their own CPU time). Two rounds; each figure is
the lower of its two.

Rows are files in ``--run-dir`` (default ``runs/dlrm``): a finished row is never rerun.
``benchmarks/results/dlrm.json`` holds the report.
"""
from __future__ import annotations

import gc
import json
import math
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, parser, read_row, write_result  # noqa: E402
from dlrm_model import DLRM, CriteoRows, batch_inputs, read_criteo  # noqa: E402
from recsys_metrics import base_rate_log_loss, log_loss, rmse, roc_auc  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CRITEO_VARIANTS = ("dense-sgd", "dense-adagrad", "tt", "tt-tables")
#: measured only (size, memory, step time): ``tt`` with PyTorch's fused Adagrad, which its dense
#: gradients allow (a sparse-gradient table's optimizer cannot fuse); the same update up to rounding
MEASURED_ONLY = ("tt-fused",)
MOVIELENS_VARIANTS = ("dense", "tt")
GRIDS = {"sgd": (0.03, 0.1, 0.3), "adagrad": (0.01, 0.03, 0.1), "adam": (1e-3, 3e-3, 1e-2)}
GRID_STEP, GRID_EXTENSIONS = 3.0, 2
TT_HEADROOM = 1.5
SEEDS = {"criteo": 5, "movielens": 3}
PROTOCOL_VERSION = 1
MAX_ROW_BYTES = 4 << 20


@dataclass(frozen=True)
class Case:
    """One data set's model, splits and training recipe."""
    name: str
    train: CriteoRows
    valid: CriteoRows
    test: CriteoRows
    dense_features: int
    table_rows: tuple[int, ...]
    dim: int
    bottom: tuple[int, ...]
    top: tuple[int, ...]
    batch: int
    epoch_grid: tuple[int, ...]
    ratio: float
    regression: bool
    file_rows: int = 0

    def steps(self, epochs: int) -> int:
        return epochs * math.ceil(len(self.train) / self.batch)

    @property
    def protocol(self) -> dict[str, Any]:
        return {"version": PROTOCOL_VERSION, "case": self.name, "rows": [len(self.train), len(self.valid),
                len(self.test)], "tables": list(self.table_rows), "dim": self.dim, "bottom": list(self.bottom),
                "top": list(self.top), "batch": self.batch, "epoch_grid": list(self.epoch_grid), "ratio": self.ratio,
                "tt_headroom": TT_HEADROOM}

    def model(self, seed: int, sparse: bool) -> DLRM:
        torch.manual_seed(seed)
        return DLRM(self.dense_features, list(self.table_rows), dim=self.dim, bottom=self.bottom, top=self.top,
                    sparse=sparse)


def criteo_case(data: Path, buckets: int, ratio: float) -> Case:
    path = data / "criteo" / "train_head10800.txt"
    with open(path, "rb") as f:
        file_rows = sum(1 for _ in f)
    rows = read_criteo(path, buckets, distinct=True)
    n = len(rows)
    cut_valid, cut_test = int(0.8 * n), int(0.9 * n)
    split = [rows.take(torch.arange(a, b)) for a, b in ((0, cut_valid), (cut_valid, cut_test), (cut_test, n))]
    return Case("criteo", *split, dense_features=13, table_rows=(buckets,) * 26, dim=16, bottom=(512, 256, 64),
                top=(512, 256), batch=128, epoch_grid=(2, 8), ratio=ratio, regression=False, file_rows=file_rows)


def movielens_case(data: Path, ratio: float) -> Case:
    from movielens_data import DENSE_FEATURES, read_movielens, table_sizes
    folder = data / "movielens-100k"
    base, test = read_movielens(folder)
    order = torch.randperm(len(base), generator=torch.Generator().manual_seed(0))
    cut = int(0.9 * len(base))
    return Case(f"movielens-r{ratio:g}", base.take(order[:cut]), base.take(order[cut:]), test, dense_features=DENSE_FEATURES,
                table_rows=tuple(table_sizes(folder)), dim=32, bottom=(64,), top=(64,), batch=256, epoch_grid=(3,),
                ratio=ratio, regression=True, file_rows=len(base) + len(test))


# ------------------------------------------------------------------ a variant
def optimizer_kind(case: Case, variant: str) -> str:
    if case.regression:
        return "adam"
    return "sgd" if variant == "dense-sgd" else "adagrad"


def compressed(variant: str) -> bool:
    return variant.startswith("tt")


@dataclass
class Trainee:
    """A variant ready to train: model, optimizer, rank controller (TT only)."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    controller: Any = None
    compile_s: float = 0.0
    report: Any = None


def build(case: Case, variant: str, lr: float, seed: int, ranks: str = "start",
          schedule_steps: int | None = None) -> Trainee:
    """``variant`` of ``case`` drawn from ``seed`` with its optimizer at ``lr``. ``ranks``:
    ``"start"`` compiles a TT variant at its headroom and schedules its cuts over
    ``schedule_steps`` (``None``: no cuts); ``"end"`` compiles it at the target."""
    import tncompile
    kind = optimizer_kind(case, variant)
    sparse = not case.regression                 # the Criteo user's tables: sparse gradients
    if not compressed(variant):
        model = case.model(seed, sparse)
        params = model.parameters()
        opt = {"sgd": lambda: torch.optim.SGD(params, lr=lr), "adagrad": lambda: torch.optim.Adagrad(params, lr=lr),
               "adam": lambda: torch.optim.Adam(params, lr=lr)}[kind]()
        return Trainee(model, opt)
    dense = case.model(seed, sparse)
    fused = variant == "tt-fused"
    options: dict[str, Any] = {"target_modules": "re:tables\\..*"} if variant == "tt-tables" else {}
    ratio = case.ratio if ranks == "end" else min(1.0, TT_HEADROOM * case.ratio)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # speed notes: the report keeps them
        model = tncompile.compile(dense, target_ratio=ratio, init="random", seed=seed,
                                  example_inputs=batch_inputs(case.train.take(torch.arange(case.batch))), **options)
    compile_s = time.perf_counter() - start
    del dense
    gc.collect()
    groups = tncompile.param_groups(model, lr=lr, implementation="fused" if fused else "foreach")
    opt = torch.optim.Adam(groups, lr=lr) if kind == "adam" else torch.optim.Adagrad(groups, lr=lr)
    if ranks == "end":                            # at the target: the cuts are done
        controller = None
    elif schedule_steps is None:                  # measured as it trains, with no cut in the way
        controller = tncompile.RankController(model, opt, target_ratio=case.ratio, truncate_every=0)
    else:
        controller = tncompile.RankController(model, opt, target_ratio=case.ratio,
                                              early_steps=schedule_steps // 3, late_steps=schedule_steps // 3,
                                              truncate_every=max(10, schedule_steps // 20))
    return Trainee(model, opt, controller, compile_s)


def loss_of(case: Case, out: torch.Tensor, labels: torch.Tensor, offset: float) -> torch.Tensor:
    if case.regression:
        return nn.functional.mse_loss(out + offset, labels)
    return nn.functional.binary_cross_entropy_with_logits(out, labels)


def train_step(case: Case, trainee: Trainee, batch: CriteoRows, offset: float) -> float:
    loss = loss_of(case, trainee.model(*batch_inputs(batch)), batch.labels, offset)
    total = loss + trainee.controller.penalty(loss) if trainee.controller is not None else loss
    trainee.optimizer.zero_grad(set_to_none=True)
    total.backward()
    trainee.optimizer.step()
    if trainee.controller is not None:
        trainee.controller.step()
    return loss.item()


@torch.no_grad()
def predict(case: Case, model: nn.Module, rows: CriteoRows, offset: float) -> torch.Tensor:
    outs = [model(*batch_inputs(rows.take(torch.arange(a, min(a + 1024, len(rows))))))
            for a in range(0, len(rows), 1024)]
    return torch.cat(outs) + offset


def scores(case: Case, model: nn.Module, rows: CriteoRows, offset: float) -> dict[str, float]:
    out = predict(case, model, rows, offset)
    if case.regression:
        return {"rmse": rmse(out.clamp(1, 5), rows.labels)}
    return {"log_loss": log_loss(out, rows.labels), "auc": roc_auc(out, rows.labels)}


def quality_run(case: Case, variant: str, lr: float, epochs: int, seed: int) -> dict[str, Any]:
    """Train ``variant`` for ``epochs``; its valid and test scores."""
    start = time.perf_counter()
    trainee = build(case, variant, lr, seed, schedule_steps=case.steps(epochs))
    offset = case.train.labels.mean().item() if case.regression else 0.0
    params_start = sum(p.numel() for p in trainee.model.parameters())
    order = torch.Generator().manual_seed(seed)
    losses = []
    trainee.model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(case.train), generator=order)
        for a in range(0, len(perm), case.batch):
            losses.append(train_step(case, trainee, case.train.take(perm[a:a + case.batch]), offset))
    trainee.model.eval()
    row = {"variant": variant, "lr": lr, "epochs": epochs, "seed": seed, "params_start": params_start,
           "params_end": sum(p.numel() for p in trainee.model.parameters()),
           "valid": scores(case, trainee.model, case.valid, offset),
           "test": scores(case, trainee.model, case.test, offset),
           "train_loss_last_tenth": statistics.fmean(losses[-max(1, len(losses) // 10):]),
           "diverged": not all(math.isfinite(x) for x in losses), "compile_s": trainee.compile_s,
           "wall_s_under_load": time.perf_counter() - start}
    if compressed(variant):
        row["tables"] = table_rows(trainee.model.report())
    return row


def table_rows(report) -> list[dict[str, Any]]:
    """Each compressed table's row of ``report()``: its compression and its lookup way."""
    return [{"name": r.name, "format": r.format, "modes": r.modes, "ranks": r.ranks, "dense_params": r.dense_params,
             "params": r.params, "ran_as": r.ran_as} for r in report.rows if r.name.startswith("tables.")]


# ------------------------------------------------------------------ rows
@dataclass
class Rows:
    """Finished quality rows, one JSON file each in ``folder``, checked against ``protocol``."""
    folder: Path
    protocol: dict[str, Any]
    cache: dict[str, dict] = field(default_factory=dict)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def get(self, key: str) -> dict | None:
        if key in self.cache:
            return self.cache[key]
        path = self.path(key)
        row = read_row(path, self.protocol, MAX_ROW_BYTES)
        if row is None:
            return None
        if not (isinstance(row, dict) and isinstance(row.get("valid"), dict) and isinstance(row.get("test"), dict)):
            raise ValueError(f"{path}: not a finished row; delete it to run the row again")
        self.cache[key] = row
        return row

    def run(self, key: str, make: Callable[[], dict]) -> dict:
        done = self.get(key)
        if done is not None:
            return done
        from tncompile.files import private_folder, write_replacing
        row = make()
        private_folder(self.folder)
        write_replacing(self.path(key), json.dumps({"protocol": self.protocol, "row": row}))
        self.cache[key] = row
        return row


def selection_score(case: Case, row: dict) -> float:
    value = row["valid"]["rmse" if case.regression else "log_loss"]
    return value if math.isfinite(value) else math.inf


def row_key(case: Case, variant: str, lr: float, epochs: int, seed: int) -> str:
    return f"{case.name}-{variant}-lr{lr:.2e}-e{epochs}-s{seed}"


def sweep(case: Case, variant: str, rows: Rows, log: Callable[[str], None] = print) -> tuple[float, int]:
    """The variant's ``(learning rate, epochs)``: best valid score at seed 0 over its grid,
    the rate extended past a winning edge."""
    grid = sorted(GRIDS[optimizer_kind(case, variant)])
    found: dict[tuple[float, int], float] = {}
    for extension in range(GRID_EXTENSIONS + 1):
        for lr in grid:
            for epochs in case.epoch_grid:
                if (lr, epochs) not in found:
                    key = row_key(case, variant, lr, epochs, 0)
                    row = rows.run(key, lambda lr=lr, epochs=epochs: quality_run(case, variant, lr, epochs, 0))
                    found[lr, epochs] = selection_score(case, row)
                    log(f"{key}: valid {found[lr, epochs]:.4f}")
        best = min(found, key=found.get)
        if extension == GRID_EXTENSIONS or not math.isfinite(found[best]):
            return best
        if best[0] == grid[0]:
            grid.insert(0, grid[0] / GRID_STEP)
        elif best[0] == grid[-1]:
            grid.append(grid[-1] * GRID_STEP)
        else:
            return best
    return best


def sweep_rows(case: Case, variant: str, rows: Rows) -> list[dict]:
    """The variant's finished seed-0 rows (its sweep)."""
    found = []
    for path in sorted(rows.folder.glob(f"{case.name}-{variant}-lr*-s0.json")):
        row = rows.get(path.stem)
        if row is not None and row["variant"] == variant:
            found.append(row)
    return found


def swept_choice(case: Case, variant: str, rows: Rows) -> tuple[float, int] | None:
    """The best ``(rate, epochs)`` among the variant's finished seed-0 rows (the report's reading)."""
    found = {(r["lr"], r["epochs"]): selection_score(case, r) for r in sweep_rows(case, variant, rows)}
    return min(found, key=found.get) if found else None


def seed_rows(case: Case, variant: str, choice: tuple[float, int], rows: Rows, train: bool,
              log: Callable[[str], None] = print) -> list[dict]:
    out = []
    lr, epochs = choice
    for seed in range(SEEDS[case.name.split("-")[0]]):
        key = row_key(case, variant, lr, epochs, seed)
        row = (rows.run(key, lambda seed=seed: quality_run(case, variant, lr, epochs, seed)) if train
               else rows.get(key))
        if row is not None:
            out.append(row)
            if train:
                log(f"{key}: test {json.dumps(row['test'])}")
    return out


# ------------------------------------------------------------------ measure (fresh processes)
def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:   # Linux: VmHWM := VmRSS
        f.write("5")


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, buffers, gradients and optimizer state ``model`` holds."""
    seen, total = set(), 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if t.is_sparse:
            add(t._values())
            add(t._indices())
        elif id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for t in [*model.parameters(), *model.buffers()]:
        add(t)
        if t.grad is not None:
            add(t.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    return total


def measure_one(case: Case, variant: str, ranks: str, batch: int, lr: float, warmup: int = 3,
                reps: int = 15, profile: bool = False) -> dict[str, Any]:
    """One variant at one batch, in this (fresh) process: peak memory from the start of
    training and the median step (see the module's docstring)."""
    rss_imports_kb = _status_kb("VmRSS")
    trainee = build(case, variant, lr, seed=0, ranks=ranks)
    gc.collect()
    g = torch.Generator().manual_seed(0)
    batches = [case.train.take(torch.randint(0, len(case.train), (batch,), generator=g)) for _ in range(4)]
    held = state_bytes(trainee.model, trainee.optimizer)
    rss_start_kb, build_peak_kb = _status_kb("VmRSS"), _status_kb("VmHWM")
    _reset_peak()
    times = []
    for i in range(warmup + reps):
        start = time.perf_counter()
        train_step(case, trainee, batches[i % len(batches)], 0.0)
        times.append(time.perf_counter() - start)
    peak_kb = _status_kb("VmHWM")
    overhead_kb = rss_start_kb - held / 1024
    profiled = profile_steps(case, trainee, batches, steps=3) if profile else None
    return {"variant": variant, "ranks": ranks if compressed(variant) else "", "batch": batch,
            "params": sum(p.numel() for p in trainee.model.parameters()),
            "step_ms": 1000 * statistics.median(times[warmup:]), "peak_rss_mb": peak_kb / 1024,
            "train_mb": (peak_kb - overhead_kb) / 1024, "held_at_start_mb": held / 2**20,
            "held_at_end_mb": state_bytes(trainee.model, trainee.optimizer) / 2**20,
            "rss_after_imports_mb": rss_imports_kb / 1024, "build_peak_rss_mb": build_peak_kb / 1024,
            "compile_s": trainee.compile_s, "threads": torch.get_num_threads(),
            **({"profile": profiled} if profiled is not None else {}),
            **({"other_layers": [{"name": r.name, "format": r.format, "params": r.params, "note": r.note}
                                 for r in trainee.model.report().rows if not r.name.startswith("tables.")]}
               if compressed(variant) else {})}


def profile_steps(case: Case, trainee: Trainee, batches: list[CriteoRows], steps: int,
                  top: int = 12) -> list[dict[str, Any]]:
    """The ``top`` operators by their own CPU time over ``steps`` more training steps
    (``torch.profiler``), per step: what a step's time goes to."""
    from torch.profiler import profile
    with profile() as prof:
        for i in range(steps):
            train_step(case, trainee, batches[i % len(batches)], 0.0)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / steps,
             "calls_per_step": e.count / steps} for e in rows]


def measure(case_args: list[str], lrs: dict[str, float], batches: list[int], rounds: int = 2,
            log: Callable[[str], None] = print) -> list[dict]:
    """Every variant (TT at start and end ranks) at every batch, each in a fresh process,
    ``rounds`` times; each figure the lower of its rounds."""
    jobs = [(v, r, b) for b in batches for v in CRITEO_VARIANTS + MEASURED_ONLY
            for r in (("start", "end") if compressed(v) else ("",))]
    found: dict[tuple, list[dict]] = {}
    from tqdm import tqdm
    for round_ in range(rounds):
        for variant, ranks, batch in tqdm(jobs, desc="measure", leave=False):
            cmd = [sys.executable, __file__, "--measure-one", variant, "--ranks", ranks or "start", "--batch",
                   str(batch), "--lr", repr(lrs[variant]), *case_args, *(["--profile"] if round_ == rounds - 1 else [])]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"measuring {variant} at batch {batch} failed:\n{out.stderr[-3000:]}")
            found.setdefault((variant, ranks, batch), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = []
    for key, runs in found.items():
        best = min(runs, key=lambda r: r["step_ms"])
        result.append(best | {"step_ms_rounds": [r["step_ms"] for r in runs], "profile": runs[-1].get("profile"),
                              "train_mb": min(r["train_mb"] for r in runs),
                              "peak_rss_mb": min(r["peak_rss_mb"] for r in runs)})
        log(f"{key}: {best['step_ms']:.1f} ms a step, training memory {result[-1]['train_mb']:.0f} MB "
            f"(process peak {result[-1]['peak_rss_mb']:.0f} MB)")
    return result


# ------------------------------------------------------------------ report
def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def case_report(case: Case, variants: tuple[str, ...], rows: Rows) -> dict[str, Any]:
    out: dict[str, Any] = {"protocol": case.protocol, "rows_in_files": case.file_rows,
                           "rows_used": len(case.train) + len(case.valid) + len(case.test), "variants": {}}
    if case.regression:
        mean = case.train.labels.mean()
        out["mean_rating_rmse"] = rmse(torch.full_like(case.test.labels, mean.item()), case.test.labels)
    else:
        out["base_rate_log_loss"] = base_rate_log_loss(case.train.labels, case.test.labels)
        out["test_positive_rate"] = case.test.labels.mean().item()
    for variant in variants:
        choice = swept_choice(case, variant, rows)
        if choice is None:
            continue
        found = seed_rows(case, variant, choice, rows, train=False)
        metrics = ("rmse",) if case.regression else ("log_loss", "auc")
        out["variants"][variant] = {
            "lr": choice[0], "epochs": choice[1], "seeds": len(found), "params_start": found[0]["params_start"],
            "params_end": statistics.fmean(r["params_end"] for r in found),
            "optimizer": optimizer_kind(case, variant),
            "test": {m: spread([r["test"][m] for r in found]) for m in metrics},
            "sweep": {f"lr {r['lr']:.2e}, {r['epochs']} epochs": selection_score(case, r)
                      for r in sweep_rows(case, variant, rows)},
            **({"tables": found[0]["tables"]} if "tables" in found[0] else {})}
    return out


def print_table(report: dict[str, Any]) -> None:
    for name, case in report["cases"].items():
        regression = "mean_rating_rmse" in case
        head = "test RMSE" if regression else "test log-loss        AUC"
        print(f"\n{name}: {'mean rating' if regression else 'base rate'} "
              f"{case.get('mean_rating_rmse', case.get('base_rate_log_loss')):.4f}")
        print(f"{'variant':<15}{'optimizer':<10}{'lr':>9}{'epochs':>7}{'params':>14}  {head}")
        for variant, v in case["variants"].items():
            metrics = "   ".join(f"{s['mean']:.4f} ± {s['std']:.4f}" for s in v["test"].values())
            print(f"{variant:<15}{v['optimizer']:<10}{v['lr']:>9.2e}{v['epochs']:>7}{v['params_end']:>14,.0f}  {metrics}"
                  f"  ({v['seeds']} seeds)")
    if report.get("measure"):
        print(f"\n{'variant':<15}{'ranks':<7}{'batch':>6}{'params':>13}{'step ms':>10}{'train MB':>10}"
              f"{'peak RSS MB':>13}")
        for m in report["measure"]:
            print(f"{m['variant']:<15}{m['ranks']:<7}{m['batch']:>6}{m['params']:>13,}{m['step_ms']:>10.1f}"
                  f"{m['train_mb']:>10.0f}{m['peak_rss_mb']:>13.0f}")


def ratios(measured: list[dict]) -> dict[str, Any]:
    """Dense-sgd (the leanest dense) over each TT variant at its target, per batch."""
    by = {(m["variant"], m["ranks"], m["batch"]): m for m in measured}
    out = {}
    for (variant, ranks, batch), m in by.items():
        dense = by.get(("dense-sgd", "", batch))
        if compressed(variant) and dense:
            out[f"{variant}@{ranks}/b{batch}"] = {
                "params_x": dense["params"] / m["params"], "train_memory_x": dense["train_mb"] / m["train_mb"],
                "process_peak_x": dense["peak_rss_mb"] / m["peak_rss_mb"],
                "speedup_vs_dense_sgd": dense["step_ms"] / m["step_ms"],
                "speedup_vs_dense_adagrad": by[("dense-adagrad", "", batch)]["step_ms"] / m["step_ms"]
                if ("dense-adagrad", "", batch) in by else None}
    return out


# ------------------------------------------------------------------ main
def main() -> None:
    p = parser(__doc__)
    p.add_argument("--phases", default="quality,measure,report", help="comma list of quality, measure, report")
    p.add_argument("--datasets", default="criteo,movielens")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--buckets", type=int, default=1_000_000)
    p.add_argument("--ratio", type=float, default=1 / 99)
    p.add_argument("--ml-ratios", default="0.1,0.3", help="MovieLens: the compressed variant's ratios")
    p.add_argument("--batches", default="128,2048")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--run-dir", default="runs/dlrm")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--measure-one", default=None, help=_hidden())
    p.add_argument("--ranks", default="start", help=_hidden())
    p.add_argument("--batch", type=int, default=128, help=_hidden())
    p.add_argument("--lr", type=float, default=0.03, help=_hidden())
    p.add_argument("--profile", action="store_true", help=_hidden())
    args = p.parse_args()
    data = Path(args.data)
    case_args = ["--data", str(data), "--buckets", str(args.buckets), "--ratio", repr(args.ratio)]
    if args.measure_one:
        case = criteo_case(data, args.buckets, args.ratio)
        print(json.dumps(measure_one(case, args.measure_one, args.ranks, args.batch, args.lr, profile=args.profile)))
        return
    phases = set(args.phases.split(","))
    if phases - {"quality", "measure", "report"}:
        raise SystemExit(f"--phases: unknown {sorted(phases - {'quality', 'measure', 'report'})}")
    datasets = [d for d in args.datasets.split(",") if d]
    if set(datasets) - {"criteo", "movielens"}:
        raise SystemExit("--datasets: choose among criteo, movielens")
    run_dir = Path(args.run_dir)
    cases = {}
    for name in datasets:
        found = ([criteo_case(data, args.buckets, args.ratio)] if name == "criteo" else
                 [movielens_case(data, float(r)) for r in args.ml_ratios.split(",") if r])
        for case in found:
            cases[case.name] = (case, CRITEO_VARIANTS if name == "criteo" else MOVIELENS_VARIANTS,
                                Rows(run_dir / "rows", case.protocol))
    lrs: dict[str, float] = {}
    if "quality" in phases:
        for name, (case, variants, rows) in cases.items():
            for variant in variants:
                seed_rows(case, variant, sweep(case, variant, rows), rows, train=True)
    measure_file = run_dir / "measure.json"
    if "measure" in phases and "criteo" in cases:
        case, variants, rows = cases["criteo"]
        lrs = {v: (swept_choice(case, v, rows) or (GRIDS[optimizer_kind(case, v)][1],))[0] for v in variants}
        lrs["tt-fused"] = lrs["tt"]
        measured = measure(case_args, lrs, [int(b) for b in args.batches.split(",")], args.rounds)
        from tncompile.files import private_folder, write_replacing
        private_folder(run_dir)
        write_replacing(measure_file, json.dumps({"protocol": case.protocol, "machine": machine(),
                                                   "measure": measured}))
    if "report" in phases:
        report: dict[str, Any] = {"command": "python benchmarks/bench_dlrm.py " + " ".join(sys.argv[1:]),
                                  "machine": machine(), "cases": {}}
        for name, (case, variants, rows) in cases.items():
            report["cases"][name] = case_report(case, variants, rows)
        if measure_file.exists() and "criteo" in cases:
            from tncompile.files import read_bounded
            stored = json.loads(read_bounded(measure_file, MAX_ROW_BYTES))
            if stored.get("protocol") == cases["criteo"][0].protocol:
                report["measure"], report["measure_machine"] = stored["measure"], stored["machine"]
                report["ratios"] = ratios(stored["measure"])
        print_table(report)
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        write_result(out / "dlrm.json", report)
        print(f"\nwrote {out / 'dlrm.json'}")


def _hidden() -> str:
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
