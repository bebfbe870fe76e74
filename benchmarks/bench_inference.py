"""Inference time of a compressed BERT-base-size encoder against the same dense model.

    python benchmarks/bench_inference.py [--ratios 0.3 0.05] [--shapes 1x128 32x128] [--reps 7]

A 12-layer, 768-wide BERT encoder (intermediate 3072, vocab 30522; random weights:
speed does not depend on what the weights learned), compiled in its default mode
(swap: an HF model), ``eval()`` and ``torch.inference_mode``, one forward per batch
shape. Variants are timed interleaved, median of ``--reps`` (the machines are shared
and noisy: compare the ratios of one run). Writes ``benchmarks/results/inference.json``
with the host's measured copy bandwidth and GEMM throughput, and per variant the
multiply-adds its linears run (what the inference forms chose) against dense.
"""
from __future__ import annotations


import torch
import transformers

import tncompile

from common import interleaved_ms, machine, parser, write_json


def _bert() -> transformers.BertModel:
    cfg = transformers.BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                  intermediate_size=3072, vocab_size=30522, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.BertModel(cfg, add_pooling_layer=False).eval()


def _shape(text: str) -> tuple[int, int]:
    batch, seq = text.lower().split("x")
    return int(batch), int(seq)


def _linear_macs(model, rows: int) -> int:
    """Multiply-adds per forward of the model's linears at ``rows`` rows, as each layer runs them
    in inference (a TT layer: its merged factors or its plan, whichever it picks)."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += rows * module.in_features * module.out_features
        elif isinstance(module, tncompile.runtime.TTLinear):
            total += module.inference_macs(rows)
    return total


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--ratios", type=float, nargs="*", default=[0.3, 0.05])
    ap.add_argument("--shapes", type=_shape, nargs="*", default=[(1, 128), (32, 128)])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dense = _bert()
    example = {"input_ids": torch.randint(0, 30522, (2, 128))}
    variants = {"dense": dense}
    for ratio in args.ratios:
        variants[f"tt {ratio}"] = tncompile.compile(dense, target_ratio=ratio, example_inputs=example).eval()
    rows = []
    for batch, seq in args.shapes:
        ids = torch.randint(0, 30522, (batch, seq), generator=torch.Generator().manual_seed(batch))

        def forward(model):
            def run():
                with torch.inference_mode():
                    model(input_ids=ids)
            return run

        with torch.inference_mode():
            want = dense(input_ids=ids).last_hidden_state
            for name, model in variants.items():  # also the warm-up: plans, merged factors, allocator
                got = model(input_ids=ids).last_hidden_state
                assert got.shape == want.shape, name
        times = interleaved_ms({name: forward(m) for name, m in variants.items()}, reps=args.reps)
        dense_macs = _linear_macs(dense, batch * seq)
        for name, model in variants.items():
            macs = _linear_macs(model, batch * seq)
            rows.append({"batch": batch, "seq": seq, "variant": name, "ms": times[name],
                         "speed_vs_dense": times["dense"] / times[name],
                         "ratio": getattr(model, "ratio", 1.0), "linear_macs_vs_dense": macs / dense_macs})
            print(f"{batch:3d}x{seq:<4d} {name:8s} {times[name]:9.2f} ms  {times['dense'] / times[name]:5.2f}x dense"
                  f"  linears at {macs / dense_macs:5.1%} of dense multiply-adds", flush=True)
    path = write_json("inference.json", {"benchmark": "inference", "model": "BERT-base-size encoder 12x768",
                                         "reps": args.reps, "rows": rows, **machine()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
