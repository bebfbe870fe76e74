"""The choice among ways that are all correct, measured on the device in use.

The first time a layer's shape meets a bucket of rows in a differentiable eager call,
each candidate way is timed forward and backward on that call's input (a detached copy;
the gradients are returned by ``torch.autograd.grad``, never accumulated into ``.grad``),
and the fastest is kept for every later call of the same shape: in this process, and,
where ``tuning.WAY_CACHE_DIR`` names a folder, on disk for the next one -- keyed by the
device, torch and tncompile versions, as inductor's autotuning cache is. Under
``torch.compile``, ``torch.export``, a CUDA-graph capture, activation checkpointing or
fake tensors nothing is measured: a known winner is used, else the cost model's prior.
Under ``torch.use_deterministic_algorithms(True)`` the prior alone decides, so two runs
take the same ways. In a process of several (``torch.distributed``) nothing is timed either
(replicas must compute alike): winners come from the disk cache, else the prior. Timing
draws its inputs from a generator of its own: the caller's random stream never moves.

A cache file is data read from outside: it is refused whole (:class:`UserWarning`, then
ignored) unless it is a regular file (no link, FIFO or device) holding a JSON object of at
most :data:`MAX_FILE_BYTES`, with at most :data:`MAX_ENTRIES` string keys of at most 512
characters whose values are way names the caller knows; nothing in it is ever run. Its
folder is made 0700 and refused when another user owns it or others may write to it; the
file is written atomically (a link planted at its path is replaced, not followed).

A way from a cache file or a checkpoint is a hint: it is taken only where it is one of the
candidates of that op, shape and device in this process (a lookup's way offered to a
linear, or a native kernel's while native kernels are off, is not); otherwise it is
dropped, with one warning, and measured afresh. The ways a checkpoint installs
(:func:`install`) are kept apart from those measured here and never reach the disk cache.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import platform
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ... import tuning
from ...files import private_folder, read_bounded, write_replacing
from ..kernels.plans import bucket_of
from ..kernels.tracing import exporting
from .network import recorded_elsewhere

__all__ = ["applies", "may_measure", "snapshot", "install", "check_winners", "register_ways", "winner", "fastest_of",
           "forward_backward_timer", "time_once", "race", "record_winner", "stats", "forget", "cache_file", "MAX_ENTRIES", "MAX_FILE_BYTES"]

log = logging.getLogger("tncompile.ways")

MAX_FILE_BYTES = 4 << 20
MAX_ENTRIES = 100_000
_FORMAT = 1

_WINNERS: dict[str, str] = {}           # key -> way value, measured here or read from the disk cache
_HINTS: dict[str, str] = {}             # key -> way value a checkpoint installed: never written to disk
_WARNED: set[str] = set()               # sources already warned about a way that is no candidate
_LOADED: set[str] = set()               # cache files read into _WINNERS
_STATS = {"measured": 0, "hits": 0, "seconds": 0.0}
_NOTICED: list[str] = []                # the key whose measuring passed tuning.MEASURE_NOTICE_S
GENERATION = [0]                        # moves when winners are installed or forgotten
_KNOWN: set[str] = set()                # every way a cache file may name (registered by the ops)


def register_ways(values: Iterable[str]) -> None:
    """Add the names of an op's measurable ways: what a cache file may hold."""
    _KNOWN.update(values)


def stats() -> dict[str, float]:
    """How many shapes were measured in this process, how many calls found a winner, and
    the seconds measuring took."""
    return dict(_STATS)


def forget() -> None:
    """Drop every winner known in memory (a disk cache is read again on next use)."""
    _WINNERS.clear()
    _HINTS.clear()
    _LOADED.clear()
    GENERATION[0] += 1
    _STATS.update(measured=0, hits=0, seconds=0.0)


def applies(like: torch.Tensor, export_checked: bool = False) -> bool:
    """Whether a call on tensors like ``like`` may use the measured choice: switched on,
    differentiable, eager (not traced nor exported; ``export_checked``: the caller knows
    it is not exporting), on a real tensor, and not under
    ``torch.use_deterministic_algorithms`` (a timing may differ between runs; the prior
    does not). Read on every call of a TT linear: the cheapest checks first, the compile
    check before one Dynamo cannot trace."""
    return tuning.MEASURE_WAYS and torch.is_grad_enabled() and type(like) is torch.Tensor \
        and not torch.compiler.is_compiling() and not torch._C._get_deterministic_algorithms() \
        and like.device.type in ("cpu", "cuda") and (export_checked or not exporting())


def may_measure(like: torch.Tensor) -> bool:
    """Whether timing may run now: not inside a CUDA-graph capture or under saved-tensor
    hooks (activation checkpointing must record the same ops when it recomputes)."""
    if like.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return not recorded_elsewhere() and not _several_processes()


def _several_processes() -> bool:
    """Whether this process is one of several (``torch.distributed``): each would time for
    itself and might choose differently, so replicas would no longer compute bit for bit
    alike; they use known winners (a disk cache filled by one process) or the prior."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def device_name(device: torch.device) -> str:
    """The device as the cache knows it: the GPU's name, or the CPU's model and threads."""
    if device.type == "cuda":
        return _gpu_name(device.index if device.index is not None else torch.cuda.current_device())
    return f"cpu:{_cpu_model()}:{torch.get_num_threads()}t"


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    return f"{platform.machine()}:{platform.processor() or 'unknown'}"


def key_of(op: str, shape: tuple, like: torch.Tensor, rows: int, candidates: Iterable[str]) -> str:
    """The cache's key: the op, its shape, the rows' bucket, the dtype (autocast's where on),
    the device and the candidates compared."""
    device = like.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else like.dtype
    return "|".join((op, repr(shape), str(rows), str(dtype), device_name(device), ",".join(candidates)))


def cache_file() -> Path | None:
    """The disk cache of this device and versions, where ``tuning.WAY_CACHE_DIR`` is set."""
    folder = tuning.WAY_CACHE_DIR
    if not folder:
        return None
    version = _package_version()
    tag = f"torch{torch.__version__}-tncompile{version}".replace("/", "_").replace(" ", "_")
    return Path(folder) / f"ways-{tag}.json"


def _package_version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415
        return version("tncompile")
    except Exception:  # noqa: BLE001 -- run from a source tree
        return "source"


def _read_disk(path: Path) -> None:
    if str(path) in _LOADED:
        return
    _LOADED.add(str(path))
    try:
        raw = read_bounded(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        return
    except OSError as err:
        warnings.warn(f"tncompile: ignoring the measured-ways cache {path}: {err}", UserWarning, stacklevel=4)
        return
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("winners"), dict):
            raise ValueError("not a tncompile ways cache")
        winners = check_winners(data["winners"])
    except (ValueError, RecursionError) as err:
        warnings.warn(f"tncompile: ignoring the measured-ways cache {path}: {err}", UserWarning, stacklevel=4)
        return
    for key, way in winners.items():
        _WINNERS.setdefault(key, way)


def check_winners(winners) -> dict[str, str]:
    """``winners`` if it is a dict of at most :data:`MAX_ENTRIES` string keys of at most 512
    characters, each naming a way tncompile knows; else ``ValueError``."""
    if not isinstance(winners, dict):
        raise ValueError("the winners must be a dict of way names")
    if len(winners) > MAX_ENTRIES:
        raise ValueError(f"more than {MAX_ENTRIES} entries")
    for key, way in winners.items():
        if not isinstance(key, str) or len(key) > 512 or not isinstance(way, str) or way not in _KNOWN:
            raise ValueError(f"entry {str(key)[:80]!r} is not a known way")
    return winners


def snapshot() -> dict[str, str]:
    """The winners this process knows (what a checkpoint keeps, so a resumed run takes the
    same ways and continues bit for bit)."""
    return {**_WINNERS, **_HINTS}


def install(winners: dict[str, str]) -> None:
    """Take ``winners`` (checked: :func:`check_winners`; a checkpoint's) over any known for
    the same keys, as hints kept apart from the disk cache, and forget every layer's cached
    choice made from others (``layer._measured_choice`` is keyed by the settings below; a new
    generation starts them afresh)."""
    _HINTS.update(check_winners(winners))
    GENERATION[0] += 1


def _write_disk(path: Path) -> None:
    try:
        private_folder(path.parent)
        write_replacing(path, json.dumps({"format": _FORMAT, "winners": _WINNERS}, sort_keys=True))
    except OSError as err:
        warnings.warn(f"tncompile: could not write the measured-ways cache {path}: {err}", UserWarning, stacklevel=4)


def winner(key: str, candidates: tuple[str, ...], make_timer: Callable[[], Callable[[str], float]],
           like: torch.Tensor) -> str | None:
    """The fastest of ``candidates`` for ``key``: known (memory, then disk), or measured
    now where timing may run, with ``make_timer()``'s ``time_way(way) -> seconds`` (made
    once, only then); else ``None``."""
    got = _known(key, candidates, _HINTS, "a checkpoint")
    path = cache_file()
    if got is None and path is not None:
        _read_disk(path)
    if got is None:
        got = _known(key, candidates, _WINNERS, "the measured-ways cache" if path is not None else "this process")
    if got is not None:
        _STATS["hits"] += 1
        return got
    if len(candidates) == 1:
        return candidates[0]
    if not may_measure(like):
        return None
    start = time.perf_counter()
    got = race(make_timer(), candidates)
    record_winner(key, got)
    _STATS["measured"] += 1
    _STATS["seconds"] += time.perf_counter() - start
    _notice_if_long(key)
    return got


def race(time_way: Callable[[str], float], candidates: Sequence[str]) -> str:
    """The fastest of ``candidates`` by ``time_way(way) -> seconds of one run``.

    Each runs once to warm up (first calls carry one-time costs: allocations, plans); a way
    slower than the fastest warm-up by over ``tuning.MEASURE_WARMUP_SLACK`` drops out, and
    one whose warm-up took over ``tuning.MEASURE_LONG_S`` is timed by that run alone. Then
    up to ``tuning.MEASURE_REPEATS`` rounds, each timing the ways still in the race once
    and dropping those slower than the best so far by over ``tuning.MEASURE_RACE_SLACK``,
    stopping early when all left are within ``tuning.MEASURE_TIE`` of the fastest (a tie);
    the fastest single run wins. A clear winner thus costs about two runs per candidate
    instead of ``1 + MEASURE_REPEATS``."""
    first = {way: time_way(way) for way in candidates}
    floor = min(first.values())
    entrants = [way for way in candidates if first[way] <= tuning.MEASURE_WARMUP_SLACK * floor]
    best = {way: first[way] for way in entrants if first[way] > tuning.MEASURE_LONG_S}
    alive = [way for way in entrants if first[way] <= tuning.MEASURE_LONG_S]
    for _ in range(max(1, tuning.MEASURE_REPEATS)):
        if len(set(alive) | set(best)) <= 1 or (len(alive) == 1 and alive[0] in best):
            break  # no contest left
        for way in alive:
            best[way] = min(best.get(way, math.inf), time_way(way))
        fastest = min(best.values())
        alive = [way for way in alive if best[way] <= tuning.MEASURE_RACE_SLACK * fastest]
        contenders = [t for t in best.values() if t <= tuning.MEASURE_RACE_SLACK * fastest]
        if all(t <= tuning.MEASURE_TIE * fastest for t in contenders):
            break  # a tie: whichever wins, the op's time moves less than the noise
    pool = best or {way: first[way] for way in entrants}
    return min(pool, key=pool.__getitem__)


def _notice_if_long(key: str) -> None:
    """One line on stderr, once per process, when measuring has taken
    ``tuning.MEASURE_NOTICE_S``: the first steps are slow for a reason, and it can be kept."""
    if _STATS["seconds"] < tuning.MEASURE_NOTICE_S or _NOTICED:
        return
    _NOTICED.append(key)
    keep = ("kept in " + str(cache_file()) if cache_file() is not None
            else "set TNCOMPILE_WAY_CACHE=<folder> to keep the results for later runs")
    log.warning("tncompile: timing each compressed layer's ways on this device (%.1f s so far, once per layer shape "
                "and batch size, in the first steps only; %s; tncompile.tuning.MEASURE_WAYS = False uses the cost "
                "model's choice instead)", _STATS["seconds"], keep)


def _known(key: str, candidates: tuple[str, ...], known: dict[str, str], source: str) -> str | None:
    """``known[key]`` where it is one of ``candidates``; a way that is not (another op's, or
    a kernel this process does not offer) is dropped with one warning per source."""
    got = known.get(key)
    if got is None or got in candidates:
        return got
    del known[key]
    if source not in _WARNED:
        _WARNED.add(source)
        warnings.warn(f"tncompile: {source} names the way {got!r} for {key.split('|', 1)[0]!r}, which is not one "
                      f"of its candidates here ({', '.join(candidates)}); ignored and measured afresh (further "
                      "such entries from it are ignored silently)", UserWarning, stacklevel=4)
    return None


def fastest_of(owner: torch.nn.Module, op: str, shape: tuple, like: torch.Tensor, rows: int,
               candidates: tuple[str, ...], make_timer: Callable[[], Callable[[str], float]]) -> str | None:
    """The fastest of ``candidates`` for op ``op`` of ``shape`` over ``rows`` rows of tensors
    like ``like`` (:func:`winner`: known, or timed now where timing may run; else ``None``:
    the caller's prior decides). The caller has checked :func:`applies`. The key is built
    once per bucket of rows and context and kept on ``owner`` (plain data: a module is
    deep-copied and pickled), so a call that finds its winner costs one dict lookup."""
    bucket = bucket_of(rows)
    local = (op, bucket, shape, like.dtype, like.device, torch.is_autocast_enabled(like.device.type), GENERATION[0],
             candidates)
    cache = owner.__dict__.get("_measured_blocks")
    if cache is None:
        cache = owner.__dict__["_measured_blocks"] = {}
    got = cache.get(local)
    if got is not None:
        return got
    got = winner(key_of(op, shape, like, bucket, candidates), candidates, make_timer, like)
    if got is not None:
        cache[local] = got
    return got


def record_winner(key: str, way: str) -> None:
    """Keep ``way`` as ``key``'s winner (and write the disk cache where one is set)."""
    _WINNERS[key] = way
    path = cache_file()
    if path is not None:
        _write_disk(path)


def forward_backward_timer(run: Callable[[str], torch.Tensor | Sequence[torch.Tensor]],
                           inputs: Sequence[torch.Tensor], device: torch.device) -> Callable[[str], float]:
    """``time_way(way) -> seconds`` of one run (:func:`time_once`): ``run(way)``'s outputs,
    then their backward to ``inputs`` by ``torch.autograd.grad`` -- nothing accumulates into
    ``.grad``; no backward where ``inputs`` is empty (nothing trains). :func:`race` decides
    how often each way runs."""
    inputs = list(inputs)

    def time_way(name: str) -> float:
        def step() -> None:
            outs = run(name)
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            if inputs:
                torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs], allow_unused=True)
        return time_once(step, device)
    return time_way


def time_once(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes (the device synchronized after it)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start
