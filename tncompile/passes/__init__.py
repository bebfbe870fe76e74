"""Passes over a :class:`~tncompile.ir.Program` and the default pipeline.

Every edit of a program -- at compile time and during training
(``truncate_ranks``, ``collapse_layers``, ``replan``, run by the rank
controller) -- is a pass run through a :class:`Pipeline`, so it is checked,
linted, recorded and dumped.
"""
from .infra.base import FunctionPass, Pass, Pipeline, get_pass, register_pass, registered_passes
from .canonicalize import Canonicalize
from .follow_device import FollowDevice
from .infra.pending import PendingLayer
from .tensorize import Tensorize
from .assign_ranks import AssignRanks
from .decompose import Decompose
from .plan_contractions import PlanContractions
from .fuse_feed_forward import FuseFeedForward
from .lower_dropout import LowerDropout
from .fuse_attention import FuseAttention
from .fuse_siblings import FuseSiblings
from .measure_ways import MeasureWays
from .replan import Replan, replan_module
from .truncate_ranks import Cut, TruncateRanks, cut_ranks
from .collapse_layers import CollapseLayers
from .infra.rule_pass import RulePass
from .infra.rules import Match, Pat, Rule, apply_rules
from .default import BUILTIN_PASSES, default_pipeline

__all__ = ["Pass", "FunctionPass", "Pipeline", "register_pass", "get_pass", "registered_passes", "BUILTIN_PASSES",
           "default_pipeline", "Canonicalize", "FollowDevice", "Tensorize", "AssignRanks", "Decompose", "PlanContractions",
           "FuseFeedForward", "LowerDropout", "FuseAttention", "FuseSiblings", "MeasureWays", "Replan", "TruncateRanks", "CollapseLayers", "PendingLayer",
           "replan_module", "Cut", "cut_ranks",
           "Pat", "Rule", "Match", "apply_rules", "RulePass"]
