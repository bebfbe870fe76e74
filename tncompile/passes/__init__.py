"""Passes over a :class:`~tncompile.ir.Program` and the default pipeline."""
from .base import FunctionPass, Pass, Pipeline, get_pass, register_pass, registered_passes
from .tensorize import Tensorize
from .assign_ranks import AssignRanks
from .decompose import Decompose
from .plan_contractions import PlanContractions
from .fuse_feed_forward import FuseFeedForward
from .lower_dropout import LowerDropout

__all__ = ["Pass", "FunctionPass", "Pipeline", "register_pass", "get_pass", "registered_passes",
           "default_pipeline", "Tensorize", "AssignRanks", "Decompose", "PlanContractions",
           "FuseFeedForward", "LowerDropout"]


def default_pipeline() -> Pipeline:
    """``tensorize -> assign_ranks -> decompose -> plan_contractions ->
    fuse_feed_forward -> lower_dropout``, a fresh, editable copy."""
    return Pipeline(["tensorize", "assign_ranks", "decompose", "plan_contractions", "fuse_feed_forward",
                     "lower_dropout"])
