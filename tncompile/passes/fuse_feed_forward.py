"""``fuse_feed_forward``: ``second(act(first(x)))`` over two TT linears becomes one fused call.

The rewrite (one small rule, applied wherever it matches)::

    %h = call_module[first](%x)                     %first  = get_attr[first]
    %a = gelu(%h)                          ==>      %second = get_attr[second]
    %y = call_module[second](%a)                    %y = tt_feed_forward(%x, %first, %second, "gelu")

when ``first`` and ``second`` are :class:`~tncompile.runtime.TTLinear`, the
activation is GELU (exact or tanh) or ReLU in its canonical form (the
``canonicalize`` pass maps every spelling to it), and neither ``%h`` nor
``%a`` has another user. The layers stay where they were in the module tree (same
parameter names, state dict, rank control); the graph now passes them to
:func:`~tncompile.runtime.fused.feed_forward.tt_feed_forward`, which decides per
call whether the fused kernel applies and otherwise runs the three steps as
before.
"""
from __future__ import annotations

from ..runtime.fused.feed_forward import tt_feed_forward
from ..runtime.layers import TTLinear
from .canonicalize import activation_of
from .infra.base import register_pass
from .infra.rule_pass import RulePass
from .infra.rules import Match, Pat, Rule

__all__ = ["FuseFeedForward"]


def _fuse(m: Match) -> None:
    first, second = m["first"], m["second"]
    activation = activation_of(m["act"])

    def build(graph):
        first_ref = graph.get_attr(first.target)
        second_ref = graph.get_attr(second.target)
        return graph.call_function(tt_feed_forward, (first.args[0], first_ref, second_ref, activation))
    m.replace_root(build)


RULES = [Rule("tt-act-tt", Pat.module(TTLinear, name="second", nargs=1, kwargs=(), args=[
    Pat(name="act", one_user=True, where=lambda n, gm: activation_of(n) is not None, args=[
        Pat.module(TTLinear, name="first", one_user=True, nargs=1, kwargs=())])]), _fuse)]


@register_pass
class FuseFeedForward(RulePass):
    """Fuse ``TTLinear -> GELU/ReLU -> TTLinear`` chains (see the module doc).

    Matches the canonical activations, so it needs ``canonicalize`` before it;
    in a chain of three such layers the first pair fuses.
    """

    name = "fuse_feed_forward"

    rules = RULES
