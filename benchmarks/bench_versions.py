"""Is this checkout slower than an earlier commit? An A/B of two source trees.

    python benchmarks/bench_versions.py [--base REV] [--rounds 3]

Checks ``REV`` (default ``HEAD~1``) out into a temporary git worktree, then
alternates processes in ABBA order -- base, this, this, base, base, ... -- each
timing the same TT-layer points and a TTM lookup (fwd+bwd medians, fp32, native kernels, CPU
allocator setting), so both trees see the same machine state and neither
always runs first. Each tree builds its native kernels once into its own
extension directory. Reports per point the median and the best over rounds of
each tree and their ratios (this / base: above 1 is slower), and whether one
step makes the same Python and C calls in both trees (a deterministic check:
timings on a shared machine are noisy, call counts are not). Writes
``benchmarks/results/versions.json``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, parser, write_json

ROOT = Path(__file__).resolve().parents[1]

POINTS = [(3072, 768, 64, 1), (768, 3072, 64, 1), (768, 768, 16, 1), (3072, 768, 30, 32),
          (3072, 768, 64, 32), (768, 3072, 30, 512), (768, 3072, 30, 4096), ("ttm", 30522, 32, 4096)]

TIMER = r"""
import collections, json, statistics, sys, time
import torch
from torch import nn
from tncompile.runtime import TTLinear, TTMEmbedding
from tncompile.runtime.kernels.cpu_allocator import retain_freed_memory
retain_freed_memory()
torch.manual_seed(0)
out = {}
for i, o, r, t in json.loads(sys.argv[1]):
    if i == "ttm":  # a TTM embedding lookup: o rows, rank r, t ids
        layer = TTMEmbedding.from_embedding(nn.Embedding(o, 768), rank=r)
        x = torch.randint(0, o, (t,))
    else:
        layer = TTLinear.from_linear(nn.Linear(i, o), rank=r)
        x = torch.randn(t, i, requires_grad=True)
    for _ in range(10):
        layer(x).sum().backward()
    times = []
    for _ in range(7 if t >= 4096 else 150):
        for p in layer.parameters():
            p.grad = None
        start = time.perf_counter()
        layer(x).sum().backward()
        times.append(time.perf_counter() - start)
    calls = collections.Counter()  # every Python and C call of one more step: deterministic
    def count(frame, event, arg):
        if event in ("call", "c_call"):
            calls[frame.f_code.co_name if event == "call" else getattr(arg, "__name__", "?")] += 1
    sys.setprofile(count)
    layer(x).sum().backward()
    sys.setprofile(None)
    out[f"{i}->{o} r{r} x{t}"] = {"ms": statistics.median(times) * 1e3, "calls": dict(calls)}
print(json.dumps(out))
"""


def run_tree(tree: Path, ext_dir: Path) -> dict[str, dict]:
    env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(ext_dir))
    done = subprocess.run([sys.executable, "-c", TIMER, json.dumps(POINTS)], env=env, capture_output=True,
                          text=True, check=True, cwd=tempfile.gettempdir())
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--base", default="HEAD~1", help="the commit to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base_rev = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="tncompile-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), base_rev], cwd=ROOT, check=True)
        try:
            trees = {"base": base_tree, "this": ROOT}
            runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
            for k in range(args.rounds):
                for name in (["base", "this"] if k % 2 == 0 else ["this", "base"]):
                    runs[name].append(run_tree(trees[name], Path(tmp) / f"ext-{name}"))
                    print(f"round {k + 1}/{args.rounds} {name} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    points = {}
    print(f"{'point':>26} {'base ms':>9} {'this ms':>9} {'median':>8} {'best':>8} {'calls':>12}")
    for key in runs["base"][0]:
        b_runs, t_runs = [r[key]["ms"] for r in runs["base"]], [r[key]["ms"] for r in runs["this"]]
        base, this = statistics.median(b_runs), statistics.median(t_runs)
        b_calls, t_calls = runs["base"][0][key]["calls"], runs["this"][0][key]["calls"]
        points[key] = {"base_ms": base, "this_ms": this, "this_over_base": this / base,
                       "best_this_over_base": min(t_runs) / min(b_runs), "base_runs": b_runs, "this_runs": t_runs,
                       "base_calls": sum(b_calls.values()), "this_calls": sum(t_calls.values()),
                       "same_calls": b_calls == t_calls}
        print(f"{key:>26} {base:9.3f} {this:9.3f} {this / base:8.3f} {min(t_runs) / min(b_runs):8.3f} "
              f"{sum(b_calls.values()):>5}/{sum(t_calls.values()):<5}{'' if b_calls == t_calls else ' differ'}")
    median_ratio = statistics.geometric_mean([p["this_over_base"] for p in points.values()])
    best_ratio = statistics.geometric_mean([p["best_this_over_base"] for p in points.values()])
    print(f"geometric mean this/base: {median_ratio:.3f} (medians), {best_ratio:.3f} (best of rounds)")
    write_json("versions.json", {**machine(), "base": base_rev, "rounds": args.rounds, "points": points,
                                 "geomean_this_over_base": median_ratio,
                                 "geomean_best_this_over_base": best_ratio})


if __name__ == "__main__":
    main()
