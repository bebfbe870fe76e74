"""Where a GPU training step's time goes: kernels per step and GPU time by kind, dense vs compiled.

    python benchmarks/bench_gpu_kernels.py [--batches 1 32] [--steps 5] [--model six-encoder|small-bert]

The paper's six-encoder (sequence 128, AdamW), dense and compiled at CoMERA's 1/44.9,
one eager :class:`tncompile.TrainStep` per model (``cuda_graph=False``: a captured step
replays exactly these kernels, without the host's launch gaps). After warm-up,
``--steps`` steps run under ``torch.profiler`` with CUDA activity; every kernel is put
in one kind by its name (GEMM, attention, optimizer, normalization/softmax,
elementwise/copy, other). Per step: the kernel count, the sum of kernel times (the GPU
time a captured replay cannot go below), and per kind count and time; the 12 costliest
kernels. With a floor of a few microseconds per kernel, a step of thousands of small
kernels is bound by their count, not by its FLOPs -- what this shows at batch 1.
``--model small-bert``: issue 28's 2-layer, 128-wide ``BertModel`` at 0.3 with the defaults
(32x64 ids), against the same model dense. Beside the profile, each step's wall time
(timed unprofiled): where it far exceeds the kernels' sum, the host's dispatch is the
step; and the same step captured as a CUDA graph (``TrainStep(cuda_graph=True)``).
The compiled model runs with the defaults, with every batch merging into thin factors
(``tuning.WHOLE_MATRICES = False``: no whole matrices) and with each layer merging its own
cores (``tuning.GROUP_FACTORS = False``; :mod:`tncompile.runtime.layers.factor_groups` batches the
merges of layers of the same modes), each also after cuts that leave every TT linear
its own ranks (``common.cut_every_layer``: padded batches), so the run shows what
batching and whole matrices save. Writes ``benchmarks/results/gpu_kernels.json``
(``gpu_kernels_small_bert.json``) with the device's copy bandwidth and GEMM throughput.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import tncompile
from tncompile import tuning
from tncompile.train import TrainStep
from tncompile.testing import six_encoder

from common import cut_every_layer, machine, parser, write_json

PAPER_RATIO = 1 / 44.9
SEQ = 128

#: kernel kinds, first match wins: (kind, substrings of the lower-cased kernel name)
KINDS = (
    ("triton (tncompile)", ("_thin_pair_kernel", "_gather_kernel", "_scatter_kernel", "_tasks_kernel",
                            "_finish_kernel")),
    ("triton (inductor)", ("triton_",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("gemm", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "ampere_", "splitk", "dot_kernel")),
    ("norm/softmax", ("norm", "softmax", "reduce")),
    ("elementwise/copy", ("elementwise", "copy", "vectorized", "fill", "index", "gather", "scatter", "cat",
                          "where", "dropout", "bernoulli", "philox")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _annotation(event) -> bool:
    """A range on the GPU timeline (``record_function``, e.g. ``Optimizer.step#AdamW.step``,
    which spans the optimizer's kernels), not a kernel."""
    return bool(getattr(event, "is_user_annotation", False)) or "#" in event.name \
        or event.name.startswith("ProfilerStep")


def profile_step(step, x, y, steps: int, peak_tflops: float | None = None) -> dict:
    """Kernel count and GPU time per step, by kind, and the costliest kernels; and per
    matrix-product op (``aten::mm``, ``addmm``, ``bmm``, ...: the profiler counts their
    FLOPs) calls, GPU ms and achieved TFLOP/s (its share of ``peak_tflops`` where given)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_flops=True) as prof:
        for _ in range(steps):
            step(x, y)
        torch.cuda.synchronize()
    ops = []
    for avg in prof.key_averages():
        gpu_us = getattr(avg, "device_time_total", None) or getattr(avg, "cuda_time_total", 0)
        if avg.flops and gpu_us:
            tflops = avg.flops / (gpu_us * 1e-6) / 1e12
            ops.append({"op": avg.key, "calls": avg.count / steps, "ms": round(gpu_us / steps / 1e3, 4),
                        "tflop_per_s": round(tflops, 2),
                        **({"of_peak": round(tflops / peak_tflops, 3)} if peak_tflops else {})})
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or _annotation(event):
            continue
        us = event.time_range.elapsed_us()
        for table, key in ((by_kind, kind_of(event.name)), (by_name, event.name)):
            table[key][0] += 1
            table[key][1] += us
    kernels = sum(c for c, _ in by_kind.values())
    gpu_us = sum(t for _, t in by_kind.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {"kernels_per_step": kernels / steps, "gpu_ms_per_step": gpu_us / steps / 1e3,
            "by_kind": {k: {"kernels": c / steps, "ms": round(t / steps / 1e3, 4)}
                        for k, (c, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
            "top": [{"kernel": n[:120], "kind": kind_of(n), "calls": c / steps, "ms": round(t / steps / 1e3, 4)}
                    for n, (c, t) in top],
            "matmul_ops": sorted(ops, key=lambda r: -r["ms"])}


#: dense; compiled with the defaults; compiled with every batch merging into thin factors
#: (``tuning.WHOLE_MATRICES = False``: what whole matrices save); compiled with each layer
#: merging its own cores (``tuning.GROUP_FACTORS = False``: what batching the merges saves)
#: variant -> (compiled, merges batched, whole matrices allowed, after cuts)
VARIANTS = {"dense": (False, True, True, False),
            "compiled": (True, True, True, False),
            "compiled, thin products": (True, True, False, False),
            "compiled, per-layer merges": (True, False, False, False),
            "after cuts": (True, True, True, True),
            "after cuts, thin products": (True, True, False, True),
            "after cuts, per-layer merges": (True, False, False, True)}


def timed_ms(step, x, y, steps: int) -> float:
    """Wall milliseconds per step of ``step(x, y)`` after 4 untimed steps (a captured
    TrainStep warms up and captures in them), up to a device synchronize."""
    for _ in range(4):
        step(x, y)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def _six_encoder(batch: int, device):
    """The paper's six-encoder at 1/44.9, cross-entropy over 3 classes."""
    x = torch.randint(1, 30522, (batch, SEQ), device=device)
    y = torch.randint(0, 3, (batch,), device=device)

    def build(compiled: bool):
        model = six_encoder().to(device)
        if compiled:
            model = tncompile.compile(model, target_ratio=PAPER_RATIO, init="random",
                                      batch_sizes=[batch * SEQ]).to(device)
        return model, F.cross_entropy
    return x, y, build


def _small_bert(batch: int, device):
    """bench_small_models' BertModel (hidden 128, 2 layers, FFN 512) over 64 ids a
    sample, compiled with the defaults at 0.3; a mean-square loss on the last hidden state."""
    from bench_small_models import FAMILIES  # noqa: PLC0415 - needs transformers, this model only
    x = {"input_ids": torch.randint(0, 1000, (batch, 64), device=device)}

    def build(compiled: bool):
        model = FAMILIES["bert"](64)[1].train().to(device)
        if compiled:
            model = tncompile.compile(model, target_ratio=0.3, example_inputs=x)
        return model, (lambda out, _: out.last_hidden_state.square().mean())
    return x, None, build


MODELS = {"six-encoder": _six_encoder, "small-bert": _small_bert}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 32 (small-bert: 32)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--model", choices=list(MODELS), default="six-encoder")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_kernels needs a CUDA GPU")
    device = torch.device("cuda")
    rows = []
    for batch in args.batches or ([32] if args.model == "small-bert" else [1, 32]):
        torch.manual_seed(0)
        x, y, build = MODELS[args.model](batch, device)
        for name, (compiled, batched, whole, cut) in VARIANTS.items():
            with tuning.override(GROUP_FACTORS=batched, WHOLE_MATRICES=whole):  # before compile: ranks see it too
                torch.manual_seed(0)
                model, loss_fn = build(compiled)
                if cut:
                    cut_every_layer(model)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                step = TrainStep(model, opt, loss_fn, cuda_graph=False)
                wall_ms = timed_ms(step, x, y, args.steps)
                result = profile_step(step, x, y, args.steps)
                captured = TrainStep(model, opt, loss_fn, cuda_graph=True)
                captured_ms = timed_ms(captured, x, y, args.steps)  # the first steps warm up and capture
                rows.append({"batch": batch, "model": name, "wall_ms_per_step": round(wall_ms, 3),
                             "captured_ms_per_step": round(captured_ms, 3), **result})
                kinds = ", ".join(f"{k} {v['kernels']:.0f}/{v['ms']:.2f} ms" for k, v in result["by_kind"].items())
                print(f"batch {batch:4d} {name:30s} {result['kernels_per_step']:7.0f} kernels  "
                      f"{result['gpu_ms_per_step']:7.2f} ms of kernels, {wall_ms:7.2f} ms eager, "
                      f"{captured_ms:7.2f} ms captured per step  ({kinds})", flush=True)
                del model, opt, step, captured
                torch.cuda.empty_cache()
    suffix = "" if args.model == "six-encoder" else "_" + args.model.replace("-", "_")
    path = write_json(f"gpu_kernels{suffix}.json", {"benchmark": "gpu_kernels", "model": args.model,
                                                    "gpu": torch.cuda.get_device_name(), "rows": rows,
                                                    **machine(device)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
