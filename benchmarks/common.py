"""Shared benchmark helpers: timing, machine info, JSON output."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path(__file__).parent / "results"


def parser(doc: str) -> argparse.ArgumentParser:
    """Every benchmark's command line: ``--help`` prints its whole docstring as written
    (what it measures, its variants, the result file)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def median_ms(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def interleaved_ms(fns: dict[str, Callable[[], None]], reps: int, warmup: int = 1,
                   setup: Callable[[], None] | None = None,
                   device: str | torch.device = "cpu") -> dict[str, float]:
    """Median ms of each function, measured round-robin (one call of each per
    round) so that drift in a shared machine's speed hits every variant alike.
    The order is shuffled every round (seeded): the call after a big one (a
    dense layer's weight gradient evicts the caches) must not always be the
    same variant. (Rotating the order is not enough: it keeps the cyclic
    order, so one variant would follow the big one in almost every round.)
    ``setup`` runs, untimed, before every call (e.g. setting gradients to
    ``None``, as ``optimizer.zero_grad()`` does between training steps). On a
    CUDA ``device`` every call is timed up to a synchronize (its kernels done).

    ``warmup`` rounds run first, alternating like the timed ones. With large
    models that matters: while two models' steps alternate, the process heap
    keeps growing for a few rounds and the step that touches new memory pays
    for the page faults (measured on the six-encoder at 32x128: ~100k faults,
    0.2-0.5 s per compiled step, in each of the first three rounds; none after)."""
    for _ in range(warmup):  # warm-up rounds alternate too: the heap settles only then
        for fn in fns.values():
            if setup is not None:
                setup()
            fn()
    _sync(torch.device(device))
    names = list(fns)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        shuffle(names)
        for name in names:
            fn = fns[name]
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            _sync(torch.device(device))
            samples[name].append(time.perf_counter() - start)
    return {k: 1000 * statistics.median(v) for k, v in samples.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_speed(device: str | torch.device = "cpu") -> dict:
    """The device's measured memory copy bandwidth and fp32 GEMM throughput.

    The machines are shared and their memory bandwidth differs ~5x from one
    host to the next, so every figure is recorded next to what this host
    could do when it was measured. Copy: ``dst.copy_(src)`` of a 64 MB (CPU)
    or 1 GB (CUDA) fp32 tensor, bytes read plus written, best of 7. GEMM:
    square fp32 ``mm`` (2048 on CPU, 8192 on CUDA; TF32 as the process has it
    set), best of 5. Returns ``{"copy_gb_per_s", "gemm_gflop_per_s", "speed_device"}``.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    numel = (2**28 if cuda else 2**24)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    n = 8192 if cuda else 2048
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def best(fn, reps: int) -> float:
        fn()
        _sync(device)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
        return min(times)

    copy_s = best(lambda: dst.copy_(src), 7)
    gemm_s = best(lambda: torch.mm(a, b), 5)
    return {"copy_gb_per_s": round(2 * numel * 4 / copy_s / 1e9, 1),
            "gemm_gflop_per_s": round(2 * n**3 / gemm_s / 1e9, 1),
            "speed_device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"}


def machine(device: str | torch.device = "cpu") -> dict:
    """Machine, versions, threads, and the measured speed of ``device`` (:func:`host_speed`)."""
    return {"machine": platform.machine(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), **host_speed(device)}


def clear_grads(*tensors_or_modules) -> Callable[[], None]:
    """A ``setup`` for :func:`interleaved_ms` that sets the gradients of the
    given tensors and modules' parameters to ``None`` (no accumulation
    between timed calls, as in training with ``zero_grad()``)."""
    leaves = []
    for t in tensors_or_modules:
        leaves.extend(t.parameters() if isinstance(t, torch.nn.Module) else [t])

    def setup() -> None:
        for leaf in leaves:
            leaf.grad = None
    return setup


def write_json(name: str, payload: dict) -> Path:
    """``payload`` as ``benchmarks/results/<name>`` (:func:`write_result`)."""
    return write_result(RESULTS / name, payload)


def write_result(path: str | os.PathLike, payload: dict | str | bytes) -> Path:
    """``payload`` (a dict as indented JSON) written whole to ``path`` by a temporary file
    renamed over it (``tncompile.files.write_replacing``): a reader never sees half a
    result, and a link at ``path`` is replaced, not written through."""
    from tncompile.files import write_replacing
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_replacing(path, json.dumps(payload, indent=1) if isinstance(payload, dict) else payload, mode=None)
    return path


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """A matplotlib figure as a PNG at ``path`` (``tncompile.files.write_figure``), then closed."""
    import matplotlib.pyplot as plt

    from tncompile.files import write_figure
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_figure(fig, path, dpi=dpi)
    plt.close(fig)
    return path


def read_row(path: Path, protocol: dict, max_bytes: int, differs: str = "") -> object | None:
    """The ``"row"`` of a study's finished-row file at ``path`` (``None`` when there is no
    file), read bounded and unfollowed: a ``ValueError`` names an unreadable file or one
    written under another ``protocol`` (``differs``: what such a protocol varies in). The
    caller checks the row's own fields."""
    if not (path.exists() or path.is_symlink()):
        return None
    from tncompile.files import read_bounded
    try:
        data = json.loads(read_bounded(path, max_bytes))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable row ({e}); delete it to run the row again") from e
    if not isinstance(data, dict) or data.get("protocol") != protocol:
        raise ValueError(f"{path} was measured under another protocol{f' ({differs})' if differs else ''}; give "
                         "this study its own --run-dir, or delete the folder's rows to start over")
    if data.get("row") is None:
        raise ValueError(f"{path}: not a finished row; delete it to run the row again")
    return data["row"]


def cut_every_layer(model: torch.nn.Module, seed: int = 0) -> list[tuple[int, ...]]:
    """Cut each TT linear's bonds to a seeded random 60-100% of their ranks (each layer
    its own); returns the ranks left."""
    from tncompile.passes import replan_module  # noqa: PLC0415
    from tncompile.passes.truncate_ranks import cut_ranks  # noqa: PLC0415
    from tncompile.runtime import TTLinear  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    ranks = []
    for layer in (m for m in model.modules() if isinstance(m, TTLinear)):
        keep = [torch.arange(max(1, round(r * (0.6 + 0.4 * torch.rand((), generator=g).item()))))
                for r in layer.layout.ranks]
        cut_ranks(layer, keep)
        replan_module(layer)
        ranks.append(tuple(layer.layout.ranks))
    return ranks


def galore_optimizer(model: torch.nn.Module, lr: float = 1e-4, rank: int = 128,
                     select: Callable[[str, torch.Tensor], bool] | None = None) -> torch.optim.Optimizer:
    """GaLore's AdamW (``galore-torch``, rank ``rank``, projection every 200 steps, scale 0.25)
    over ``model``: its 2-D weights but embeddings projected (``select(name, param)``: those
    it says), the rest plain AdamW.
    ``galore_torch``'s package ``__init__`` imports bitsandbytes for its 8-bit optimizer,
    which GaLoreAdamW does not use: the package is entered without it. ``ImportError``
    when galore-torch is not installed."""
    if "galore_torch" not in sys.modules:   # entered once (a second find_spec would fail on the bare package)
        spec = importlib.util.find_spec("galore_torch")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("galore_torch is not installed (pip install --no-deps galore-torch)")
        package = types.ModuleType("galore_torch")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["galore_torch"] = package
    from galore_torch.adamw import AdamW as GaLoreAdamW  # noqa: PLC0415 - optional
    select = select or (lambda n, p: p.dim() == 2 and "embedding" not in n)
    big = [p for n, p in model.named_parameters() if select(n, p)]
    ids = {id(p) for p in big}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return GaLoreAdamW([{"params": rest},
                        {"params": big, "rank": rank, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}],
                       lr=lr)

