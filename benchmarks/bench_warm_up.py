"""What the first training steps of a compressed model cost against settled ones.

    python benchmarks/bench_warm_up.py [--steps 10] [--rounds 2]

The pretraining study's Llama (hidden 256, 4 layers, 8k vocabulary, 16 x 256 tokens) at
``target_ratio=0.25``, AdamW, in a plain PyTorch loop -- issue 64's setting. Each variant
runs in a fresh process (nothing measured or loaded before it), ``--rounds`` times
interleaved: ``race`` (the defaults: ways raced), ``four runs each`` (every candidate
timed after a warm-up on three more runs, as before the race: no drop-outs, no tie) and
``no measuring`` (``tuning.MEASURE_WAYS = False``: the cost model's choice). Reported per
variant: the step times, the settled step (median of the steps after the fifth), and the
warm-up -- what the first five steps cost beyond five settled ones -- in settled steps.
Writes ``benchmarks/results/warm_up.json`` with the host's copy bandwidth, GEMM throughput
and the load while the variants ran (``tncompile.testing.HostLoad``).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import machine, parser, write_json

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tncompile import tuning
from tncompile.testing.warm_up import study_llama_step_times
with tuning.override(**json.loads(sys.argv[2])):
    times = study_llama_step_times(int(sys.argv[3]))
print(json.dumps(times))
"""

VARIANTS = {
    "race": {},
    "four runs each": {"MEASURE_RACE_SLACK": 1e9, "MEASURE_WARMUP_SLACK": 1e9, "MEASURE_TIE": 1.0},
    "no measuring": {"MEASURE_WAYS": False},
}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tncompile.testing import HostLoad
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with HostLoad() as load:
        for _ in range(args.rounds):
            for variant, settings in VARIANTS.items():
                out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), json.dumps(settings), str(args.steps)],
                                     capture_output=True, text=True, check=True)
                times = json.loads(out.stdout.strip().splitlines()[-1])
                settled = statistics.median(times[5:])
                runs[variant].append({"step_s": times, "settled_s": settled,
                                      "warm_up_steps": sum(t - settled for t in times[:5]) / settled})
    print("| variant | first steps (ms) | settled (ms) | warm-up (settled steps) |\n|---|---|---|---|")
    for variant, rs in runs.items():
        for r in rs:
            print(f"| {variant} | {', '.join(f'{1000 * t:.0f}' for t in r['step_s'][:5])} | "
                  f"{1000 * r['settled_s']:.0f} | {r['warm_up_steps']:.2f} |")
    if load.busy:
        print(f"WARNING: the host was busy while the steps were timed ({load.describe()}): unreliable")
    path = write_json("warm_up.json", {"args": vars(args), "host_load": load.as_dict(), "machine": machine(),
                                       "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
