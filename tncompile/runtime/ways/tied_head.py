"""How a tied output head runs a call: its ways, the choice, and the half-table product
that serves a few rows without reading the whole merged table.

:class:`TiedHeadWay` names the ways; :func:`run` is :class:`~tncompile.runtime.TTMTiedLinear`'s
forward. Below, the half-table product.

A head tied to a TTM embedding computes ``logits = x @ E.T`` with ``E`` the
``(vocab, dim)`` table of the network. In inference :class:`.TTMTiedLinear`
keeps ``E`` merged, which costs a dense head's multiply-adds -- but decoding
feeds it one row per sequence, and then the time is reading the table (GPT-2:
50257 x 768 fp32, 154 MB per token), not multiplying it.

Split the network at a bond ``k`` into its two half tables (the same ones a
lookup gathers from, :func:`.traced_lookup.half_tables`):
``L[i_L, n_L, r]`` (cores before the bond) and ``R[i_R, r, n_R]`` (the rest), so
``E[(i_L i_R), (n_L n_R)] = sum_r L[i_L, n_L, r] R[i_R, r, n_R]``. For rows
``x[b, (n_L n_R)]``::

    Y[b, i_L, r, n_R] = sum_{n_L} L[i_L, n_L, r] x[b, n_L, n_R]          # GEMM 1
    logits[b, i_L, i_R] = sum_{r, n_R} Y[b, i_L, r, n_R] R[i_R, r, n_R]  # GEMM 2

reading two half tables of a few MB instead of the whole table. Per row it costs
``M_L r N_L N_R + M_L r N_R M_R`` multiply-adds against the table's ``V D``, so it
pays over a few rows only; :func:`best_split` weighs both with reading a table
(``tuning.TABLE_READ_WEIGHT``) and each kernel's overhead (``tuning.OP_OVERHEAD``).
GPT-2 at ratio 0.1 (ranks 112/124/64): 0.8 ms for one row instead of 3.7 ms, 7.3 ms
for eight instead of 8.7 ms (2-core x86; ``benchmarks/bench_decode.py`` measures the
whole decode).
"""
from __future__ import annotations

import enum
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import tuning
from ...formats.layout import TTMLayout
from ..kernels.executor import contract
from ..kernels.tracing import exporting
from ..kernels.traced_lookup import half_tables
from . import measured
from .linear import record
from .lookup import merged_table
from .network import keeps_merged_forms
from .rows import as_rows, check_input_dtype, drop_boundary, shaped_output

__all__ = ["TiedHeadWay", "choose", "run", "best_split", "half_product_macs", "merged_head_cost", "head_halves",
           "half_table_head", "tied_merge_macs"]


class TiedHeadWay(str, enum.Enum):
    """One way a tied head runs a call (its ``value`` is what the report prints)."""

    EXPORTED = "exported"                 # torch.export / ONNX: the table merged in the graph, one linear
    HALF_TABLES = "half tables"           # no autograd, a few rows: two GEMMs through the kept half tables
    KEPT_TABLE = "kept table"             # no autograd: the kept merged table, transposed
    MERGED_TABLE = "merged table"         # differentiable, many rows: the table merged once per call
    TRAINED_HALVES = "half tables per call"  # differentiable: the half tables merged per call, two GEMMs a row
    PLANNED = "planned contraction"       # the planned order over the cores, per row


#: the differentiable ways timed against each other (:mod:`.measured`)
MEASURED = (TiedHeadWay.MERGED_TABLE, TiedHeadWay.TRAINED_HALVES, TiedHeadWay.PLANNED)
measured.register_ways(w.value for w in MEASURED)


def choose(layer, x: Tensor) -> TiedHeadWay:
    """The way ``layer`` runs ``x (..., embedding_dim)`` in the current context."""
    return _decide(layer, x)[0]


def _decide(layer, x: Tensor):
    lay = layer.layout
    rows = x.numel() // max(lay.embedding_dim, 1)
    if exporting():
        return TiedHeadWay.EXPORTED, None
    if layer.merge_in_inference and keeps_merged_forms():
        split = best_split(lay, rows) if rows else None
        return (TiedHeadWay.KEPT_TABLE, None) if split is None else (TiedHeadWay.HALF_TABLES, split)
    prior = TiedHeadWay.MERGED_TABLE if rows and layer.merges_at(rows) else TiedHeadWay.PLANNED
    if rows and len(lay.row_modes) > 1 and isinstance(x, Tensor) and measured.applies(x, export_checked=True):
        split = _cheapest_split(lay, rows)
        candidates = tuple(w.value for w in MEASURED)
        shape = (tuple(lay.row_modes), tuple(lay.col_modes), tuple(lay.ranks), layer.bias is not None)
        won = measured.fastest_of(layer, "tied_head", shape, x, rows, candidates,
                                  lambda: _timer(layer, x, rows, split))
        if won is not None:
            return TiedHeadWay(won), split
    return prior, None


def _cheapest_split(layout: TTMLayout, rows: int) -> int:
    """The split whose half tables serve ``rows`` rows in the fewest multiply-adds."""
    return min(range(1, len(layout.row_modes)), key=lambda k: _half_cost(layout, k, rows))


def _timer(layer, like: Tensor, rows: int, split: int):
    """``time_way(way) -> seconds``: the head forward and backward (by ``torch.autograd.grad``:
    nothing accumulates into ``.grad``) over ``rows`` random rows the way named."""
    generator = torch.Generator(device=like.device).manual_seed(0)
    h = torch.randn(rows, layer.layout.embedding_dim, device=like.device, dtype=like.dtype, generator=generator)
    params = [p for p in (*layer.embedding.network_tensors(), layer.bias) if p is not None and p.requires_grad]
    return measured.forward_backward_timer(lambda name: _run_way(layer, TiedHeadWay(name), h, split), params,
                                           like.device)


def run(layer, x: Tensor) -> Tensor:
    """``layer``'s forward, ``x (..., embedding_dim) -> (..., num_embeddings)``, the way
    :func:`choose` says."""
    way, split = _decide(layer, x)
    if way is TiedHeadWay.EXPORTED:  # the table merged in the graph (an ONNX runtime folds it)
        return F.linear(x, layer.embedding.weight()[: layer.out_features], layer.bias)
    lay = layer.layout
    if way in MEASURED:
        if way is not TiedHeadWay.PLANNED:
            check_input_dtype(layer, x)
        out = _run_way(layer, way, x, split)
        record(layer, way)
        return out
    check_input_dtype(layer, x)
    record(layer, way)
    rows = x.reshape(-1, lay.embedding_dim)  # 2-D: a strided 3-D x would turn matmul into a bmm
    if way is TiedHeadWay.HALF_TABLES:  # a few rows (decoding): two half tables, not the whole table read
        y = _half_table_rows(layer, rows, split)
    else:
        table_t = layer.merged_weight_t()  # (dim, vocab) row-major: x @ table_t streams it in order
        y = torch.addmm(layer.bias, rows, table_t) if layer.bias is not None else rows @ table_t
    return y.reshape(*x.shape[:-1], layer.out_features)


def _run_way(layer, way: TiedHeadWay, x: Tensor, split: int | None) -> Tensor:
    """``x (..., embedding_dim) -> (..., num_embeddings)`` one of the differentiable ways."""
    lay = layer.layout
    if way is TiedHeadWay.PLANNED:
        h, bias, lead = as_rows(layer, x, layer.bias, lay.embedding_dim, lay.col_modes, lay.num_embeddings,
                                lay.padded_rows)
        y = contract(layer.plan_for(h.shape[0]), [h, *drop_boundary(layer.embedding.scaled_cores())], bias)
        return shaped_output(y, lead, lay.num_embeddings, lay.padded_rows)
    if way is TiedHeadWay.MERGED_TABLE:  # a vocabulary-wide output: merging once beats contracting per row
        table = merged_table(layer.embedding.scaled_cores(), lay)[: layer.out_features, : lay.embedding_dim]
        return F.linear(x, table, layer.bias)
    split = split if split is not None else _cheapest_split(lay, x.numel() // lay.embedding_dim)
    rows = x.reshape(-1, lay.embedding_dim)
    if lay.padded_cols != lay.embedding_dim:
        rows = F.pad(rows, (0, lay.padded_cols - lay.embedding_dim))
    left, right_t = head_halves(layer.embedding.scaled_cores(), split)
    y = half_table_head(rows, left, right_t, math.prod(lay.col_modes[:split]))[:, : layer.out_features]
    y = y + layer.bias if layer.bias is not None else y
    return y.reshape(*x.shape[:-1], layer.out_features)


def _half_table_rows(layer, rows: Tensor, split: int) -> Tensor:
    """``rows (B, embedding_dim)`` through the half tables split before core ``split``,
    kept by the layer (``layer.kept_head_halves``): ``(B, vocab)``."""
    lay = layer.layout
    left, right_t = layer.kept_head_halves(split)
    if lay.padded_cols != lay.embedding_dim:
        rows = F.pad(rows, (0, lay.padded_cols - lay.embedding_dim))
    y = half_table_head(rows, left, right_t, math.prod(lay.col_modes[:split]))
    if lay.padded_rows != layer.out_features:
        y = y[:, : layer.out_features]
    return y + layer.bias if layer.bias is not None else y


def tied_merge_macs(layout: TTMLayout, rows: int) -> int:
    """Multiply-adds of a tied head over ``rows`` rows through the merged table: merging
    (about ``V·D·r``, ``r`` the largest rank) plus the dense product ``rows·V·D``."""
    table = layout.num_embeddings * layout.embedding_dim
    return table * (rows + max(layout.ranks or (1,)))

_KERNELS = 4  # two GEMMs, the input's and the middle product's permuted copies


def half_product_macs(layout: TTMLayout, split: int, rows: int) -> int:
    """Multiply-adds of ``rows`` rows through the half tables split before core ``split``."""
    m_left, m_right = math.prod(layout.row_modes[:split]), math.prod(layout.row_modes[split:])
    n_left, n_right = math.prod(layout.col_modes[:split]), math.prod(layout.col_modes[split:])
    rank = layout.ranks[split - 1]
    return rows * m_left * rank * n_right * (n_left + m_right)


def _half_cost(layout: TTMLayout, split: int, rows: int) -> float:
    m_left, m_right = math.prod(layout.row_modes[:split]), math.prod(layout.row_modes[split:])
    n_left, n_right = math.prod(layout.col_modes[:split]), math.prod(layout.col_modes[split:])
    rank = layout.ranks[split - 1]
    read = rank * (m_left * n_left + m_right * n_right)
    return (half_product_macs(layout, split, rows) + tuning.TABLE_READ_WEIGHT * read
            + tuning.OP_OVERHEAD * _KERNELS)


def merged_head_cost(layout: TTMLayout, rows: int) -> float:
    """Cost (multiply-add equivalents) of ``rows`` rows through the merged table: its
    multiply-adds plus reading it once."""
    table = layout.padded_rows * layout.padded_cols
    return table * (rows + tuning.TABLE_READ_WEIGHT) + tuning.OP_OVERHEAD


def best_split(layout: TTMLayout, rows: int) -> int | None:
    """The split whose half tables serve ``rows`` rows at less cost than the merged
    table, or ``None`` where the merged table is cheaper (many rows, a small table,
    a single core)."""
    if len(layout.row_modes) < 2 or not layout.ranks:
        return None
    split = min(range(1, len(layout.row_modes)), key=lambda k: _half_cost(layout, k, rows))
    return split if _half_cost(layout, split, rows) < merged_head_cost(layout, rows) else None


def head_halves(cores: list[Tensor], split: int) -> tuple[Tensor, Tensor]:
    """The two operands of :func:`half_table_head`, laid out for its GEMMs:
    ``left (M_L * r, N_L)`` and ``right_t (r * N_R, M_R)``, both contiguous.

    ``cores`` are the TTM cores with their gates applied."""
    left, right = half_tables(cores, split)              # (M_L, N_L, r), (M_R, r, N_R)
    m_left, n_left, rank = left.shape
    m_right = right.shape[0]
    left = left.permute(0, 2, 1).reshape(m_left * rank, n_left).contiguous()
    right_t = right.reshape(m_right, -1).t().contiguous()
    return left, right_t


def half_table_head(rows: Tensor, left: Tensor, right_t: Tensor, n_left: int) -> Tensor:
    """``rows (B, N_L * N_R)`` (the padded embedding dim) times the table the halves
    stand for, transposed: ``(B, M_L * M_R)`` (the padded vocabulary), contiguous.

    ``left (M_L * r, N_L)`` and ``right_t (r * N_R, M_R)`` from :func:`head_halves`."""
    batch = rows.shape[0]
    n_right = rows.shape[1] // n_left
    rank = right_t.shape[0] // n_right
    m_left = left.shape[0] // rank
    x = rows.reshape(batch, n_left, n_right).permute(1, 0, 2).reshape(n_left, batch * n_right)
    mid = (left @ x).reshape(m_left, rank, batch, n_right)
    mid = mid.permute(2, 0, 1, 3).reshape(batch * m_left, rank * n_right)
    return (mid @ right_t).reshape(batch, m_left * right_t.shape[1])
