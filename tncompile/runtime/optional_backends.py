"""The optional backends, each imported the first time a call could use it.

Triton (:mod:`.triton`) is not imported with the runtime: its import alone costs about
half a second, and its kernels lost to the default ways on every GPU measured so far
(``../shared/gpu-runs/``). Its loader, registered here with the ways' backend registry
(:func:`.ways.backends.register_loader`), imports it the first time
``tuning.TRITON_KERNELS`` is on or a call runs on a device where it is a measured
candidate (a GPU); a user's ``import tncompile.runtime.triton`` registers it at once.
"""
from __future__ import annotations

from .ways import backends

__all__: list[str] = []


def _load_triton() -> None:
    from .triton import backend  # noqa: F401, PLC0415 - it registers itself when imported


backends.register_loader("triton", _load_triton, measured_on=("cuda",))
