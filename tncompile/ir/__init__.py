"""The two levels of IR: :class:`Program` (graph) and :class:`TensorNetwork` (layer),
plus the per-bucket plans: :class:`ContractionPlan` (TT contractions) and
:class:`LookupPlan` (TTM lookups)."""
from .lookup_plan import LookupPlan
from .network import TensorNetwork
from .plan import ContractionPlan
from .program import InputSpec, PassRecord, Program

__all__ = ["Program", "InputSpec", "PassRecord", "TensorNetwork",
           "ContractionPlan", "LookupPlan"]
