"""An optimizer's step over a compressed model's many small tensors: the default loop,
foreach, fused.

    python benchmarks/bench_optimizer.py [--reps 20] [--device cuda]
    python benchmarks/bench_optimizer.py --optimizers adamw,adagrad --models six-encoder,dlrm

A compressed model holds several times the parameter tensors of its dense model (every
TT linear's cores and rank gates, every TTM embedding's), each small: the paper's
six-encoder at 1/44.9 has 474 against 102. PyTorch's default optimizers on CPU step them
one by one in Python; ``foreach=True`` groups them, ``fused=True`` runs one kernel over
all of them. Times ``optimizer.step()`` (gradients set once, random) for each model with
each implementation, interleaved (:func:`common.interleaved_ms`). Models: ``six-encoder``
(the paper's, dense and compiled at 1/44.9) and ``dlrm`` (``benchmarks/bench_dlrm.py``'s
``tt`` at 1/99 of its 416.5M parameters, end ranks: 196 tensors, 4.0M elements; its dense
tables' sparse gradients take no fused step, so it has no dense row here). Writes
``benchmarks/results/optimizer.json`` for the defaults (``optimizer_cuda.json`` on a GPU),
else ``optimizer-<optimizers>-<models>.json``, with the host's copy bandwidth and GEMM
throughput.
"""
from __future__ import annotations

import sys

import torch

import tncompile
from tncompile.testing import six_encoder

from common import interleaved_ms, machine, parser, write_json

PAPER_RATIO = 1 / 44.9
VARIANTS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
OPTIMIZERS = {"adamw": lambda params, **kw: torch.optim.AdamW(params, lr=1e-4, **kw),
              "adam": lambda params, **kw: torch.optim.Adam(params, lr=1e-4, **kw),
              "adagrad": lambda params, **kw: torch.optim.Adagrad(params, lr=1e-2, **kw),
              "sgd": lambda params, **kw: torch.optim.SGD(params, lr=1e-2, momentum=0.9, **kw)}
MODELS = ("six-encoder", "dlrm")


def build_models(which: str, device: torch.device) -> dict[str, torch.nn.Module]:
    """The models of ``which`` by row name."""
    torch.manual_seed(0)
    if which == "six-encoder":
        return {"dense": six_encoder().to(device),
                "compiled": tncompile.compile(six_encoder(), target_ratio=PAPER_RATIO, init="random",
                                              batch_sizes=[32 * 128]).to(device)}
    import bench_dlrm
    case = bench_dlrm.criteo_case(bench_dlrm.DATA, 1_000_000, 1 / 99)
    return {"dlrm-tt": bench_dlrm.build(case, "tt", 0.01, seed=0, ranks="end").model.to(device)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--optimizers", default="adamw", help=f"comma list of {', '.join(OPTIMIZERS)}")
    ap.add_argument("--models", default="six-encoder", help=f"comma list of {', '.join(MODELS)}")
    args = ap.parse_args()
    optimizers = [o for o in args.optimizers.split(",") if o]
    which = [m for m in args.models.split(",") if m]
    if not optimizers or set(optimizers) - set(OPTIMIZERS):
        raise SystemExit(f"--optimizers: choose among {', '.join(OPTIMIZERS)}")
    if not which or set(which) - set(MODELS):
        raise SystemExit(f"--models: choose among {', '.join(MODELS)}")
    device = torch.device(args.device)
    rows = []
    for group in which:
        for name, model in build_models(group, device).items():
            params = [p for p in model.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.randn_like(p)
            for optimizer in optimizers:
                make = OPTIMIZERS[optimizer]
                steps = {variant: make(params, **kw).step for variant, kw in VARIANTS.items()}
                ms = interleaved_ms(steps, reps=args.reps, warmup=3, device=device)
                row = {"model": name, "optimizer": optimizer, "tensors": len(params),
                       "elements": sum(p.numel() for p in params), **{f"{v}_ms": round(t, 3) for v, t in ms.items()},
                       "fused_speedup_vs_default": round(ms["default"] / ms["fused"], 2),
                       "foreach_speedup_vs_default": round(ms["default"] / ms["foreach"], 2)}
                rows.append(row)
                print(f"{name:9s} {optimizer:8s} {row['tensors']:4d} tensors {row['elements']:>12,} elements  " +
                      "  ".join(f"{v} {t:7.2f} ms" for v, t in ms.items()), flush=True)
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    if (optimizers, which) != (["adamw"], ["six-encoder"]):
        suffix = f"-{'-'.join(optimizers)}-{'-'.join(which)}{suffix}"
    path = write_json(f"optimizer{suffix}.json", {"benchmark": "optimizer", "device": str(device), "rows": rows,
                                                 "command": "python benchmarks/bench_optimizer.py "
                                                 + " ".join(sys.argv[1:]), **machine(device)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
