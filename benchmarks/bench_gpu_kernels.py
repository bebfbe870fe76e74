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


#: bytes per element of the dtypes the profiler names (``record_shapes``' "Input type")
DTYPE_BYTES = {"double": 8, "float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
               "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
#: ops whose output is a matrix product's ``[..., m, n]`` (the others are taken to write as
#: much as their largest input: elementwise ops, copies, casts; an overestimate for reductions)
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}


def op_bytes(name: str, shapes: list, dtypes: list) -> int | None:
    """Bytes an op moves, estimated from its recorded inputs: every tensor input read once,
    and its output written once (a matrix product's ``[..., m, n]``; otherwise the size of
    its largest input). ``None`` where an input's dtype is not a known element type (tensor
    lists, whose element dtypes the profiler does not record)."""
    sizes = []
    for shape, dtype in zip(shapes, dtypes):
        if dtype in ("Scalar", "ScalarList", "", "None", "GenericList") or dtype is None:
            continue
        if dtype not in DTYPE_BYTES or any(isinstance(d, list) for d in shape):
            return None
        numel = 1
        for d in shape:
            numel *= d
        sizes.append((numel * DTYPE_BYTES[dtype], shape, DTYPE_BYTES[dtype]))
    if not sizes:
        return None
    read = sum(b for b, _, _ in sizes)
    if name in MATMUL_OPS:
        (_, a, width), (_, b, _) = sizes[-2:] if name in ("aten::addmm", "aten::baddbmm") else sizes[:2]
        out = 1
        for d in (*a[:-1], b[-1]):
            out *= d
        return read + out * width
    return read + max(b for b, _, _ in sizes)


def kernel_rows(events, steps: int, peak_gb_s: float | None = None, peak_tflops: float | None = None,
                top: int = 40) -> list[dict]:
    """Per kernel name (the ``top`` costliest; the rest summed in one ``(others)`` row): calls
    and GPU microseconds per step, microseconds per call, and -- attributed from the op that
    launched it (its recorded input shapes and dtypes, :func:`op_bytes`; its counted FLOPs),
    split among that op's kernels by their time -- achieved GB/s and TFLOP/s, with their
    shares of the device's measured copy bandwidth (``peak_gb_s``) and GEMM peak
    (``peak_tflops``). Kernels no recorded op launched (inductor's and other Python-launched
    Triton kernels) have time but no bytes or FLOPs. ``events``: ``prof.events()`` of a
    profile over ``steps`` steps with ``record_shapes=True, with_flops=True``."""
    rows: dict[str, dict] = {}
    for event in events:
        kernels = [k for k in getattr(event, "kernels", ()) if k.duration > 0]
        if not kernels:
            continue
        moved = op_bytes(event.name, event.input_shapes or [], getattr(event, "input_dtypes", None) or [])
        total_us = sum(k.duration for k in kernels)
        for k in kernels:
            row = rows.setdefault(k.name, {"kernel": k.name, "kind": kind_of(k.name), "calls": 0, "us": 0.0,
                                           "bytes": 0.0, "flops": 0.0, "unattributed_us": 0.0})
            share = k.duration / total_us
            row["calls"] += 1
            row["us"] += k.duration
            if moved is None:
                row["unattributed_us"] += k.duration
            else:
                row["bytes"] += share * moved
            row["flops"] += share * (event.flops or 0)
    ordered = sorted(rows.values(), key=lambda r: -r["us"])
    if len(ordered) > top:
        rest = ordered[top:]
        ordered = ordered[:top] + [{"kernel": f"(others: {len(rest)} kernels)", "kind": "other",
                                    **{k: sum(r[k] for r in rest) for k in ("calls", "us", "bytes", "flops",
                                                                           "unattributed_us")}}]
    out = []
    for r in ordered:
        seconds = r["us"] * 1e-6
        attributed = (r["us"] - r["unattributed_us"]) * 1e-6
        gb_s = r["bytes"] / attributed / 1e9 if r["bytes"] and attributed > 0 else None
        tflops = r["flops"] / seconds / 1e12 if r["flops"] else None
        row = {"kernel": r["kernel"][:120], "kind": r["kind"], "calls": r["calls"] / steps,
               "us_per_call": round(r["us"] / r["calls"], 2), "ms": round(r["us"] / steps / 1e3, 4),
               "gb_per_s_est": None if gb_s is None else round(gb_s, 1),
               "tflop_per_s": None if tflops is None else round(tflops, 2)}
        if gb_s is not None and peak_gb_s:
            row["of_peak_bw"] = round(gb_s / peak_gb_s, 3)
        if tflops is not None and peak_tflops:
            row["of_peak_flops"] = round(tflops / peak_tflops, 3)
        out.append(row)
    return out


def profile_step(step, x, y, steps: int, peak_tflops: float | None = None, peak_gb_s: float | None = None) -> dict:
    """Kernel count and GPU time per step, by kind; every kernel by name with its achieved
    GB/s and TFLOP/s (:func:`kernel_rows`); and per matrix-product op (``aten::mm``,
    ``addmm``, ``bmm``, ...: the profiler counts their FLOPs) calls, GPU ms and achieved
    TFLOP/s (its share of ``peak_tflops`` where given)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_flops=True,
                 record_shapes=True) as prof:
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
    events = prof.events()
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA or _annotation(event):
            continue
        table = by_kind[kind_of(event.name)]
        table[0] += 1
        table[1] += event.time_range.elapsed_us()
    kernels = sum(c for c, _ in by_kind.values())
    gpu_us = sum(t for _, t in by_kind.values())
    return {"kernels_per_step": kernels / steps, "gpu_ms_per_step": gpu_us / steps / 1e3,
            "by_kind": {k: {"kernels": c / steps, "ms": round(t / steps / 1e3, 4)}
                        for k, (c, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
            "kernels": kernel_rows(events, steps, peak_gb_s, peak_tflops),
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
