"""Exceptions raised by tncompile, and the argument checks that raise them."""
from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["TNCompileError", "TraceError", "PassError", "ModelFileError", "ModelMismatchError", "SlowerThanDenseWarning", "BelowTargetWarning", "CalibrationWarning",
           "is_int", "is_real", "check_int", "check_float", "check_materialized"]


def is_int(value: Any) -> bool:
    """An integer and not a bool (``True`` is an ``int`` to Python, never a count here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A real number (int or float, NumPy's too) and not a bool; NaN and infinities included."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _shown(value: Any, right_type: bool) -> str:
    """``value`` as an error shows it: with its type when the type is what is wrong."""
    return repr(value) if right_type else f"{type(value).__name__} {value!r:.80}"


def _bounds(low, high, low_open: bool, high_open: bool) -> str:
    low, high = (None if x is None else f"{x:g}" for x in (low, high))  # 0.0 reads as 0
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"{'<' if high_open else '<='} {high}" if high is not None else ""


def check_int(value: Any, name: str, low: int | None = None, high: int | None = None, *, none_ok: bool = False,
              error: type[Exception] = ValueError) -> int | None:
    """``value`` as an int within ``[low, high]`` (either may be open-ended), or ``None`` when
    ``none_ok``; else ``error("<name> must be an int >= 1, got 0")``."""
    if value is None and none_ok:
        return None
    if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        bounds = _bounds(low, high, False, False)
        raise error(f"{name} must be an int{' ' + bounds if bounds else ''}{' or None' if none_ok else ''}, "
                    f"got {_shown(value, is_int(value))}")
    return int(value)


def check_float(value: Any, name: str, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, none_ok: bool = False,
                error: type[Exception] = ValueError) -> float | None:
    """``value`` as a finite float within its bounds (open or closed), or ``None`` when
    ``none_ok``; else ``error("<name> must be a finite number > 0, got -1")``."""
    if value is None and none_ok:
        return None
    ok = is_real(value) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        bounds = _bounds(low, high, low_open, high_open)
        what = bounds if bounds.startswith("in ") else f"a finite number{' ' + bounds if bounds else ''}"
        raise error(f"{name} must be {what}{' or None' if none_ok else ''}, got {_shown(value, is_real(value))}")
    return float(value)


class TNCompileError(RuntimeError):
    """Base class of tncompile's own errors."""


class TraceError(TNCompileError):
    """Neither torch.fx nor torch.export could capture the model."""


class PassError(TNCompileError):
    """A pass raised; the message names the pass."""

    def __init__(self, pass_name: str, cause: BaseException):
        self.pass_name = pass_name
        super().__init__(f"pass {pass_name!r} failed: {type(cause).__name__}: {cause}")


class ModelFileError(ValueError):
    """A model file that tncompile does not load: not a tncompile file, another format
    version, damaged, truncated, a manifest field out of type, set or bounds, tensors
    that disagree with its layer table, or (:class:`ModelMismatchError`) a file that does
    not fit the model given. The message names the file and the part of it that is wrong.
    The only error ``tncompile.load`` raises for anything about the file."""


class ModelMismatchError(ModelFileError):
    """The dense model given to ``tncompile.load`` is not the one the file was saved from:
    another class or configuration, a layer missing or of another kind or shape where the
    file's layer table has a compressed one, or state the file does not hold. The message
    names the first difference."""


class CalibrationWarning(UserWarning):
    """``compile(calibration=...)`` fit networks to too little data: a layer saw fewer rows
    than ``tuning.CALIBRATION_ROWS_PER_FEATURE`` times its input features, or the fit's
    error on held-out calibration rows is over twice its error on the rows it was fit to.
    The fit then matches the calibration inputs, not new ones; the message says how many
    rows to give."""


class BelowTargetWarning(UserWarning):
    """``compile`` returned a model clearly smaller than ``target_ratio`` asked for (below
    its band, ``target_ratio * (1 - tuning.UNIFORM_RANK_SLACK)``): ``prefer="speed"``
    capped ranks where larger networks are estimated slower, or the layouts' rank bounds
    stop the networks short. The message names why and how to get the target."""


class SlowerThanDenseWarning(UserWarning):
    """``compile`` estimates the compressed layers' training step slower than their dense
    layers' on the model's device, with ``prefer="speed"``: ``target_ratio`` needs layers
    whose fixed per-kernel cost outweighs their saved multiply-adds (small layers, small
    batches, GPUs). The message gives the ratio with the slower layers kept dense.
    Silence it with ``warnings.filterwarnings("ignore", category=SlowerThanDenseWarning)``."""


def check_materialized(model: Any, where: str) -> None:
    """Raise where ``model`` still has parameters or buffers on the meta device (compiled
    on meta and never given memory): ``<where>: the model is still on the meta device
    ('<name>' and N more); call tncompile.materialize(model, device=...) first``."""
    from torch import nn   # errors.py is imported before torch elsewhere needs it

    if not isinstance(model, nn.Module):
        return
    meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        more = f" and {len(meta) - 1} more" if len(meta) > 1 else ""
        raise ValueError(f"{where}: the model is still on the meta device ({meta[0]!r}{more} hold no memory); "
                         "call tncompile.materialize(model, device='cpu' or 'cuda') first -- it gives every "
                         "parameter memory and a sound initialization")
