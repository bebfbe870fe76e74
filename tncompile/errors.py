"""Exceptions raised by tncompile."""
from __future__ import annotations

__all__ = ["TNCompileError", "TraceError", "PassError", "ModelFileError", "ModelMismatchError", "SlowerThanDenseWarning"]


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


class SlowerThanDenseWarning(UserWarning):
    """``compile`` estimates the compressed layers' training step slower than their dense
    layers' on the model's device, with ``prefer="speed"``: ``target_ratio`` needs layers
    whose fixed per-kernel cost outweighs their saved multiply-adds (small layers, small
    batches, GPUs). The message gives the ratio with the slower layers kept dense.
    Silence it with ``warnings.filterwarnings("ignore", category=SlowerThanDenseWarning)``."""
