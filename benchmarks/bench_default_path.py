"""What a user gets without calling anything: a TT linear against ``nn.Linear`` on CPU.

    python benchmarks/bench_default_path.py [--reps 15]

768 -> 3072 over 4096 tokens, ``TTLinear.from_linear(lin, rank=30)`` against the
``nn.Linear`` it came from, forward plus backward (input and weight gradients),
timed interleaved (:func:`common.interleaved_ms`) in two fresh processes:

* ``default``: nothing set up, as a user runs it. The TT layer's first CPU forward
  makes glibc keep freed memory (``tncompile.runtime.kernels.cpu_allocator``); from then on
  both layers in the process run with it.
* ``opted_out``: ``TNCOMPILE_RETAIN_FREED_MEMORY=0``: large activations are
  page-faulted back in every step, as before the runtime did this by itself.

The figure is the dense time over the TT time within each process. The TT step
streams its 50 MB output and output gradient around little arithmetic, so the
figure follows the machine's memory speed (the shared hosts' varies) while the
dense GEMM does not: each process also records the copy bandwidth of that 50 MB
tensor. Writes ``benchmarks/results/default_path.json``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from common import machine, parser, write_json

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[2])
from common import interleaved_ms
from tncompile.runtime import TTLinear
from tncompile.runtime.kernels.cpu_allocator import retained
torch.manual_seed(0)
dense = torch.nn.Linear(768, 3072)
tt = TTLinear.from_linear(dense, rank=30)
x = torch.randn(4096, 768, requires_grad=True)
g = torch.randn(4096, 3072)

def zero():
    for p in (x, *dense.parameters(), *tt.parameters()):
        p.grad = None

times = interleaved_ms({"dense": lambda: dense(x).backward(g), "tt": lambda: tt(x).backward(g)},
                       reps=int(sys.argv[1]), warmup=2, setup=zero)
# the machine's memory speed: copying the 50 MB output gradient (read + write), median of 9
out = torch.empty_like(g)
copies = []
for _ in range(9):
    start = time.perf_counter()
    out.copy_(g)
    copies.append(time.perf_counter() - start)
bandwidth = 2 * g.numel() * g.element_size() / sorted(copies)[4] / 1e9
print(json.dumps({**times, "speedup": times["dense"] / times["tt"], "retained": retained(),
                  "copy_gb_per_s": bandwidth}))
"""


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    out = {}
    for name, extra in (("default", {}), ("opted_out", {"TNCOMPILE_RETAIN_FREED_MEMORY": "0"})):
        env = {k: v for k, v in os.environ.items() if k != "TNCOMPILE_RETAIN_FREED_MEMORY"}
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.reps), here], capture_output=True,
                              text=True, check=True, env={**env, **extra})
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name:>10}: nn.Linear {out[name]['dense']:.1f} ms, TTLinear r30 {out[name]['tt']:.1f} ms, "
              f"{out[name]['speedup']:.1f}x (allocator keeps freed memory: {out[name]['retained']}; "
              f"memory copy {out[name]['copy_gb_per_s']:.1f} GB/s)", flush=True)
    write_json("default_path.json", {**machine(), "shape": "768->3072, 4096 tokens, rank 30, fwd+bwd",
                                     "target_speedup": 16.0, **out})


if __name__ == "__main__":
    main()
