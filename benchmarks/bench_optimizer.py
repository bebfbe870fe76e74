"""AdamW's step over a compressed model's many small tensors: the default loop, foreach, fused.

    python benchmarks/bench_optimizer.py [--reps 20] [--device cuda]

A compressed model holds several times the parameter tensors of its dense model (every
TT linear's cores and rank gates, every TTM embedding's), each small: the paper's
six-encoder at 1/44.9 has 474 against 102. PyTorch's default AdamW on CPU steps them
one by one in Python; ``foreach=True`` groups them, ``fused=True`` runs one kernel over
all of them. Times ``optimizer.step()`` (gradients set once, random) for the dense and
the compiled six-encoder with each implementation, interleaved. Writes
``benchmarks/results/optimizer.json`` (``optimizer_cuda.json`` on a GPU) with the host's
copy bandwidth and GEMM throughput.
"""
from __future__ import annotations


import torch

import tncompile
from tncompile.testing import six_encoder

from common import interleaved_ms, machine, parser, write_json

PAPER_RATIO = 1 / 44.9
VARIANTS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    models = {"dense": six_encoder().to(device)}
    models["compiled"] = tncompile.compile(six_encoder(), target_ratio=PAPER_RATIO, init="random",
                                           batch_sizes=[32 * 128]).to(device)
    rows = []
    for name, model in models.items():
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p)
        steps = {variant: torch.optim.AdamW(params, lr=1e-4, **kw).step for variant, kw in VARIANTS.items()}
        ms = interleaved_ms(steps, reps=args.reps, warmup=3, device=device)
        row = {"model": name, "tensors": len(params), "elements": sum(p.numel() for p in params),
               **{f"{v}_ms": round(t, 3) for v, t in ms.items()},
               "fused_speedup_vs_default": round(ms["default"] / ms["fused"], 2)}
        rows.append(row)
        print(f"{name:9s} {row['tensors']:4d} tensors {row['elements']:>12,} elements  " +
              "  ".join(f"{v} {t:7.2f} ms" for v, t in ms.items()), flush=True)
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    path = write_json(f"optimizer{suffix}.json", {"benchmark": "optimizer", "device": str(device), "rows": rows,
                                                 **machine(device)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
