"""Exceptions raised by tncompile."""
from __future__ import annotations

__all__ = ["TNCompileError", "TraceError", "PassError"]


class TNCompileError(RuntimeError):
    """Base class of tncompile's own errors."""


class TraceError(TNCompileError):
    """Neither torch.fx nor torch.export could capture the model."""


class PassError(TNCompileError):
    """A pass raised; the message names the pass."""

    def __init__(self, pass_name: str, cause: BaseException):
        self.pass_name = pass_name
        super().__init__(f"pass {pass_name!r} failed: {type(cause).__name__}: {cause}")
