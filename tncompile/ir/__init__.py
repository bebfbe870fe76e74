"""The two levels of IR: :class:`Program` (graph) and :class:`TensorNetwork` (layer)."""
from .network import ContractionCost, TensorNetwork
from .program import InputSpec, PassRecord, Program

__all__ = ["Program", "InputSpec", "PassRecord", "TensorNetwork", "ContractionCost"]
