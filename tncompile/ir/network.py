"""Network-level IR: one layer's tensors and indices as a networkx graph.

Tensors are nodes (attribute ``indices``: their ordered index names; ``kind``:
``"input" | "core" | "gate"``); every shared index is an edge (``key`` = the
index name) between tensors that hold it; the open indices, in order, are the
network's output (``graph.graph["output"]``). A rank gate is a vector on a bond
index, so that bond is a hyper-index shared by two cores and a gate.

The network converts to cotengra's ``(inputs, output, size_dict)`` and to an
einsum equation; :meth:`TensorNetwork.planner_problem` is the form the
contraction planner and executor work on.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import combinations

import networkx as nx
import opt_einsum

from ..formats.indices import BATCH, network_indices, planner_problem
from ..formats.layout import TTLayout, TTMLayout

__all__ = ["TensorNetwork", "BATCH"]


class TensorNetwork:
    """Tensors and indices of one tensorized layer.

    Parameters
    ----------
    graph : networkx.MultiGraph
        Built by :meth:`from_layout`; see the module docstring for its schema.
    sizes : dict
        Size of every index except the batch index ``"b"``.
    layout : TTLayout or TTMLayout, optional
        The layout it was built from.
    """

    def __init__(self, graph: nx.MultiGraph, sizes: dict[str, int], layout: TTLayout | TTMLayout | None = None):
        self.graph = graph
        self.sizes = dict(sizes)
        self.layout = layout

    # ------------------------------------------------------------ building
    @classmethod
    def from_layout(cls, layout: TTLayout | TTMLayout, transpose: bool = False) -> "TensorNetwork":
        """Network of ``y = x @ W.T`` for a TT layout, or ``y = onehot(ids) @ E``
        (``transpose=False``) / ``y = x @ E.T`` (``transpose=True``, a tied
        output head) for a TTM layout. The batch index is ``"b"``."""
        tensors, output, sizes = network_indices(layout, transpose)
        g = nx.MultiGraph(output=output, format=layout.format, transpose=transpose)
        for name, (idx, kind) in tensors.items():
            g.add_node(name, indices=idx, kind=kind)
        holders: dict[str, list[str]] = {}
        for node, data in g.nodes(data=True):
            for ix in data["indices"]:
                holders.setdefault(ix, []).append(node)
        for ix, nodes in holders.items():
            for a, b in combinations(nodes, 2):
                g.add_edge(a, b, key=ix, size=sizes.get(ix))
        return cls(g, sizes, layout)

    @classmethod
    def of(cls, layer) -> "TensorNetwork":
        """The network of a TT / TTM layer (``TTLinear``, ``TTMEmbedding``,
        ``TTMTiedLinear``) at its current ranks."""
        layout = getattr(layer, "layout", None)
        if not isinstance(layout, (TTLayout, TTMLayout)) or layout.ranks is None:
            raise TypeError(f"TensorNetwork.of expects a TT/TTM layer with assigned ranks, got "
                            f"{type(layer).__name__}")
        return cls.from_layout(layout, transpose=bool(getattr(layer, "transposed", False)))

    # ------------------------------------------------------------ views
    @property
    def output(self) -> tuple[str, ...]:
        return self.graph.graph["output"]

    def tensor_names(self, include_gates: bool = True) -> list[str]:
        return [n for n, d in self.graph.nodes(data=True)
                if include_gates or d["kind"] != "gate"]

    def to_cotengra(self, tokens: int, include_gates: bool = True
                    ) -> tuple[list[tuple[str, ...]], tuple[str, ...], dict[str, int]]:
        """``(inputs, output, size_dict)`` as cotengra and opt_einsum take them."""
        names = self.tensor_names(include_gates)
        inputs = [tuple(self.graph.nodes[n]["indices"]) for n in names]
        size_dict = {**self.sizes, BATCH: int(tokens)}
        return inputs, tuple(self.output), size_dict

    def equation(self, include_gates: bool = True) -> str:
        """Einsum equation over the tensors in :meth:`tensor_names` order."""
        inputs, output, _ = self.to_cotengra(1, include_gates)
        return _equation(tuple(inputs), output)

    def planner_problem(self) -> tuple[list[tuple[str, ...]], tuple[str, ...], dict[str, int]]:
        """The network the executor contracts: input + cores (gates folded into
        the cores), size-1 boundary bonds dropped; the batch index is unsized
        (:func:`tncompile.formats.planner_problem`)."""
        if self.layout is None:
            raise ValueError("this TensorNetwork was built without its layout; use TensorNetwork.from_layout")
        return planner_problem(self.layout, self.graph.graph["transpose"])

    def summary(self) -> str:
        parts = []
        for n, d in self.graph.nodes(data=True):
            shape = "x".join(str(self.sizes.get(i, "B")) for i in d["indices"])
            parts.append(f"{n}[{shape}]")
        return " ".join(parts) + f" -> ({','.join(self.output)})"

    def __repr__(self) -> str:
        return f"TensorNetwork({self.graph.graph['format']}: {self.summary()})"


@lru_cache(maxsize=None)
def _equation(inputs: tuple[tuple[str, ...], ...], output: tuple[str, ...]) -> str:
    symbols: dict[str, str] = {}

    def sym(ix: str) -> str:
        if ix not in symbols:
            symbols[ix] = opt_einsum.get_symbol(len(symbols))
        return symbols[ix]

    lhs = ",".join("".join(sym(i) for i in ix) for ix in inputs)
    return f"{lhs}->{''.join(sym(i) for i in output)}"
