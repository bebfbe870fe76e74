"""How fast one device runs a layer's training step: the overhead-aware cost model.

``compile(prefer="speed")`` (the default) keeps a linear dense, or gives its TT
network a lower rank, wherever the network's training step would take longer
than the dense layer's. Counting multiply-adds alone is not enough: a TT step
is a chain of ~18 small kernels (forward and backward), each with a fixed cost
(dispatch, autograd, Python; a node of a CUDA graph), so on small layers a
network with half the multiply-adds of its dense layer can still be slower.

A :class:`DeviceSpeed` holds what the model needs, measured once per device,
torch version and thread count, and cached on disk
(``~/.cache/tncompile/device_speed.json``; ``benchmarks/bench_device_speed.py``
re-measures it and checks the model against timed steps):

* ``gemm_macs_per_s``: multiply-adds per second of a large fp32 GEMM;
* ``copy_bytes_per_s``: bytes read plus written per second by a large copy;
* ``kernel_seconds``: a TT linear's training step at rank 1 over a few rows --
  all fixed cost -- divided by the kernels its plan runs;
* ``dense_call_seconds``: a dense linear's training step over a few rows.

The estimate of one training step (forward, input and weight gradients) is
``fixed + multiply-adds / gemm_macs_per_s + bytes / copy_bytes_per_s``
(:meth:`DeviceSpeed.network_step_seconds`, :meth:`DeviceSpeed.dense_step_seconds`).
The fixed costs are timed eagerly on every device, CUDA included: the step a
plain training loop, ``transformers.Trainer`` or ``torch.compile`` without CUDA graphs
runs, and an upper bound on a step replayed from a CUDA graph
(:class:`~tncompile.train.TrainStep`), whose kernels start without the host's
dispatch -- a layer estimated no slower than dense is no slower captured either.

``tncompile.tuning.DEVICE_SPEED = DeviceSpeed(...)`` -- or the environment variable
``TNCOMPILE_DEVICE_SPEED`` holding :meth:`DeviceSpeed.as_dict` as JSON, which child
processes inherit -- plans for another machine, or makes ranks reproducible across
hosts.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch

from .. import tuning
from ..files import UnsafeFolderError, open_lock_file, private_folder, read_bounded, write_replacing
from ..formats.indices import BATCH, planner_problem
from ..formats.layout import TTLayout, TTMLayout
from ..runtime.kernels.executor import is_merge_first
from ..runtime.kernels.factor_batch import FactorBatch
from ..runtime.ways.linear import register_whole_rule
from ..runtime.kernels.plans import ContractionPlan, LookupPlan
from ..runtime.layers import TTLinear
from .contraction import fixed_order_plan, plan_contraction
from .lookup import plan_lookup
from ..errors import check_float

__all__ = ["DeviceSpeed", "REFERENCE", "device_speed", "measure_device_speed", "layer_step_seconds", "network_kernels",
           "lookup_step_seconds", "lookup_kernels", "cache_path", "speed_key", "known_device_speed",
           "whole_matrix_saving"]


@dataclass(frozen=True)
class DeviceSpeed:
    """Measured speed of one device (see the module docstring for each field)."""

    device: str
    gemm_macs_per_s: float
    copy_bytes_per_s: float
    kernel_seconds: float
    dense_call_seconds: float

    def __post_init__(self) -> None:
        if not isinstance(self.device, str):
            raise TypeError(f"DeviceSpeed.device must be a str, got {type(self.device).__name__}")
        for f in fields(self)[1:]:
            v = getattr(self, f.name)
            check_float(v, f"DeviceSpeed.{f.name}", 0.0, low_open=True)

    def network_step_seconds(self, plan: ContractionPlan, in_features: int, out_features: int,
                             element_bytes: int = 4, sharing: int = 1) -> float:
        """Estimated seconds of a TT linear's training step contracted by ``plan``
        (over ``plan.rows`` rows of ``in_features``): its kernels' fixed cost, the
        plan's forward and backward multiply-adds, and its traffic -- every element
        it writes is written and read back once, and the step reads its input
        twice (forward, core gradients), reads the output gradient twice and
        writes output and input gradient.

        ``sharing``: how many layers of the model merge their cores in one batch with
        this one (:mod:`tncompile.runtime.layers.factor_groups`, merge-cores-first plans):
        the kernels that merge the cores are then shared, the row-wide ones not."""
        rows = plan.rows
        traffic = 2 * plan.write + 3 * rows * (in_features + out_features)
        return (network_kernels(plan, sharing) * self.kernel_seconds
                + (plan.fwd_flops + plan.bwd_flops) / self.gemm_macs_per_s
                + element_bytes * traffic / self.copy_bytes_per_s)

    def dense_step_seconds(self, rows: int, in_features: int, out_features: int, element_bytes: int = 4) -> float:
        """Estimated seconds of a dense linear's training step over ``rows`` rows:
        three GEMMs of ``rows * in * out`` multiply-adds, each reading its two
        operands and writing its result."""
        traffic = 3 * rows * (in_features + out_features) + 3 * in_features * out_features
        return (self.dense_call_seconds + 3 * rows * in_features * out_features / self.gemm_macs_per_s
                + element_bytes * traffic / self.copy_bytes_per_s)

    def lookup_step_seconds(self, plan: LookupPlan, cores: int, embedding_dim: int, element_bytes: int = 4) -> float:
        """Estimated seconds of a TTM embedding's training step over ``plan.rows`` ids
        as ``plan`` splits it: :func:`lookup_kernels` fixed costs, the half tables'
        merge and the per-id products forward and twice backward, and their traffic
        (the largest intermediate written and read back, the rows written, their
        gradient read twice)."""
        traffic = 2 * plan.largest + 3 * plan.rows * embedding_dim
        return (lookup_kernels(cores) * self.kernel_seconds + 3 * plan.fwd_flops / self.gemm_macs_per_s
                + element_bytes * traffic / self.copy_bytes_per_s)

    def embedding_step_seconds(self, ids: int, num_embeddings: int, embedding_dim: int,
                               element_bytes: int = 4, sparse: bool = False) -> float:
        """Estimated seconds of ``nn.Embedding``'s training step over ``ids`` ids: a
        dense call's fixed cost, the rows gathered and their gradient read, and the
        table-sized gradient zeroed and written (``embedding_dense_backward``); with
        ``sparse`` (``sparse=True``: the gradient is the looked-up rows alone) those rows'
        gradient written and added into the table instead of a table-sized one."""
        table = (2 * ids if sparse else 2 * num_embeddings) * embedding_dim
        traffic = 3 * ids * embedding_dim + table
        return self.dense_call_seconds + element_bytes * traffic / self.copy_bytes_per_s

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> "DeviceSpeed":
        """Rebuild from :meth:`as_dict`'s output (a cache file's entry: checked
        field by field, nothing else accepted). Raises ``ValueError``."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names):
            raise ValueError(f"a DeviceSpeed entry must have exactly the keys {names}")
        return cls(**{k: data[k] for k in names})


#: kernels of a merge-cores-first plan's two row-wide steps (a GEMM forward, two backward)
ROW_KERNELS = 6


def merge_family(layout: TTLayout) -> tuple:
    """What TT linears must share to merge their cores in one batch at run time: their
    modes (ranks may differ, :mod:`tncompile.runtime.layers.factor_groups` pads them)."""
    return layout.in_modes, layout.out_modes


def network_kernels(plan: ContractionPlan, sharing: int = 1) -> float:
    """Kernels a TT linear's training step runs by ``plan``, counting those that merge
    its cores as ``1 / sharing`` each when ``sharing`` layers merge theirs in one batch
    (merge-cores-first plans, :mod:`tncompile.runtime.layers.factor_groups`)."""
    if sharing <= 1 or not tuning.GROUP_FACTORS or not is_merge_first(plan) or plan.kernels <= ROW_KERNELS:
        return plan.kernels
    return ROW_KERNELS + (plan.kernels - ROW_KERNELS) / sharing


def layer_step_seconds(layout: TTLayout, rows: int, speed: DeviceSpeed, sharing: int = 1) -> tuple[float, float]:
    """Estimated seconds of one training step over ``rows`` rows on ``speed``'s device:
    ``(network, dense layer)``, the network contracted in the cheaper fixed order
    (:func:`~tncompile.planning.fixed_order_plan`), through its whole matrix where that is
    faster (:func:`whole_matrix_saving`); ``sharing`` as for
    :meth:`DeviceSpeed.network_step_seconds`."""
    plan = fixed_order_plan(layout, rows)
    network = speed.network_step_seconds(plan, layout.in_features, layout.out_features, sharing=sharing)
    if is_merge_first(plan):
        network -= max(0.0, whole_matrix_saving(layout, rows, speed, sharing))
    return network, speed.dense_step_seconds(rows, layout.in_features, layout.out_features)


#: kernels that make a batch's whole matrices from its merged factors: one batched
#: product forward, two backward
WHOLE_KERNELS = 3


def whole_matrix_saving(layout: TTLayout, rows: int, speed: DeviceSpeed, sharing: int, bond: int | None = None,
                        element_bytes: int = 4) -> float:
    """Seconds a merge-cores-first TT linear's training step over ``rows`` rows saves on
    ``speed``'s device by multiplying its input by its whole matrix ``W = A B`` -- made
    for the ``sharing`` layers of its batch in one batched product
    (:mod:`tncompile.runtime.layers.factor_groups`) -- instead of ``x A`` then ``(x A) B``;
    negative where the two thin products are faster.

    The two thin products: :data:`ROW_KERNELS` kernels, ``3 rows r (M + N)``
    multiply-adds, ``x A`` and its gradient written and read. The whole matrix: a dense
    linear's step (``dense_call_seconds``, ``3 rows M N``), plus its share of the batch's
    :data:`WHOLE_KERNELS` products (``3 M r N`` multiply-adds, ``W`` and its gradient
    written and read). ``M``, ``N``: the padded sizes; ``r``: the bond between ``A`` and
    ``B`` (``bond``: the batch's, padded; default the layout's). Whole matrices are
    made in batches only: a layer merging alone (``sharing`` 1) saves nothing by them; nor
    any with ``tuning.WHOLE_MATRICES`` off."""
    if sharing <= 1 or not tuning.GROUP_FACTORS or not tuning.WHOLE_MATRICES:
        return 0.0
    m, n = math.prod(layout.in_modes), math.prod(layout.out_modes)
    r = layout.ranks[len(layout.in_modes) - 1] if bond is None else bond
    pair = (ROW_KERNELS * speed.kernel_seconds + 3 * rows * r * (m + n) / speed.gemm_macs_per_s
            + element_bytes * 4 * rows * r / speed.copy_bytes_per_s)
    whole = (speed.dense_call_seconds + 3 * rows * m * n / speed.gemm_macs_per_s
             + (WHOLE_KERNELS * speed.kernel_seconds + 3 * m * r * n / speed.gemm_macs_per_s
                + element_bytes * 4 * m * n / speed.copy_bytes_per_s) / sharing)
    return pair - whole


def lookup_kernels(cores: int) -> int:
    """Kernels of a TTM lookup's training step over ``cores`` cores, as PyTorch's ops
    run it (CUDA; CPU without the native kernels): forward, the gates and the two half
    tables' merges, the ids split and gathered, one batched product; backward, per half
    table a zeroed gradient, a gather, a product and a scatter-add, then the merges'
    and gates' gradients -- 9 per core and 5 more (counted: 32 at 3 cores, 41 at 4);
    one core, 6."""
    return 6 if cores == 1 else 9 * cores + 5


def lookup_step_seconds(layout: TTMLayout, ids: int, speed: DeviceSpeed,
                        sparse: bool = False) -> tuple[float, float]:
    """Estimated seconds of one training step over ``ids`` ids on ``speed``'s device:
    ``(TTM network, nn.Embedding)``, the network split as :func:`plan_lookup` plans it;
    ``sparse``: the dense table was built with ``sparse=True``."""
    plan = plan_lookup(layout, ids)
    return (speed.lookup_step_seconds(plan, len(layout.row_modes), layout.embedding_dim),
            speed.embedding_step_seconds(ids, layout.num_embeddings, layout.embedding_dim, sparse=sparse))


#: A 2-core x86 CPU of this project's development machines (torch 2.13, 2 threads, copy
#: ~33 GB/s, fp32 GEMM ~190 GFLOP/s): what the test suite plans with, so that ranks
#: do not depend on the host CI runs on.
REFERENCE = DeviceSpeed(device="reference 2-core x86 CPU", gemm_macs_per_s=95e9, copy_bytes_per_s=33e9,
                        kernel_seconds=17e-6, dense_call_seconds=65e-6)

_measured: dict[str, DeviceSpeed] = {}


def speed_key(device: torch.device) -> str:
    """What a measurement is valid for: device (a GPU by name), torch version, CPU threads,
    and how the fixed costs were timed (``eager``: entries cached before, timed on a
    replayed CUDA graph, are measured again)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{device.type}:{name}|torch {torch.__version__}|threads {torch.get_num_threads()}|eager"


def cache_path() -> Path:
    """``$TNCOMPILE_CACHE_DIR/device_speed.json``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    root = os.environ.get("TNCOMPILE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tncompile")
    return Path(root) / "device_speed.json"


#: the device-speed cache holds a few entries of five numbers each: anything larger is not it
MAX_CACHE_BYTES = 1 << 20


def _read_cache() -> dict[str, DeviceSpeed]:
    """The cached measurements; entries that do not check out are dropped (and re-measured).
    A file that is no regular file, a link, or over :data:`MAX_CACHE_BYTES` is not read."""
    try:
        raw = json.loads(read_bounded(cache_path(), MAX_CACHE_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}
    out = {}
    if isinstance(raw, dict):
        for key, entry in raw.items():
            try:
                out[str(key)] = DeviceSpeed.from_dict(entry)
            except (TypeError, ValueError):
                continue
    return out


def _write_cache(entries: dict[str, DeviceSpeed]) -> None:
    path = cache_path()
    try:
        private_folder(path.parent)
        write_replacing(path, json.dumps({k: v.as_dict() for k, v in entries.items()}, indent=1))
    except UnsafeFolderError as e:
        _warn_once(f"tncompile: not caching the device speed: {e}")
    except OSError:
        pass  # a read-only home: measure again next process


def _whole_matrices_faster(layout: TTLayout, rows: int, device: torch.device, batch: FactorBatch) -> bool:
    """The rule :mod:`tncompile.runtime.layers.factor_groups` asks: :func:`whole_matrix_saving`
    positive on ``device``'s known speed, for ``batch``'s layer count and padded bond."""
    speed = known_device_speed(device)
    return speed is not None and whole_matrix_saving(layout, rows, speed, batch.n, bond=batch.a.padded[0][1]) > 0


register_whole_rule(_whole_matrices_faster)


def _override() -> DeviceSpeed | None:
    """``tuning.DEVICE_SPEED``, else ``$TNCOMPILE_DEVICE_SPEED``, else ``None``."""
    override = tuning.DEVICE_SPEED
    if override is None and os.environ.get("TNCOMPILE_DEVICE_SPEED"):
        override = _from_environment(os.environ["TNCOMPILE_DEVICE_SPEED"])
    if override is not None and not isinstance(override, DeviceSpeed):
        raise TypeError(f"tncompile.tuning.DEVICE_SPEED must be a DeviceSpeed or None, got "
                        f"{type(override).__name__}")
    return override


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current>`` (one cache entry per GPU)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


_looked_up: set[str] = set()  # speed keys whose cache entry known_device_speed has read


def known_device_speed(device: torch.device) -> DeviceSpeed | None:
    """:func:`device_speed`'s answer for ``device`` where it needs no measurement (the
    override, this process's figures, the cache file: read once per device and process),
    else ``None``. Cheap, launches no kernel: what layers consult while they run."""
    override = _override()
    if override is not None:
        return override
    if device.type not in ("cpu", "cuda"):
        return REFERENCE
    if device.type == "cuda" and not torch.cuda.is_available():
        return None  # fake CUDA tensors (a dry run on a machine without a GPU)
    key = speed_key(_indexed(device))
    if key not in _measured and key not in _looked_up:
        _looked_up.add(key)
        cached = _read_cache().get(key)
        if cached is not None:
            _measured[key] = cached
    return _measured.get(key)


def device_speed(device: torch.device | str = "cpu", remeasure: bool = False) -> DeviceSpeed:
    """The speed ``compile(prefer="speed")`` plans with for ``device``:
    ``tuning.DEVICE_SPEED`` when set, else ``$TNCOMPILE_DEVICE_SPEED``, else this
    device's cached measurement,
    else measured now (about a second) and cached. Devices that cannot be
    timed (``meta``) get :data:`REFERENCE`."""
    override = None if remeasure else _override()
    if override is not None:
        return override
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return REFERENCE
    device = _indexed(device)
    key = speed_key(device)
    if not remeasure and key in _measured:
        return _measured[key]
    # one process measures, the others wait and read its figures: processes of one job on a host
    # (DDP ranks compiling the same model) must size their networks alike
    with _cache_lock():
        cached = None if remeasure else _read_cache().get(key)
        if cached is None:
            cached = measure_device_speed(device)
            entries = _read_cache()
            entries[key] = cached
            _write_cache(entries)
    _measured[key] = cached
    return cached


@contextlib.contextmanager
def _cache_lock():
    """An exclusive lock on ``device_speed.lock`` beside the cache (POSIX ``flock``;
    released when the process exits, so a killed process cannot leave it held).
    Without ``fcntl`` or a writable folder, no lock."""
    try:
        import fcntl
        path = cache_path().with_suffix(".lock")
        private_folder(path.parent)
        handle = open_lock_file(path)
    except UnsafeFolderError as e:
        _warn_once(f"tncompile: not caching the device speed: {e}")
        yield
        return
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def _from_environment(text: str) -> DeviceSpeed:
    """``TNCOMPILE_DEVICE_SPEED``: a JSON object with :class:`DeviceSpeed`'s fields."""
    try:
        return DeviceSpeed.from_dict(json.loads(text))
    except (TypeError, ValueError) as e:
        raise ValueError(f"TNCOMPILE_DEVICE_SPEED must be a JSON object with the fields "
                         f"{[f.name for f in fields(DeviceSpeed)]} (positive numbers but 'device'), as "
                         f"DeviceSpeed.as_dict() writes them: {e}") from None


def measure_device_speed(device: torch.device | str = "cpu") -> DeviceSpeed:
    """Time the four figures of a :class:`DeviceSpeed` on ``device`` (best of several
    runs each; about a second on a 2-core CPU). Copy: a 64 MB (CPU) or 1 GB (CUDA)
    fp32 copy. GEMM: a square fp32 ``mm`` (1024 on CPU, 8192 on CUDA). Fixed costs:
    the training step (``y.backward(dy)``) of a 64 -> 64 dense linear, and of its
    3-core rank-1 TT network, over a few rows, run eagerly (on CUDA too)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    numel = 2**28 if cuda else 2**24
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), device, reps=5)
    del src, dst
    n = 8192 if cuda else 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    gemm_s = _best(lambda: torch.mm(a, b), device, reps=5)
    del a, b

    rows = tuning.CHAIN_ROWS + 2  # past the few-row chain kernel: the planned contraction runs
    layout = TTLayout.for_shape(64, 64, 3).with_ranks(1)
    dense = torch.nn.Linear(64, 64).to(device)
    network = TTLinear(layout).to(device)
    dense_s = _step_seconds(dense, rows, device)
    network_s = _step_seconds(network, rows, device)
    inputs, output, sizes = planner_problem(layout)
    kernels = plan_contraction(inputs, output, {**sizes, BATCH: rows}, batch=BATCH).kernels  # the plan it ran
    return DeviceSpeed(device=f"cuda:{torch.cuda.get_device_name(device)}" if cuda else "cpu", gemm_macs_per_s=n**3 / gemm_s,
                       copy_bytes_per_s=2 * numel * 4 / copy_s, kernel_seconds=network_s / kernels,
                       dense_call_seconds=dense_s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], object], device: torch.device, reps: int, calls: int = 1) -> float:
    """Fastest of ``reps`` timings of ``calls`` back-to-back calls, per call."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def _step_seconds(module: torch.nn.Module, rows: int, device: torch.device) -> float:
    """One eager training step of ``module`` (forward, backward into inputs and
    parameters) over ``rows`` rows, up to a device synchronize."""
    x = torch.randn(rows, 64, device=device, requires_grad=True)
    dy = torch.randn(rows, 64, device=device)

    def step() -> None:
        module(x).backward(dy)

    for _ in range(5):
        step()
    return _best(step, device, reps=7, calls=50)
