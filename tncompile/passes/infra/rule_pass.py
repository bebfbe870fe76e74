"""``RulePass``: a pass that is a list of rewrite rules over canonical forms.

Most of tncompile's rewrites are rules (:mod:`.rules`) applied to a graph ``canonicalize``
has already put into one spelling per op. A subclass names itself and its ``rules``; this
base requires the canonical forms and applies the rules, counting matches per rule.
"""
from __future__ import annotations

from typing import Sequence

from ...ir.program import Program
from .base import Pass
from .rules import Rule, apply_rules

__all__ = ["RulePass", "require_canonical", "CANONICALIZE"]

#: the pass whose forms rule passes match (``passes/canonicalize.py``'s name)
CANONICALIZE = "canonicalize"


def require_canonical(program: Program, name: str) -> None:
    """For a pass's ``requires``: raise unless ``canonicalize`` has run on ``program``."""
    if not any(r.name == CANONICALIZE for r in program.history):
        raise ValueError(f"{name} matches canonical ops only: run the canonicalize pass before it "
                         f"(default_pipeline() does; in a list of passes put 'canonicalize' first)")


class RulePass(Pass):
    """A pass made of ``rules`` over canonical forms (see the module doc)."""

    rules: Sequence[Rule] = ()

    def requires(self, program: Program) -> None:
        require_canonical(program, self.name)

    def run(self, program: Program) -> Program:
        apply_rules(program.graph_module, self.rules, self.matches)
        return program
