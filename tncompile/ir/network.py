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

from ..formats.layout import TTLayout, TTMLayout

__all__ = ["TensorNetwork", "BATCH"]

BATCH = "b"


class TensorNetwork:
    """Tensors and indices of one tensorized layer.

    Parameters
    ----------
    graph : networkx.MultiGraph
        Built by :meth:`from_layout`; see the module docstring for its schema.
    sizes : dict
        Size of every index except the batch index ``"b"``.
    """

    def __init__(self, graph: nx.MultiGraph, sizes: dict[str, int]):
        self.graph = graph
        self.sizes = dict(sizes)

    # ------------------------------------------------------------ building
    @classmethod
    def from_layout(cls, layout: TTLayout | TTMLayout, transpose: bool = False) -> "TensorNetwork":
        """Network of ``y = x @ W.T`` for a TT layout, or ``y = onehot(ids) @ E``
        (``transpose=False``) / ``y = x @ E.T`` (``transpose=True``, a tied
        output head) for a TTM layout. The batch index is ``"b"``."""
        ranks = layout.full_ranks
        tensors: dict[str, tuple[tuple[str, ...], str]] = {}
        sizes: dict[str, int] = {}
        bonds = [f"r{k}" for k in range(len(ranks))]
        for name, r in zip(bonds, ranks):
            sizes[name] = r
        if isinstance(layout, TTLayout):
            d_in = len(layout.in_modes)
            mode_names = [f"i{k}" for k in range(d_in)] + [f"j{k}" for k in range(len(layout.out_modes))]
            for name, n in zip(mode_names, layout.site_sizes):
                sizes[name] = n
            for k, m in enumerate(mode_names):
                tensors[f"G{k}"] = ((bonds[k], m, bonds[k + 1]), "core")
            in_idx, out_idx = mode_names[:d_in], mode_names[d_in:]
        else:
            rows = [f"m{k}" for k in range(len(layout.row_modes))]
            cols = [f"n{k}" for k in range(len(layout.col_modes))]
            sizes.update(zip(rows, layout.row_modes))
            sizes.update(zip(cols, layout.col_modes))
            for k in range(len(rows)):
                tensors[f"G{k}"] = ((bonds[k], rows[k], cols[k], bonds[k + 1]), "core")
            in_idx, out_idx = (cols, rows) if transpose else (rows, cols)
        for k in range(1, len(ranks) - 1):
            tensors[f"g{k}"] = ((bonds[k],), "gate")
        g = nx.MultiGraph(output=(BATCH, *out_idx), format=layout.format, transpose=transpose)
        g.add_node("x", indices=(BATCH, *in_idx), kind="input")
        for name, (idx, kind) in tensors.items():
            g.add_node(name, indices=idx, kind=kind)
        holders: dict[str, list[str]] = {}
        for node, data in g.nodes(data=True):
            for ix in data["indices"]:
                holders.setdefault(ix, []).append(node)
        for ix, nodes in holders.items():
            for a, b in combinations(nodes, 2):
                g.add_edge(a, b, key=ix, size=sizes.get(ix))
        return cls(g, sizes)

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
        the cores), size-1 boundary bonds dropped; the batch index is unsized."""
        inputs, output, sizes = self.to_cotengra(1, include_gates=False)
        boundary = {k for k, v in sizes.items() if v == 1 and k != BATCH
                    and sum(k in ix for ix in inputs) == 1 and k not in output}
        inputs = [tuple(i for i in ix if i not in boundary) for ix in inputs]
        sizes = {k: v for k, v in sizes.items() if k not in boundary and k != BATCH}
        return inputs, output, sizes

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
