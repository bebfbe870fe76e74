"""What ``compile`` returns: the graph-mode :class:`CompiledModel` and the :class:`Report`
both modes give (swap mode's result API is :mod:`tncompile.swap`)."""
from .compiled import CompiledModel
from .materialize import materialize
from .model_api import CompressedModelAPI, is_compressed
from .report import Report

__all__ = ["CompiledModel", "CompressedModelAPI", "is_compressed", "Report", "materialize"]
