"""Compile time and whole-model ratio of reference models (JSON to benchmarks/results/).

    python benchmarks/bench_compile.py

Measures, in one run: compile time of a 12-layer BERT-base config (from config,
no download; via torch.export) and of CoMERA's six-encoder at the paper's
starting size, with the resulting whole-model ratio.
"""
from __future__ import annotations

import time

import torch

import tncompile
from tncompile.testing import six_encoder

from common import machine, parser, write_json


def timed_compile(model, **kw):
    start = time.perf_counter()
    compiled = tncompile.compile(model, **kw)
    return compiled, time.perf_counter() - start


def main() -> None:
    parser(__doc__).parse_args()
    from transformers import BertConfig, BertForSequenceClassification

    results = {"benchmark": "compile", **machine(), "runs": []}
    bert = BertForSequenceClassification(BertConfig()).eval()  # BERT-base: 12 layers, 768, 30522 vocab
    ids = torch.randint(0, 30522, (2, 128))
    for init in ("svd", "random"):
        compiled, secs = timed_compile(bert, target_ratio=0.05, example_inputs={"input_ids": ids}, init=init)
        results["runs"].append({"model": "bert-base (12 layers)", "init": init, "target_ratio": 0.05,
                                "ratio": compiled.ratio, "compile_s": secs})
    six = six_encoder()
    for init in ("svd", "random"):
        compiled, secs = timed_compile(six, target_ratio=1 / 44.9, init=init)
        results["runs"].append({"model": "six-encoder", "init": init, "target_ratio": 1 / 44.9,
                                "ratio": compiled.ratio, "x_smaller": 1 / compiled.ratio,
                                "compile_s": secs})
    print(f"{'model':24s} {'init':7s} {'ratio':>8s} {'x smaller':>10s} {'compile':>9s}")
    for r in results["runs"]:
        print(f"{r['model']:24s} {r['init']:7s} {r['ratio']:8.5f} {1 / r['ratio']:10.1f} {r['compile_s']:8.1f}s")
    print(f"wrote {write_json('compile.json', results)}")


if __name__ == "__main__":
    main()
