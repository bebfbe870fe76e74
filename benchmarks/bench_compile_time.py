"""First-call time of ``torch.compile`` on a compiled model: forward plus backward.

    python benchmarks/bench_compile_time.py

A 2-layer BERT (hidden 64, 4 heads, vocab 1000; ``transformers``), dense and
compiled by tncompile at ratio 0.3 -- with the native kernels traced as custom
ops (the default), with them switched off under tracing (``forked``: the
eager fallback is traced instead), and with each TT contraction traced as one
op (``one-op``, ``tuning.TRACE_CONTRACTION_AS_ONE_OP``) -- each run once through
``torch.compile``
(inductor, the default backend) in a fresh process with an empty inductor
cache directory and the FX-graph and autograd caches off, so nothing compiled
before (by an earlier run or the other variant) is reused;
the time of the first forward+backward call is what a user waits for; then the
median of 20 more calls (the steady state). Writes
``benchmarks/results/compile_time.json``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from common import machine, write_json

CHILD = r"""
import json, sys, time, torch, tncompile, transformers as tf
torch.manual_seed(0)
cfg = tf.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=64, num_labels=3)
model = tf.BertForSequenceClassification(cfg)
ids = torch.randint(0, 1000, (2, 16))
if sys.argv[1] != "dense":
    model = tncompile.compile(model, target_ratio=0.3, example_inputs={"input_ids": ids})
if sys.argv[1] == "tncompile-one-op":
    tncompile.tuning.TRACE_CONTRACTION_AS_ONE_OP = True
if sys.argv[1] == "tncompile-forked":
    import tncompile.runtime.native as native
    native._available = lambda: False  # no traceable kernels: the eager fallback is traced
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


def main() -> None:
    out = {}
    for variant in ("dense", "tncompile", "tncompile-forked", "tncompile-one-op"):
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                       TORCHINDUCTOR_AUTOGRAD_CACHE="0")
            done = subprocess.run([sys.executable, "-c", CHILD, variant], capture_output=True, text=True,
                                  check=True, env=env)
        out[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{variant:>16}: first call {out[variant]['first_call_s']:.1f} s, "
              f"then {out[variant]['steady_call_ms']:.1f} ms a call (median of 20)", flush=True)
    write_json("compile_time.json", {**machine(), "model": "BERT 2 layers, hidden 64", "variants": out,
                                     "target_first_call_s": 20.0, "caches": "empty inductor cache, FX graph "
                                     "and autograd caches off"})


if __name__ == "__main__":
    main()
