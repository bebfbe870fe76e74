"""Pass infrastructure: ``Pass``, the registry and ``Pipeline`` (:mod:`.base`), rewrite rules
(:mod:`.rules`) and rule passes (:mod:`.rule_pass`), PEFT-style module selection
(:mod:`.selection`), and ``PendingLayer`` (:mod:`.pending`)."""
from .base import FunctionPass, Pass, Pipeline, get_pass, register_pass, registered_passes
from .pending import PendingLayer
from .rule_pass import RulePass, require_canonical
from .rules import Match, Pat, Rule, apply_rules

__all__ = ["Pass", "FunctionPass", "Pipeline", "register_pass", "get_pass", "registered_passes", "PendingLayer", "RulePass",
           "require_canonical", "Match", "Pat", "Rule", "apply_rules"]
