"""Native CPU kernels, compiled on first use with ``torch.utils.cpp_extension``.

Where PyTorch has no fast op for what a TT/TTM layer needs:

* ``gathered_product.cpp``: a TTM lookup's ``L[i[t]] @ R[j[t]]`` and its
  backward without materializing the gathered slices (~3x the output), which
  the eager ``index_select`` + ``bmm`` + ``index_add_`` path moves through memory;
* ``thin_gemm.cpp``: the thin GEMMs of a TT layer's wide side (``t @ B + bias``,
  ``x @ A``) and the former's three gradients in one pass over ``dy``;
* ``tt_chain.cpp``: a whole TT linear over a few rows as one op (forward, and a C++ autograd node);
* ``feed_forward.cpp``: ``act(t @ W1 + b1) @ W2``, the wide middle of a
  block of two TT linears, without writing its hidden activation to memory;
* ``dropout.cpp``: dropout with a counter-based (Philox, ``philox.h``)
  generator, one pass each way and a one-byte mask;
* ``denormals.cpp``: flush-to-zero set and restored on every intra-op thread
  (``runtime.kernels.denormals``);
* ``attention.cpp``: scaled dot-product attention with dropout, forward and
  backward, one head's scores at a time in cache, q/k/v read through their
  strides (no head-transposed copies), the dropout mask drawn again in
  backward instead of stored;
* ``small_gemm.h``: the register-blocked small GEMM they share
  (``tensor_checks.h``: their argument checks).

The build needs a C++ compiler and ninja (what ``torch.utils.cpp_extension``
needs); it takes about 40 s of wall time and 80 s of CPU on an idle 2-core host (longer on a
busy one) once per machine, environment (torch
installation, Python ABI) and source version (cached under ``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``, named by a hash of all of them:
:func:`build_name`), announced by one line on stderr before it starts. Without
them, or with ``TNCOMPILE_NATIVE=0``, :func:`native_ops` returns ``None`` and
callers use the eager path, which gives the same results; a failed build is
reported once as a warning.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path

import torch

__all__ = ["native_ops", "native_status", "native_kernels", "kernels_for", "watch",
           "build_name", "clear_stale_lock"]

_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_SOURCES = [str(Path(__file__).with_name(name))
            for name in ("gathered_product.cpp", "thin_gemm.cpp", "tt_chain.cpp", "feed_forward.cpp",
                         "dropout.cpp", "attention.cpp", "denormals.cpp")]
_lock = threading.Lock()
_state: dict = {"ops": None, "tried": False, "error": None, "enabled": True, "watch": None}
log = logging.getLogger("tncompile.native")


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for uses torch's threads (headers: in build_name)
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-march=native")  # built on the machine it runs on: use its vector units
    return flags


def _environment() -> str:
    """What a build is only valid for besides its sources: the torch installation it links
    against (version, git revision, where it is installed, its C++ ABI) and the Python ABI."""
    return "|".join((torch.__version__, str(getattr(torch.version, "git_version", "")),
                     str(Path(torch.__file__).resolve().parent), str(torch._C._GLIBCXX_USE_CXX11_ABI),
                     sys.implementation.cache_tag or "", str(sysconfig.get_config_var("SOABI"))))


def build_name() -> str:
    """The extension's name: ``tncompile_native_<hash of sources, headers, flags and
    environment>``. Two checkouts (or versions) or two virtual environments sharing
    ``TORCH_EXTENSIONS_DIR`` then each keep their own build instead of rebuilding over
    each other (torch rebuilds whenever its build arguments, which name the torch
    installation's headers, differ); identical sources in one environment share one."""
    digest = hashlib.sha1()
    for path in [*_SOURCES, *map(str, _HEADERS)]:
        digest.update(Path(path).name.encode() + Path(path).read_bytes())
    digest.update(" ".join(_flags()).encode())
    digest.update(_environment().encode())
    return f"tncompile_native_{digest.hexdigest()[:16]}"


def _built(name: str) -> bool:
    """Whether a finished build of ``name`` is in the extension cache."""
    from torch.utils.cpp_extension import _get_build_directory

    return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()


BUILD_NOTICE_SECONDS = 2.0  # loading a finished build takes well under this
STALE_LOCK_SECONDS = 600.0  # a build takes ~40 s on an idle 2-core host: a lock this old was left by a killed build


def clear_stale_lock(name: str, max_age_s: float = STALE_LOCK_SECONDS) -> bool:
    """Remove the build lock of ``name`` when it is older than ``max_age_s``.

    ``torch.utils.cpp_extension`` guards a build with a lock file and waits,
    without limit, while it exists; a build killed mid-way (Ctrl-C twice, a
    CI timeout, OOM) leaves it behind and every later import would hang.
    Returns whether a lock was removed (announced by one line on stderr)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False  # another process may be building right now: wait for it as torch does
    with contextlib.suppress(FileNotFoundError):  # a racing process may have removed it first
        lock.unlink()
    log.warning("tncompile: removed a stale native-build lock left by an interrupted build "
                "(%s, %.0f min old)", lock, age / 60)
    return True


def _build():
    from torch.utils.cpp_extension import load  # imported lazily: it is slow to import

    name = build_name()
    clear_stale_lock(name)
    announced = threading.Event()

    def announce():  # one line, so that a first run does not sit silent for half a minute
        if not announced.is_set():
            announced.set()
            log.warning("tncompile: building the native CPU kernels (once per machine, environment and version; "
                        "about 40 s on an idle 2-core host, longer on a busy one)...")

    if not _built(name):
        announce()
    # a build torch decides on anyway (a changed toolchain, a half-finished build) is announced
    # once loading has taken longer than loading a finished build ever does
    late = threading.Timer(BUILD_NOTICE_SECONDS, announce)
    late.daemon = True
    late.start()
    start = time.perf_counter()
    try:
        load(name=name, sources=_SOURCES, extra_cflags=_flags(),
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    finally:
        late.cancel()
    took = time.perf_counter() - start
    if took > 2.0:
        log.warning("tncompile: compiled the native CPU kernels in %.0f s (cached for later runs)", took)
    return torch.ops.tncompile


def native_ops():
    """``torch.ops.tncompile`` with the native kernels, building them on first
    call; ``None`` where they cannot be built, with ``TNCOMPILE_NATIVE=0``, or
    inside ``native_kernels(False)``."""
    if not _state["enabled"]:
        return None
    if _state["watch"] is not None and _state["tried"] and _state["ops"] is not None:
        return _Watched(_state["ops"], _state["watch"])
    if _state["tried"]:
        return _state["ops"]
    with _lock:
        if not _state["tried"]:
            if os.environ.get("TNCOMPILE_NATIVE", "1") == "0":
                _state["error"] = "disabled by TNCOMPILE_NATIVE=0"
            else:
                try:
                    _state["ops"] = _build()
                except Exception as exc:  # no compiler, no ninja, a failed compile: run eager instead
                    _state["error"] = f"{type(exc).__name__}: {exc}"
                    warnings.warn("tncompile: could not build the native CPU kernels; TT/TTM layers run "
                                  "the eager path (same results, up to ~2-3x slower on CPU). "
                                  f"Reason: {_state['error'][:500]}",
                                  RuntimeWarning, stacklevel=2)
            _state["tried"] = True
    return _state["ops"]


def kernels_for(t: torch.Tensor):
    """The native ops when they apply to ``t`` -- a CPU fp32/fp64 tensor, no
    autocast, not being traced by ``torch.compile`` -- else ``None`` (the
    caller runs its eager path)."""
    if (t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64)
            or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling()):
        return None
    return native_ops()


class _Watched:
    """The native ops, each call reported by name to ``on_call`` first."""

    def __init__(self, ops, on_call):
        self._ops, self._on_call = ops, on_call

    def __getattr__(self, name: str):
        op = getattr(self._ops, name)

        def call(*args, **kwargs):
            self._on_call(f"tncompile::{name}")
            return op(*args, **kwargs)
        return call


@contextlib.contextmanager
def watch(on_call):
    """Inside the block, every native kernel called through :func:`native_ops`
    (or :func:`kernels_for`) first reports its name to ``on_call(name)``: how
    a dry run checks that no CPU kernel runs on the device path. Not
    thread-safe: it flips a process-wide switch."""
    before = _state["watch"]
    _state["watch"] = on_call
    try:
        yield
    finally:
        _state["watch"] = before


@contextlib.contextmanager
def native_kernels(enabled: bool):
    """Use (or not) the native kernels inside the block, e.g. to compare
    against the eager path. Not thread-safe: it flips a process-wide switch."""
    before = _state["enabled"]
    _state["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _state["enabled"] = before


def native_status() -> str:
    """One line: whether the native kernels are in use, and why not."""
    if not _state["tried"]:
        return "native CPU kernels: not loaded yet (built on first use)"
    if _state["ops"] is not None:
        return "native CPU kernels: in use"
    return f"native CPU kernels: not in use ({_state['error']})"
