"""Attention as written against the ``fuse_attention`` pass's fused call, one layer's shapes.

    python benchmarks/bench_attention.py [--batch 32] [--heads 12] [--length 128] [--head-dim 64]

The six-encoder's attention (32 x 12 heads x 128 x 64, an additive padding mask, dropout
0.1 on the weights), three ways, each timed interleaved with the written steps:

* ``eval``: forward only under ``inference_mode`` (``FusedAttention`` runs
  ``scaled_dot_product_attention``; on CPU PyTorch's flash kernel);
* ``train, p=0``: forward + backward without dropout (the fused kernel both ways);
* ``train, p=0.1``: forward + backward with dropout. On CPU ``FusedAttention`` runs
  tncompile's native attention kernel here (``attention.cpp``; PyTorch's CPU attention
  has no fused kernel under dropout); the written steps use tncompile's native dropout,
  and the row also times PyTorch's own call (``scaled_dot_product_attention(dropout_p=0.1)``,
  its math path).

q, k and v are head-transposed views of (batch, length, heads, head_dim) tensors, as a
model's projections give them (``h.view(b, t, heads, d).transpose(1, 2)``).

Writes ``benchmarks/results/attention.json`` with the host's copy bandwidth and GEMM
throughput beside the times.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from common import interleaved_ms, machine, parser, write_json
from tncompile.runtime.fused.attention import FusedAttention
from tncompile.runtime.fused.dropout import FastDropout


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.length, args.head_dim)
    b, h, t, d = shape
    q, k, v = (torch.randn(b, t, h, d).transpose(1, 2).requires_grad_() for _ in range(3))
    mask = torch.zeros(args.batch, 1, 1, args.length)
    mask[: args.batch // 2, ..., args.length * 3 // 4:] = -1e9          # half the batch padded
    scale = args.head_dim ** 0.5
    rows = []

    def step(fn):
        def run():
            out = fn()
            if out.requires_grad:
                out.backward(torch.ones_like(out))
        return run

    def clear():
        for t in (q, k, v):
            t.grad = None

    for name, p, train in (("eval", 0.1, False), ("train, p=0", 0.0, True), ("train, p=0.1", 0.1, True)):
        fused = FusedAttention("div", FastDropout(p)).train(train)
        variants = {"written": step(lambda: fused.unfused(q, k, v, mask, scale)),
                    "fused module": step(lambda: fused(q, k, v, mask, scale))}
        if p and train:
            variants["torch sdpa"] = step(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, scale=1 / scale))
        if train:
            ms = interleaved_ms(variants, reps=args.reps, warmup=2, setup=clear)
        else:
            with torch.inference_mode():
                ms = interleaved_ms(variants, reps=args.reps, warmup=2)
        for variant, t in ms.items():
            rows.append({"case": name, "variant": variant, "ms": round(t, 3),
                         "speed_vs_written": round(ms["written"] / t, 3)})
            print(f"{name:13s} {variant:13s} {t:8.2f} ms  {ms['written'] / t:5.2f}x written", flush=True)
    path = write_json("attention.json", {"benchmark": "attention", "shape": list(shape), "rows": rows, **machine()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
