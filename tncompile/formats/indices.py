"""The index structure of a layout's tensor network.

Which tensors a TT / TTM layer's network has (input, cores, rank gates), which
named indices each carries, and their sizes. :class:`tncompile.ir.TensorNetwork`
builds its networkx graph from this; the runtime and the contraction planner
derive the problem they contract from it (:func:`planner_problem`).
"""
from __future__ import annotations

from .layout import TTLayout, TTMLayout

__all__ = ["BATCH", "network_indices", "planner_problem"]

BATCH = "b"  # the index of the rows (tokens, or ids of a lookup)

Indices = tuple[str, ...]


def network_indices(layout: TTLayout | TTMLayout, transpose: bool = False
                    ) -> tuple[dict[str, tuple[Indices, str]], Indices, dict[str, int]]:
    """``(tensors, output, sizes)`` of the network of ``y = x @ W.T`` for a TT
    layout, or ``y = onehot(ids) @ E`` (``transpose=False``) / ``y = x @ E.T``
    (``transpose=True``, a tied output head) for a TTM layout.

    Returns
    -------
    tensors : dict
        ``name -> (indices, kind)`` in order: ``"x"`` (kind ``"input"``), the
        cores ``G0..`` (``"core"``) and the gates ``g1..`` (``"gate"``, one per
        internal bond).
    output : tuple of str
        The open indices, batch first.
    sizes : dict
        Size of every index except the batch index :data:`BATCH`.
    """
    ranks = layout.full_ranks
    sizes: dict[str, int] = {}
    bonds = [f"r{k}" for k in range(len(ranks))]
    sizes.update(zip(bonds, ranks))
    cores: dict[str, tuple[Indices, str]] = {}
    if isinstance(layout, TTLayout):
        d_in = len(layout.in_modes)
        modes = [f"i{k}" for k in range(d_in)] + [f"j{k}" for k in range(len(layout.out_modes))]
        sizes.update(zip(modes, layout.site_sizes))
        for k, m in enumerate(modes):
            cores[f"G{k}"] = ((bonds[k], m, bonds[k + 1]), "core")
        in_idx, out_idx = modes[:d_in], modes[d_in:]
    else:
        rows = [f"m{k}" for k in range(len(layout.row_modes))]
        cols = [f"n{k}" for k in range(len(layout.col_modes))]
        sizes.update(zip(rows, layout.row_modes))
        sizes.update(zip(cols, layout.col_modes))
        for k in range(len(rows)):
            cores[f"G{k}"] = ((bonds[k], rows[k], cols[k], bonds[k + 1]), "core")
        in_idx, out_idx = (cols, rows) if transpose else (rows, cols)
    tensors: dict[str, tuple[Indices, str]] = {"x": ((BATCH, *in_idx), "input"), **cores}
    for k in range(1, len(ranks) - 1):
        tensors[f"g{k}"] = ((bonds[k],), "gate")
    return tensors, (BATCH, *out_idx), sizes


def planner_problem(layout: TTLayout | TTMLayout, transpose: bool = False
                    ) -> tuple[list[Indices], Indices, dict[str, int]]:
    """The network the executor contracts: input + cores (gates folded into
    the cores), size-1 boundary bonds dropped; the batch index is unsized.

    Returns ``(inputs, output, sizes)`` as cotengra and opt_einsum take them.
    """
    tensors, output, sizes = network_indices(layout, transpose)
    inputs = [idx for idx, kind in tensors.values() if kind != "gate"]
    boundary = {k for k, v in sizes.items() if v == 1 and sum(k in ix for ix in inputs) == 1
                and k not in output}
    inputs = [tuple(i for i in ix if i not in boundary) for ix in inputs]
    return inputs, output, {k: v for k, v in sizes.items() if k not in boundary}
