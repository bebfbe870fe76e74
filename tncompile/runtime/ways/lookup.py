"""How a TTM embedding looks up a call's ids: its ways, as data, the one function that
chooses, and the runners.

A :class:`~tncompile.runtime.TTMEmbedding` returns the rows of its table one of
:class:`LookupWay`'s ways, all equal in value. :func:`choose` is the decision for ids in
the current context; :func:`run` is the layer's forward: it runs what the decision says
and records it (``layer.ran_as``, the last eager call's way), which the report prints
beside the TT linears' ways (:mod:`.linear`).

In a differentiable eager call the ways that all apply -- the gathered product, the half
rows (on the CPU, while the ids need fewer half-table rows than the two half tables hold), the whole
merged table (while it holds at most ``tuning.WHOLE_TABLE_SLACK`` times the rows looked
up) and, on a GPU, the Triton lookup -- are timed once per shape and bucket of distinct
ids, and the fastest is kept (:mod:`.measured`); elsewhere the prior decides: the
gathered product (Triton's where switched on).
"""
from __future__ import annotations

import enum
import math

import torch

from ..kernels.executor import autocast_state, same_autocast
from ..kernels.tracing import exporting
from ..kernels.traced_lookup import (check_ids, distinct_ids, gathered_product, gathered_product_backward, half_tables,
                                     split_ids, ttm_lookup)
from . import backends
from ... import tuning
from . import measured
from .linear import record
from .network import keeps_merged_forms
from .rows import first_cpu_use

__all__ = ["LookupWay", "choose", "choose_split", "choose_split_at", "decide", "run", "run_lookup", "whole_table", "merged_table",
           "check_layer_ids", "GatheredProduct", "require_int_ids", "half_table_rows", "row_digits"]


class LookupWay(str, enum.Enum):
    """One way a TTM embedding looks up ids (its ``value`` is what the report prints)."""

    EXPORTED = "exported"                  # torch.export / ONNX: half tables merged in the graph, gathers + bmm
    TRACED = "traced lookup"               # under torch.compile: the lookup as one opaque op each way
    TRITON_LOOKUP = "triton lookup"        # tncompile's Triton gather from the two half tables
    ONE_TABLE = "one table"                # a single core: the table itself, indexed
    GATHERED_PRODUCT = "gathered product"  # the two half tables, rows gathered and multiplied per id
    HALF_ROWS = "half rows"                # only the half-table rows the ids need, each from its cores' slices
    WHOLE_TABLE = "whole table"            # the table merged whole (one product, merged_table), then indexed


#: the ways timed against each other in a differentiable eager call, where they apply
MEASURED = (LookupWay.GATHERED_PRODUCT, LookupWay.HALF_ROWS, LookupWay.WHOLE_TABLE, LookupWay.TRITON_LOOKUP)
measured.register_ways(w.value for w in MEASURED)


def choose(layer, ids: torch.Tensor) -> LookupWay:
    """The way ``layer`` looks up ``ids`` in the current context (reads the distinct ids:
    a host sync, as the lookup itself)."""
    if exporting():
        return LookupWay.EXPORTED
    if torch.compiler.is_compiling() and len(layer.layout.row_modes) > 1:
        return LookupWay.TRACED
    lookup = distinct_ids(ids.reshape(-1).long())[0]   # as run() looks them up
    split = choose_split_at(layer, lookup.shape[0])
    return decide(layer, lookup, split, ids)


def choose_split_at(layer, rows: int) -> int:
    """Where the network is split into two half tables for ``rows`` distinct ids (its
    plan's split; 0: a single core)."""
    return layer.plan_for(rows).split if len(layer.layout.row_modes) > 1 else 0


def choose_split(layer, split: int) -> LookupWay:
    """The way of an eager lookup split at ``split`` (:func:`choose_split_at`)."""
    supports = backends.active(layer.cores[0], "lookup_supports") if split else None
    if supports is not None and supports(split, len(layer.layout.row_modes)):
        return LookupWay.TRITON_LOOKUP
    return LookupWay.ONE_TABLE if len(layer.layout.row_modes) == 1 else LookupWay.GATHERED_PRODUCT


def decide(layer, lookup: torch.Tensor, split: int, ids: torch.Tensor) -> LookupWay:
    """The way an eager lookup of the distinct ids ``lookup (rows,)`` runs, split at
    ``split``: the measured fastest of the ways that apply where timing is allowed for a
    call on ``ids`` (:mod:`.measured`), else the prior (:func:`choose_split`)."""
    prior = choose_split(layer, split)
    if prior is LookupWay.ONE_TABLE or not measured.applies(ids, export_checked=True):
        return prior
    like = layer.cores[0]   # the network's dtype and device (read only)
    candidates = _candidates(layer, like, lookup.shape[0], split, prior)
    if len(candidates) == 1:
        return prior
    lay = layer.layout
    shape = (tuple(lay.row_modes), tuple(lay.col_modes), tuple(lay.ranks), split,
             any(p.requires_grad for p in layer.network_tensors()))
    won = measured.fastest_of(layer, "ttm_lookup", shape, like, lookup.shape[0], candidates,
                              lambda: _timer(layer, lookup, split))
    return prior if won is None else LookupWay(won)


def _candidates(layer, like: torch.Tensor, rows: int, split: int, prior: LookupWay) -> tuple[str, ...]:
    """The ways timed for a lookup of ``rows`` distinct ids split at ``split``."""
    if prior is LookupWay.TRITON_LOOKUP:   # switched on: it runs (as the linears' Triton pair)
        return (prior.value,)
    ways = [LookupWay.GATHERED_PRODUCT]
    # on the CPU only: its rows are counted on the host (torch.unique), which a device's
    # step must not do to stay capturable, as distinct_ids does not there
    if like.device.type == "cpu" and \
            rows < math.prod(layer.layout.row_modes[:split]) + math.prod(layer.layout.row_modes[split:]):
        ways.append(LookupWay.HALF_ROWS)
    if math.prod(layer.layout.row_modes) <= tuning.WHOLE_TABLE_SLACK * rows:
        ways.append(LookupWay.WHOLE_TABLE)
    supports = backends.candidate(like, "lookup_supports")
    if supports is not None and backends.candidate(like, "lookup") is not None \
            and supports(split, len(layer.layout.row_modes)):
        ways.append(LookupWay.TRITON_LOOKUP)
    return tuple(w.value for w in ways)


def _timer(layer, lookup: torch.Tensor, split: int):
    """``time_way(way) -> seconds``: a lookup of ``lookup`` the way named and, where the
    table trains, a backward by ``torch.autograd.grad`` (nothing accumulates into ``.grad``)."""
    params = [p for p in layer.network_tensors() if p.requires_grad]
    return measured.forward_backward_timer(lambda name: run_lookup(layer, LookupWay(name), lookup, split), params,
                                           layer.cores[0].device)


def run_lookup(layer, way: LookupWay, lookup: torch.Tensor, split: int) -> torch.Tensor:
    """The rows of ``layer``'s table for the distinct ids ``lookup (rows,)`` the eager way
    ``way``: ``(rows, padded_cols)``."""
    lay = layer.layout
    if way is LookupWay.TRITON_LOOKUP:  # padding positions send no gradient inside the kernel
        return backends.runner_for(layer.cores[0], "lookup")(layer, lookup, split, *layer.network_tensors())
    if way is LookupWay.ONE_TABLE:
        return layer.scaled_cores()[0].reshape(lay.row_modes[0], lay.col_modes[0]).index_select(0, lookup)
    if way is LookupWay.WHOLE_TABLE:   # differentiable calls only (timed): merged afresh, at its cheapest bond
        return merged_table(layer.scaled_cores(), lay).index_select(0, lookup)
    i_left, i_right = split_ids(lookup, math.prod(lay.row_modes[split:]))
    if way is LookupWay.HALF_ROWS:     # differentiable calls only (timed)
        i_left, at_left = torch.unique(i_left, return_inverse=True)
        i_right, at_right = torch.unique(i_right, return_inverse=True)
        left, right = half_table_rows(layer.scaled_cores(), split, i_left, i_right)
        return GatheredProduct.apply(left, right, at_left, at_right).reshape(lookup.shape[0], lay.padded_cols)
    left, right = half_tables_of(layer, split)
    return GatheredProduct.apply(left, right, i_left, i_right).reshape(lookup.shape[0], lay.padded_cols)


def row_digits(rows: torch.Tensor, modes) -> list[torch.Tensor]:
    """Each row index of ``rows (A,)`` as its digits over ``modes`` (row-major, as the
    half tables number their rows): a list of ``len(modes)`` tensors ``(A,)``."""
    digits = []
    for m in reversed(modes):
        digits.append(rows % m)
        rows = torch.div(rows, m, rounding_mode="floor")
    return digits[::-1]


def half_table_rows(cores: list[torch.Tensor], split: int, i_rows: torch.Tensor, j_rows: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``i_rows (A,)`` of the left half table and ``j_rows (B,)`` of the right one
    (:func:`~tncompile.runtime.kernels.traced_lookup.half_tables`, split at ``split``) from
    the gated TTM ``cores (r_k, m_k, n_k, r_{k+1})``, without merging the halves whole:
    ``(A, N_L, r)`` and ``(B, r, N_R)``. Each row is a chain of its cores' slices, one
    :class:`GatheredProduct` per bond (the native kernel each way on CPU), so a lookup of
    few distinct ids costs in proportion to the ids, where merging costs the tables' rows."""
    modes = [c.shape[1] for c in cores]
    left = cores[0].squeeze(0)                              # (m0, n0, r1): rows by the first digit
    index = row_digits(i_rows, modes[:split]) if split > 1 else [i_rows]
    at = index[0]
    for k in range(1, split):
        a, m, n, b = cores[k].shape
        by_row = cores[k].transpose(0, 1).reshape(m, a, n * b).contiguous()
        left = GatheredProduct.apply(left.contiguous(), by_row, at, index[k])   # (A, N, n b)
        left = left.reshape(left.shape[0], -1, b)
        at = torch.arange(left.shape[0], device=left.device)
    if split == 1:
        left = left.index_select(0, at)
    last = len(cores) - 1
    right = cores[-1].squeeze(-1).transpose(0, 1).contiguous()   # (m, r, n): rows by the last digit
    index = row_digits(j_rows, modes[split:]) if last > split else [j_rows]
    at = index[-1]
    for k in range(last - 1, split - 1, -1):
        a, m, n, b = cores[k].shape
        by_row = cores[k].transpose(0, 1).reshape(m, a * n, b).contiguous()
        right = GatheredProduct.apply(by_row, right.contiguous(), index[k - split], at)   # (B, a n, N)
        right = right.reshape(right.shape[0], a, -1)
        at = torch.arange(right.shape[0], device=right.device)
    if last == split:
        right = right.index_select(0, at)
    return left, right


def whole_table(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """The table from its two halves: ``L (M_L, N_L, r)``, ``R (M_R, r, N_R)`` ->
    ``(M_L M_R, N_L N_R)``, row ``a M_R + b``, column ``n N_R + m`` holding
    ``L[a, n] @ R[b, :, m]`` (the gathered product's layout), as one matrix product."""
    m_l, n_l, r = left.shape
    m_r, _, n_r = right.shape
    product = left.reshape(m_l * n_l, r) @ right.transpose(0, 1).reshape(r, m_r * n_r)
    return product.reshape(m_l, n_l, m_r, n_r).transpose(1, 2).reshape(m_l * m_r, n_l * n_r)


def merged_table(cores: list[torch.Tensor], layout) -> torch.Tensor:
    """The table ``(padded_rows, padded_cols)`` merged from gated TTM ``cores`` as one
    product of its two half tables at the bond where that costs least (:func:`whole_table`):
    the table's ``V·D·r`` multiply-adds once, with no table-sized intermediate but the result
    (merging core by core makes several; on the 1B Llama's 128k x 2048 table, ranks
    136/136/88, forward and backward with a 128-row product: 5.3 s instead of 9.4 s)."""
    if len(cores) == 1:
        return cores[0].reshape(layout.padded_rows, layout.padded_cols)
    split, best = 1, _merge_cost(layout, 1)
    for k in range(2, len(cores)):   # a loop, not min(key=...): Dynamo traces this under torch.compile
        cost = _merge_cost(layout, k)
        if cost < best:
            split, best = k, cost
    return whole_table(*half_tables(cores, split))


def _merge_cost(layout, split: int) -> float:
    """Multiply-adds of merging the table at ``split``: the half tables, then their product."""
    table = layout.padded_rows * layout.padded_cols
    ranks = (1, *layout.ranks, 1)
    left = sum(math.prod(layout.row_modes[:k + 1]) * math.prod(layout.col_modes[:k + 1]) * ranks[k] * ranks[k + 1]
               for k in range(1, split))
    right = sum(math.prod(layout.row_modes[k:]) * math.prod(layout.col_modes[k:]) * ranks[k] * ranks[k + 1]
                for k in range(split, len(layout.row_modes) - 1))
    return table * ranks[split] + left + right


def require_int_ids(ids: torch.Tensor) -> None:
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"TTMEmbedding expects integer ids, got {ids.dtype}")


def check_layer_ids(layer, ids: torch.Tensor) -> None:
    """Ids must be integers in ``[0, num_embeddings)`` (:func:`.traced_lookup.check_ids`:
    a host read on CPU, a device-side assert elsewhere and while traced)."""
    require_int_ids(ids)
    check_ids(ids, layer.num_embeddings, host_read=not torch.compiler.is_compiling())


def half_tables_of(layer, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``L[M_L, N_L, r]`` and ``R[M_R, r, N_R]``: merged now in a differentiable or traced
    call, else the layer's kept pair (``layer.kept_half_tables``)."""
    if keeps_merged_forms():
        return layer.kept_half_tables(split)
    return half_tables(layer.scaled_cores(), split)


class GatheredProduct(torch.autograd.Function):
    """``out[t] = L[i[t]] @ R[j[t]]`` with a backward that scatters into ``L`` and ``R``
    (:func:`.traced_lookup.gathered_product`: one native kernel each way on CPU).

    Shapes: ``L (M_L, N_L, r)``, ``R (M_R, r, N_R)``, ``i, j (T,)`` -> ``(T, N_L, N_R)``.
    """

    @staticmethod
    def forward(ctx, left, right, i, j):
        ctx.save_for_backward(left, right, i, j)
        ctx.autocast = autocast_state(left.device.type)
        return gathered_product(left, right, i, j)

    @staticmethod
    def backward(ctx, grad):
        left, right, i, j = ctx.saved_tensors
        with same_autocast(ctx.autocast):
            g_left, g_right = gathered_product_backward(grad, left, right, i, j, ctx.needs_input_grad[0],
                                                        ctx.needs_input_grad[1])
        return g_left, g_right, None, None


def run(layer, ids: torch.Tensor) -> torch.Tensor:
    """``layer``'s lookup: integer ``ids (...)`` -> ``(..., embedding_dim)``, the way
    :func:`choose` says."""
    lay = layer.layout
    if exporting():
        return _exported(layer, ids)
    if torch.compiler.is_compiling() and len(lay.row_modes) > 1:
        return _traced(layer, ids)
    layer._check_ids(ids)
    first_cpu_use(ids)
    flat = ids.reshape(-1).long()
    lookup, inverse = distinct_ids(flat)
    split = choose_split_at(layer, lookup.shape[0])
    way = decide(layer, lookup, split, ids)
    record(layer, way)
    triton = way is LookupWay.TRITON_LOOKUP
    out = run_lookup(layer, way, lookup, split)
    if lay.padded_cols != lay.embedding_dim:
        out = out[:, : lay.embedding_dim]
    if inverse is not None:
        out = out.index_select(0, inverse)
    if layer.padding_idx is not None and not triton:  # the row's value, no gradient from these positions
        out = torch.where((flat == layer.padding_idx).unsqueeze(-1), out.detach(), out)
    return out.reshape(*ids.shape, lay.embedding_dim)


def _exported(layer, ids: torch.Tensor) -> torch.Tensor:
    """Under ``torch.export`` (and ONNX's exporter): the two half tables merged in the
    graph at the network's narrowest bond, then two gathers and a ``bmm`` per id --
    core ATen ops only, for any number of ids. Ids are not range-checked here (an
    exported program has no host reads); the padding row is the row stored."""
    require_int_ids(ids)
    lay = layer.layout
    flat = ids.reshape(-1).long()
    cores = layer.scaled_cores()
    if len(lay.row_modes) == 1:
        out = cores[0].reshape(lay.row_modes[0], lay.col_modes[0]).index_select(0, flat)
    else:
        split = 1 + min(range(len(lay.ranks)), key=lambda k: lay.ranks[k])
        left, right = half_tables(cores, split)
        i_left, i_right = split_ids(flat, math.prod(lay.row_modes[split:]))
        out = torch.bmm(left.index_select(0, i_left), right.index_select(0, i_right))
        out = out.reshape(flat.shape[0], lay.padded_cols)
    return out[:, : lay.embedding_dim].reshape(*ids.shape, lay.embedding_dim)


def _traced(layer, ids: torch.Tensor) -> torch.Tensor:
    """Under ``torch.compile``: the whole lookup as one opaque op each way
    (``tncompile::ttm_lookup``, :mod:`.traced_lookup`), not ~8 inductor kernels."""
    require_int_ids(ids)  # the range is checked inside the op, on real data
    flat = ids.reshape(-1).long()
    split = layer.plan_for(flat.shape[0]).split
    out = ttm_lookup(flat, list(layer.cores._parameters.values()), list(layer.gates._parameters.values()), split,
                     layer.num_embeddings, layer.embedding_dim, layer.padding_idx)[0]
    return out.reshape(*ids.shape, layer.embedding_dim)
