"""Declarative rewrite rules over fx graphs: a pattern, a name and a rewrite.

A :class:`Pat` describes one node -- its op, target or module class, its
arguments (themselves patterns, so a pattern is a small tree matched upward
from the node that produces the result), how many users it may have -- and
binds matched nodes by name. A :class:`Rule` pairs a pattern with a rewrite;
:func:`apply_rules` visits the graph in order, applies the first rule that
matches each node and counts matches per rule (the pass history and the dump
show the counts)::

    FUSE = Rule("tt-act-tt", Pat.module(TTLinear, name="second", args=[
        Pat(ACTIVATION, name="act", one_user=True, args=[
            Pat.module(TTLinear, name="first", one_user=True, args=[Pat.any("x")])])]),
        rewrite=fuse)

A rewrite receives a :class:`Match` (the bindings, the graph module) and
builds the replacement with ordinary fx calls, usually through
:meth:`Match.replace_root`, which re-routes the root's users and erases the
matched nodes nothing else reads.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from torch import fx, nn

from ...runtime.layers.module_kinds import runs_as

__all__ = ["Pat", "Rule", "Match", "apply_rules"]


@dataclass
class Pat:
    """A pattern on one fx node.

    Parameters
    ----------
    op : str or None
        The node's ``op`` (``"call_function"``, ``"call_module"``,
        ``"call_method"``, ...); ``None`` matches any node.
    targets : collection, optional
        Functions (``call_function``) or method names (``call_method``) the
        node may call.
    module_type : type, optional
        ``call_module`` only: the module must be this class, running its own
        forward (:func:`~tncompile.runtime.layers.module_kinds.runs_as`).
    args : list, optional
        Patterns for the leading positional arguments, in order: a
        :class:`Pat` (the argument must be a node it matches) or a plain
        value (compared with ``==``).
    nargs : int, optional
        Exact number of positional arguments.
    kwargs : collection of str, optional
        Keyword names the node may carry (others make it fail to match).
    name : str, optional
        Bind the matched node under this name.
    one_user : bool
        The node must have exactly one user (it is consumed by the match).
    where : callable, optional
        ``where(node, graph_module) -> bool``, any further condition.
    """

    op: str | None = None
    targets: Any = None
    module_type: type | None = None
    args: Sequence[Any] | None = None
    nargs: int | None = None
    kwargs: Iterable[str] | None = None
    name: str | None = None
    one_user: bool = False
    where: Callable[[fx.Node, fx.GraphModule], bool] | None = None

    @classmethod
    def any(cls, name: str | None = None) -> "Pat":
        """Any node (bound under ``name``)."""
        return cls(name=name)

    @classmethod
    def call(cls, targets, **kw) -> "Pat":
        """A ``call_function`` node calling one of ``targets``."""
        return cls("call_function", targets=frozenset(_as_set(targets)), **kw)

    @classmethod
    def method(cls, names, **kw) -> "Pat":
        """A ``call_method`` node calling one of the method ``names``."""
        return cls("call_method", targets=frozenset(_as_set(names)), **kw)

    @classmethod
    def module(cls, module: type, **kw) -> "Pat":
        """A ``call_module`` node whose module is a ``module`` running its own forward."""
        return cls("call_module", module_type=module, **kw)

    def match(self, node: Any, gm: fx.GraphModule, bound: dict[str, fx.Node] | None = None
              ) -> dict[str, fx.Node] | None:
        """The bindings if ``node`` matches, else ``None``."""
        bound = {} if bound is None else bound
        if not isinstance(node, fx.Node):
            return None
        if self.op is not None and node.op != self.op:
            return None
        if self.targets is not None and node.target not in self.targets:
            return None
        if self.module_type is not None:
            if node.op != "call_module" or not runs_as(gm.get_submodule(node.target), self.module_type):
                return None
        if self.nargs is not None and len(node.args) != self.nargs:
            return None
        if self.kwargs is not None and not set(node.kwargs) <= set(self.kwargs):
            return None
        if self.one_user and len(node.users) != 1:
            return None
        if self.where is not None and not self.where(node, gm):
            return None
        if self.args is not None:
            if len(node.args) < len(self.args):
                return None
            for want, got in zip(self.args, node.args):
                if isinstance(want, Pat):
                    if want.match(got, gm, bound) is None:
                        return None
                elif want != got:
                    return None
        if self.name is not None:
            if self.name in bound and bound[self.name] is not node:
                return None
            bound[self.name] = node
        return bound


def _as_set(x) -> set:
    return set(x) if isinstance(x, (set, frozenset, list, tuple)) else {x}


@dataclass
class Match:
    """One match of a rule: the root node, the bound nodes and the module."""

    gm: fx.GraphModule
    root: fx.Node
    nodes: dict[str, fx.Node] = field(default_factory=dict)

    def __getitem__(self, name: str) -> fx.Node:
        return self.nodes[name]

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def module(self, name: str) -> nn.Module:
        """The module a bound ``call_module`` node calls."""
        return self.gm.get_submodule(self.nodes[name].target)

    def replace_root(self, build: Callable[[fx.Graph], fx.Node]) -> fx.Node:
        """Insert ``build(graph)`` before the root, give it the root's meta and
        users, and erase every matched node that nothing else reads."""
        with self.graph.inserting_before(self.root):
            new = build(self.graph)
        new.meta = {**self.root.meta, **new.meta}
        self.root.replace_all_uses_with(new)
        self.erase_unused()
        return new

    def erase_unused(self) -> None:
        """Erase the root and bound nodes left without users (latest first)."""
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        dead = {self.root, *self.nodes.values()}
        for n in sorted((n for n in dead if n in order), key=order.__getitem__, reverse=True):
            if not n.users and n.op not in ("placeholder", "output"):
                self.graph.erase_node(n)


@dataclass(frozen=True)
class Rule:
    """``pattern`` rewritten by ``rewrite(match)``, counted under ``name``."""

    name: str
    pattern: Pat
    rewrite: Callable[[Match], Any]


def apply_rules(gm: fx.GraphModule, rules: Sequence[Rule], counts: Counter | None = None) -> Counter:
    """Visit every node in order and apply the first rule whose pattern matches it.

    Nodes a rewrite erased are skipped; nodes it inserts are not revisited.
    Returns (and adds to ``counts``) the matches per rule name, every rule
    listed, with 0 for those that never matched.
    """
    counts = counts if counts is not None else Counter()
    for rule in rules:
        counts[rule.name] += 0
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or getattr(node, "_erased", False):
            continue
        for rule in rules:
            bound = rule.pattern.match(node, gm)
            if bound is not None:
                rule.rewrite(Match(gm, node, bound))
                counts[rule.name] += 1
                break
    return counts
