"""Long compile work shows itself: one progress bar per stage, named, after a couple of seconds.

Calibration, sensitivity, decomposition and planning run over layers or batches; on a
large model each can take minutes. :func:`progress` wraps such a loop in a tqdm bar named
``tncompile <stage>`` that appears only once the stage has run ``tuning.PROGRESS_DELAY``
seconds (short compiles print nothing), on terminals and in logs alike.
``TNCOMPILE_PROGRESS=0`` in the environment turns every bar off.
"""
from __future__ import annotations

import os
from typing import Iterable, TypeVar

from tqdm.auto import tqdm

from ... import tuning

__all__ = ["progress"]

T = TypeVar("T")


def progress(items: Iterable[T], stage: str, *, total: int | None = None, enabled: bool = True) -> Iterable[T]:
    """``items``, with a bar named ``tncompile <stage>`` once the loop has run a couple of seconds."""
    off = not enabled or os.environ.get("TNCOMPILE_PROGRESS", "1").strip() in ("0", "false", "no", "off")
    return tqdm(items, desc=f"tncompile {stage}", total=total, delay=tuning.PROGRESS_DELAY, disable=off,
                leave=False, dynamic_ncols=True)
