"""Per-step time and peak memory: dense and compiled, eager and captured (CUDA graphs).

    python benchmarks/bench_runtime.py                    # CUDA if present: batches 1, 32, 128
    python benchmarks/bench_runtime.py --batches 1 8      # CPU: eager variants only

The paper's six-encoder (sequence 128), AdamW, one full training step per call
through :class:`tncompile.TrainStep`. On CUDA also GaLore
(``galore-torch``'s ``GaLoreAdamW``, rank 128) on the dense model at batch 1,
for CoMERA's memory / speed comparison. Variants are timed in one run;
``gpu-runtime.json`` or ``cpu-runtime.json`` in ``benchmarks/results/``.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.nn.functional as F

import tncompile
from tncompile.train import TrainStep
from tncompile.runtime.kernels.cpu_allocator import retain_freed_memory
from tncompile.testing import six_encoder

from common import galore_optimizer, machine, parser, write_json

PAPER_RATIO = 1 / 44.9
SEQ = 128


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, x, y, device, warmup: int, reps: int) -> tuple[float, dict]:
    """Median ms per step of ``step(x, y)`` and its memory (MB, CUDA only).

    Memory: ``peak_mb`` is the peak allocated since the caller's last
    ``reset_peak_memory_stats`` (the caller resets it before building the
    model, so it covers weights, optimizer state, warm-up and any CUDA-graph
    capture: a captured graph's private pool is allocated during capture and
    would be missed by a peak taken over replays alone); ``reserved_mb`` is
    what the caching allocator holds at the end (the graph pools included)."""
    for _ in range(warmup):
        step(x, y)
    _sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step(x, y)
        _sync(device)
        times.append(time.perf_counter() - t)
    memory = {}
    if device.type == "cuda":
        memory = {"peak_mb": torch.cuda.max_memory_allocated() / 2**20,
                  "reserved_mb": torch.cuda.memory_reserved() / 2**20}
    return statistics.median(times) * 1e3, memory


def _fresh_memory_stats(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _line(batch: int, name: str, ms: float, memory: dict) -> str:
    text = f"batch {batch:4d}  {name:18s} {ms:9.1f} ms"
    if memory:
        text += f"  peak {memory['peak_mb']:8.0f} MB  reserved {memory['reserved_mb']:8.0f} MB"
    return text


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        retain_freed_memory()  # tncompile's CPU setting: no page faults on every step's activations
    batches = args.batches or ([1, 32, 128] if cuda else [1, 8])
    reps = args.reps or (20 if cuda else 3)
    rows = []
    for batch in batches:
        torch.manual_seed(0)
        x = torch.randint(1, 30522, (batch, SEQ), device=device)
        y = torch.randint(0, 3, (batch,), device=device)
        variants = [("dense eager", False, False), ("compiled eager", True, False)]
        if cuda:  # both captured: the comparison a GPU user gets from TrainStep / fit by default
            variants += [("dense captured", False, True), ("compiled captured", True, True)]
        for name, compiled_model, graphed in variants:
            _fresh_memory_stats(device)
            torch.manual_seed(0)
            model = six_encoder().to(device)
            if compiled_model:
                model = tncompile.compile(model, target_ratio=PAPER_RATIO, init="random",
                                          batch_sizes=[batch * SEQ]).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            step = TrainStep(model, opt, F.cross_entropy, cuda_graph=graphed)
            ms, memory = time_steps(step, x, y, device, warmup=4, reps=reps)
            rows.append({"batch": batch, "variant": name, "step_ms": ms, **memory, **step.stats()})
            print(_line(batch, name, ms, memory))
            del model, opt, step
        if cuda and batch == 1:
            try:
                _fresh_memory_stats(device)
                torch.manual_seed(0)
                model = six_encoder().to(device)
                step = TrainStep(model, galore_optimizer(model), F.cross_entropy, cuda_graph=False)
                ms, memory = time_steps(step, x, y, device, warmup=4, reps=reps)
                rows.append({"batch": batch, "variant": "dense GaLore", "step_ms": ms, **memory})
                print(_line(batch, "dense GaLore", ms, memory))
                del model, step
            except ImportError as e:
                rows.append({"batch": batch, "variant": "dense GaLore", "skipped": f"galore-torch not usable: {e}"})
                print(f"GaLore skipped: {e}")
    path = write_json(f"{'gpu' if cuda else 'cpu'}-runtime.json",
                      {"benchmark": "runtime", "device": str(device),
                       "gpu": torch.cuda.get_device_name() if cuda else None, "rows": rows, **machine(device)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
