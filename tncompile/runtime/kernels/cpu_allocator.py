"""Keep freed CPU memory for reuse, like CUDA's caching allocator does on GPU.

glibc serves allocations above ~32 MB with fresh ``mmap`` pages and returns
them on free, so every training step page-faults its big activations back in.
For a TT layer, whose arithmetic is small, those faults cost as much as the
contraction itself (measured: 768->3072 over 4096 tokens, fwd+bwd, 2 cores:
~105 ms with faults, ~50 ms without). :func:`retain_freed_memory` tells glibc
to serve every block from its heap and keep what is freed.

The runtime turns this on by itself the first time a TT/TTM layer runs on CPU
outside a trace (:func:`ensure_retained`), once per process. The price is that the
process -- a server or a notebook alike -- keeps its peak heap for the rest of its
life. ``tuning.RETAIN_FREED_MEMORY = False`` or ``TNCOMPILE_RETAIN_FREED_MEMORY=0``
before that first call opts out; calling :func:`retain_freed_memory` yourself still
works either way; ``compiled.report(inputs)`` says which applies (:func:`describe`).
The C library is opened by its soname (``libc.so.6``): no ``ldconfig`` is run.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

from ... import tuning

__all__ = ["retain_freed_memory", "release_freed_memory", "ensure_retained", "retained", "describe"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
OPT_OUT_VARIABLE = "TNCOMPILE_RETAIN_FREED_MEMORY"

_state = {"checked": False, "retained": False}
_log = logging.getLogger(__name__)


def retain_freed_memory() -> bool:
    """Make glibc ``malloc`` reuse freed memory instead of returning it.

    Process-wide and irreversible for the process; the price is that the
    process keeps its peak heap. Returns ``False`` (and changes nothing) where
    the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))
    _state["retained"] = _state["retained"] or done
    return done


def release_freed_memory() -> bool:
    """Give the memory glibc keeps free back to the operating system (``malloc_trim(0)``),
    e.g. what building and compiling a model freed, before measuring what a training step
    adds to the resident size. Retention stays on. Returns ``False`` where the C library
    is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def _libc() -> ctypes.CDLL:
    """glibc by its soname (``find_library`` would run ``ldconfig -p`` in a subprocess)."""
    return ctypes.CDLL("libc.so.6")


def ensure_retained() -> None:
    """:func:`retain_freed_memory`, the first time it is asked for in this
    process, unless ``TNCOMPILE_RETAIN_FREED_MEMORY=0`` (read then). Cheap
    after the first call: the runtime calls it on every CPU forward."""
    if _state["checked"]:
        return
    _state["checked"] = True
    if not tuning.RETAIN_FREED_MEMORY or \
            os.environ.get(OPT_OUT_VARIABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    if retain_freed_memory():
        _log.info("tncompile: glibc now keeps freed memory for reuse (%s=0 to opt out)", OPT_OUT_VARIABLE)


def retained() -> bool:
    """Whether this process's allocator keeps freed memory (set by tncompile)."""
    return _state["retained"]


def describe() -> str:
    """One line for a report: whether tncompile changed this process's CPU allocator."""
    if _state["retained"]:
        return ("CPU allocator: glibc keeps freed memory for reuse for the rest of this process (set by tncompile "
                "at its first CPU forward: faster steps, the peak heap kept); tuning.RETAIN_FREED_MEMORY = False "
                f"or {OPT_OUT_VARIABLE}=0 before that forward leaves glibc as it is")
    why = "opted out" if _state["checked"] else "no CPU forward yet"
    return f"CPU allocator: glibc's own, untouched by tncompile ({why})"
