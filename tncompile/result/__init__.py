"""What ``compile`` returns: the graph-mode :class:`CompiledModel` and the :class:`Report`
both modes give (swap mode's result API is :mod:`tncompile.swap`)."""
from .compiled import CompiledModel
from .report import Report

__all__ = ["CompiledModel", "Report"]
