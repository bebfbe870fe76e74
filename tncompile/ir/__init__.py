"""The two levels of IR: :class:`Program` (graph) and :class:`TensorNetwork` (layer),
plus the per-bucket plans: :class:`ContractionPlan` (TT contractions) and
:class:`LookupPlan` (TTM lookups). The plans are the runtime's data format
(:mod:`tncompile.runtime.kernels.plans`), re-exported here. Data only: the searches that
produce plans are in :mod:`tncompile.planning`, the rewrites in :mod:`tncompile.passes`."""
from ..runtime.kernels.plans import ContractionPlan, LookupPlan, Step
from .network import TensorNetwork
from .program import CompileContext, InputSpec, PassRecord, Program

__all__ = ["Program", "CompileContext", "InputSpec", "PassRecord", "TensorNetwork",
           "ContractionPlan", "LookupPlan", "Step"]
