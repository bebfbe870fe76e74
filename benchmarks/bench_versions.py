"""Is this checkout slower than an earlier commit? An A/B of two source trees.

    python benchmarks/bench_versions.py [--base REV] [--rounds 3] [--six-encoder]

Checks ``REV`` (default ``HEAD~1``) out into a temporary git worktree, then
alternates processes in ABBA order -- base, this, this, base, base, ... -- each
timing the same TT-layer points and a TTM lookup (fwd+bwd medians, fp32, native kernels, CPU
allocator setting), so both trees see the same machine state and neither
always runs first. Each tree builds its native kernels once into its own
extension directory. Reports per point the median and the best over rounds of
each tree and their ratios (this / base: above 1 is slower), and whether one
step makes the same Python and C calls in both trees (a deterministic check:
timings on a shared machine are noisy, call counts are not). Writes
``benchmarks/results/versions.json``. With ``--six-encoder``, each process also times the
paper's six-encoder compiled training step (32 x 128, AdamW, ratio 1/44.9; median of 7 after
4 warm-up steps).
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


SIX_ENCODER = r"""
import json, statistics, sys, time, warnings
import torch
from torch import nn
warnings.simplefilter("ignore")
import tncompile
try:
    from tncompile.testing import six_encoder
except ImportError:  # a tree from before the reference models moved
    from tncompile.zoo import six_encoder
torch.manual_seed(0)
compiled = tncompile.compile(six_encoder(), target_ratio=1 / 44.9, init="random", batch_sizes=[32],
                             example_inputs=(torch.randint(1, 30522, (2, 128)),))
x, y = torch.randint(1, 30522, (32, 128)), torch.randint(0, 3, (32,))
opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
def step():
    loss = nn.functional.cross_entropy(compiled(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
for _ in range(4):
    step()
times = []
for _ in range(7):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
print(json.dumps({"six-encoder step 32x128": {"ms": statistics.median(times) * 1e3, "calls": {}}}))
"""


def run_tree(tree: Path, ext_dir: Path, six_encoder: bool = False) -> dict[str, dict]:
    env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(ext_dir))
    out = {}
    for code in (TIMER, SIX_ENCODER) if six_encoder else (TIMER,):
        done = subprocess.run([sys.executable, "-c", code, json.dumps(POINTS)], env=env, capture_output=True,
                              text=True, check=True, cwd=tempfile.gettempdir())
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--base", default="HEAD~1", help="the commit to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--six-encoder", action="store_true", help="also time the six-encoder's training step")
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
                    runs[name].append(run_tree(trees[name], Path(tmp) / f"ext-{name}", args.six_encoder))
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
