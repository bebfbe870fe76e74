"""First-call time of ``torch.compile`` on a compiled model: forward plus backward.

    python benchmarks/bench_compile_time.py [--repeats 2]

A 2-layer BERT (hidden 64, 4 heads, vocab 1000; ``transformers``), dense and
compiled by tncompile at ratio 0.3 -- as it traces (rank gates and TTM lookups one
custom op each, contractions step by step) -- each run through ``torch.compile``
(inductor, the default backend) in a fresh process with the FX-graph and
autograd caches off, so no graph compiled before is reused. Two cache states:
``cold``, an empty inductor cache directory (a first ever ``torch.compile`` on
the machine: it also builds inductor's C++ prelude), and ``warm``, a copy of a
cache that compiled one unrelated small function (a user who has used
``torch.compile`` before). The variants run interleaved, ``--repeats`` rounds,
as the machine is shared and noisy; the ratio to dense within a round is the
figure to compare. Reports the first forward+backward call (what a user waits
for), the number of C++ kernels inductor compiled, and the median of 20 later
calls. Writes ``benchmarks/results/compile_time.json``.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from common import machine, parser, write_json

CHILD = r"""
import json, os, sys, time, torch, tncompile, transformers as tf
torch.manual_seed(0)
cfg = tf.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=64, num_labels=3)
model = tf.BertForSequenceClassification(cfg)
ids = torch.randint(0, 1000, (2, 16))
if sys.argv[1] != "dense":
    model = tncompile.compile(model, target_ratio=0.3, example_inputs={"input_ids": ids})
import statistics
fast = torch.compile(model)
start = time.perf_counter()
fast(input_ids=ids).logits.sum().backward()
first = time.perf_counter() - start
steady = []
for _ in range(20):
    start = time.perf_counter()
    fast(input_ids=ids).logits.sum().backward()
    steady.append(time.perf_counter() - start)
print(json.dumps({"first_call_s": first, "steady_call_ms": statistics.median(steady) * 1e3}))
"""

WARM_UP = r"""
import torch
f = torch.compile(lambda x: (x.sin() * 2).sum())
f(torch.randn(8, requires_grad=True)).backward()
"""

VARIANTS = ("dense", "tncompile")


def _kernels(cache: str) -> int:
    return sum(name.endswith(".cpp") for _, _, files in os.walk(cache) for name in files)


def _run(variant: str, base: str | None) -> dict:
    """One first call in a fresh process; ``base``: a cache directory to start from."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as tmp:
        cache = os.path.join(tmp, "cache")
        if base is None:
            os.makedirs(cache)
        else:
            shutil.copytree(base, cache)
        before = _kernels(cache)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        done = subprocess.run([sys.executable, "-c", CHILD, variant], capture_output=True, text=True,
                              check=True, env=env)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        out["cpp_kernels"] = _kernels(cache) - before
        return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    rounds = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="inductor-base-") as base:
        subprocess.run([sys.executable, "-c", WARM_UP], check=True, capture_output=True,
                       env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=base))
        for r in range(args.repeats):
            for state in ("cold", "warm"):
                row = {v: _run(v, None if state == "cold" else base) for v in VARIANTS}
                for v in VARIANTS:
                    row[v]["first_call_vs_dense"] = row[v]["first_call_s"] / row["dense"]["first_call_s"]
                rounds[state].append(row)
                print(f"round {r + 1}, {state} cache: " + ", ".join(
                    f"{v} {row[v]['first_call_s']:.1f} s ({row[v]['first_call_vs_dense']:.2f}x, "
                    f"{row[v]['cpp_kernels']} kernels, then {row[v]['steady_call_ms']:.1f} ms)" for v in VARIANTS),
                    flush=True)
    summary = {state: {v: {key: statistics.median(row[v][key] for row in rows)
                           for key in ("first_call_s", "first_call_vs_dense", "steady_call_ms", "cpp_kernels")}
                       for v in VARIANTS} for state, rows in rounds.items()}
    write_json("compile_time.json", {**machine(), "model": "BERT 2 layers, hidden 64, 32 tokens",
                                     "target_first_call_s": 20.0, "caches": "FX graph and autograd caches off; "
                                     "cold: empty inductor cache, warm: a cache of one unrelated function",
                                     "median_of_rounds": summary, "rounds": rounds})


if __name__ == "__main__":
    main()
