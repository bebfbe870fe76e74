"""Per-token decode time: a swap-mode compressed GPT-2 against the same dense model, generating.

    python benchmarks/bench_decode.py [--ratios 0.3 0.1] [--batches 1 8] [--tokens 32]

A 4-layer, 768-wide GPT-2 (vocab 50257, random weights: speed does not depend on
what the weights learned), compiled with ``mode="swap"`` so that HF ``generate``
runs with its KV cache. Each variant greedily decodes ``--tokens`` new tokens
after an 8-token prompt under ``torch.inference_mode``; the time per generated
token is the median over rounds, variants interleaved round-robin (the machines
are shared and noisy: compare the ratios of one run). Writes
``benchmarks/results/decode.json`` with the host's measured copy bandwidth and
GEMM throughput.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import transformers

import tncompile

from common import machine, parser, write_json


def _gpt2() -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(n_layer=4, n_embd=768, n_head=12, vocab_size=50257, n_positions=256)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _generate(model, prompt: torch.Tensor, tokens: int) -> float:
    """Seconds per generated token of one greedy ``generate`` call."""
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    assert out.shape[1] == prompt.shape[1] + tokens
    return (time.perf_counter() - start) / tokens


def decode_arguments(doc: str) -> argparse.Namespace:
    """The decode benchmarks' command line (``--ratios``, ``--batches``, ``--tokens``, ``--rounds``)."""
    ap = parser(doc)
    ap.add_argument("--ratios", type=float, nargs="*", default=[0.3, 0.1])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    return ap.parse_args()


def compressed_gpt2s(dense, ratios) -> dict:
    """``ratio -> dense`` compiled in swap mode at that ratio (eval mode)."""
    example = {"input_ids": torch.randint(1, 50257, (2, 16)), "use_cache": False}
    return {ratio: tncompile.compile(dense, target_ratio=ratio, mode="swap", example_inputs=example).eval()
            for ratio in ratios}


def time_decoding(variants: dict, args: argparse.Namespace, benchmark: str) -> None:
    """Per batch, each variant's median ms per generated token, interleaved round-robin, written
    to ``benchmarks/results/<benchmark>.json`` with the host's speeds. ``variants``:
    ``name -> (model, context)``, each call made inside ``context()``; one is "dense"."""
    rows = []
    for batch in args.batches:
        prompt = torch.randint(1, 50257, (batch, 8), generator=torch.Generator().manual_seed(batch))
        for model, context in variants.values():
            with context():
                _generate(model, prompt, 4)  # warm-up: plans for the decode buckets, allocator
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, (model, context) in variants.items():
                with context():
                    times[name].append(_generate(model, prompt, args.tokens))
        dense_ms = statistics.median(times["dense"]) * 1e3
        for name, (model, _) in variants.items():
            ms = statistics.median(times[name]) * 1e3
            rows.append({"batch": batch, "variant": name, "ms_per_token": ms, "speed_vs_dense": dense_ms / ms,
                         "ratio": getattr(model, "ratio", 1.0)})
            print(f"batch {batch:3d}  {name:20s} {ms:8.2f} ms/token  {dense_ms / ms:5.2f}x dense", flush=True)
    path = write_json(f"{benchmark}.json", {"benchmark": benchmark, "model": "GPT-2 4x768, vocab 50257",
                                            "tokens": args.tokens, "rounds": args.rounds, "rows": rows, **machine()})
    print(f"wrote {path}")


def main() -> None:
    args = decode_arguments(__doc__)
    dense = _gpt2()
    variants = {"dense": (dense, contextlib.nullcontext)}
    variants.update({f"tt {ratio}": (model, contextlib.nullcontext)
                     for ratio, model in compressed_gpt2s(dense, args.ratios).items()})
    time_decoding(variants, args, "decode")


if __name__ == "__main__":
    main()
