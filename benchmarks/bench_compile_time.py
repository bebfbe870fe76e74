"""First-call time of ``torch.compile`` on a compiled model: forward plus backward.

    python benchmarks/bench_compile_time.py

A 2-layer BERT (hidden 64, 4 heads, vocab 1000; ``transformers``), dense and
compiled by tncompile at ratio 0.3, each run once through ``torch.compile``
(inductor, the default backend) in a fresh process with an empty inductor
cache directory and the FX-graph and autograd caches off, so nothing compiled
before (by an earlier run or the other variant) is reused;
the time of the first forward+backward call is what a user waits for. Writes
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
if sys.argv[1] == "tncompile":
    model = tncompile.compile(model, target_ratio=0.3, example_inputs={"input_ids": ids})
fast = torch.compile(model)
start = time.perf_counter()
fast(input_ids=ids).logits.sum().backward()
first = time.perf_counter() - start
start = time.perf_counter()
fast(input_ids=ids).logits.sum().backward()
print(json.dumps({"first_call_s": first, "second_call_s": time.perf_counter() - start}))
"""


def main() -> None:
    out = {}
    for variant in ("dense", "tncompile"):
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                       TORCHINDUCTOR_AUTOGRAD_CACHE="0")
            done = subprocess.run([sys.executable, "-c", CHILD, variant], capture_output=True, text=True,
                                  check=True, env=env)
        out[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{variant:>10}: first call {out[variant]['first_call_s']:.1f} s, "
              f"second {out[variant]['second_call_s'] * 1e3:.1f} ms", flush=True)
    write_json("compile_time.json", {**machine(), "model": "BERT 2 layers, hidden 64", "variants": out,
                                     "target_first_call_s": 20.0, "caches": "empty inductor cache, FX graph "
                                     "and autograd caches off"})


if __name__ == "__main__":
    main()
