"""The ``half rows`` lookup way: only the half-table rows a call's ids need, each chained from
its cores' slices, against the merged half tables and the dense table they stand for."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tncompile.runtime import TTMEmbedding, TTMEmbeddingBag
from tncompile.runtime.kernels.traced_lookup import half_tables
from tncompile.runtime.ways import lookup, measured
from tncompile.runtime.ways.lookup import LookupWay, half_table_rows, row_digits

LAYOUTS = [((3, 4), (2, 3)), ((3, 4, 5), (2, 2, 3)), ((2, 3, 4, 5), (2, 1, 2, 3))]


def _cores(modes, cols, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ranks = (1, *(3 + k for k in range(len(modes) - 1)), 1)
    return [torch.randn(ranks[k], modes[k], cols[k], ranks[k + 1], generator=g, dtype=dtype).requires_grad_()
            for k in range(len(modes))]


def test_row_digits_are_row_major():
    rows = torch.arange(2 * 3 * 4)
    digits = row_digits(rows, (2, 3, 4))
    assert torch.equal(digits[0] * 12 + digits[1] * 4 + digits[2], rows)
    assert [int(d.max()) for d in digits] == [1, 2, 3]


@pytest.mark.parametrize("modes,cols", LAYOUTS)
def test_half_rows_are_the_merged_half_tables_rows_at_every_split(modes, cols):
    cores = _cores(modes, cols)
    for split in range(1, len(modes)):
        left, right = half_tables(cores, split)
        i = torch.tensor([left.shape[0] - 1, 0, 1])
        j = torch.tensor([0, right.shape[0] - 1])
        got_left, got_right = half_table_rows(cores, split, i, j)
        torch.testing.assert_close(got_left, left[i])
        torch.testing.assert_close(got_right, right[j])
        # gradients: against the merged tables' for the same upstream gradient
        up_l, up_r = torch.randn_like(got_left), torch.randn_like(got_right)
        got = torch.autograd.grad([got_left, got_right], cores, [up_l, up_r])
        want = torch.autograd.grad([left[i], right[j]], cores, [up_l, up_r])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_half_rows_gradcheck_in_float64(split):
    cores = _cores((2, 3, 2, 3), (2, 1, 2, 2))
    i, j = torch.tensor([0, 5, 2]), torch.tensor([1, 0])
    i = i % math.prod(c.shape[1] for c in cores[:split])
    j = j % math.prod(c.shape[1] for c in cores[split:])
    assert torch.autograd.gradcheck(lambda *c: half_table_rows(list(c), split, i, j), cores)


def _timed_as(monkeypatch, fastest: str, timed: list) -> None:
    def timer(*args):
        return lambda way: timed.append(way) or (0.001 if way == fastest else 0.01)
    monkeypatch.setattr(lookup, "_timer", timer)


@pytest.mark.parametrize("padding_idx", [None, 7])
def test_a_lookup_the_half_rows_way_is_the_dense_lookup_forward_and_backward(padding_idx, monkeypatch):
    measured.forget()
    torch.manual_seed(0)
    emb = TTMEmbedding.from_embedding(nn.Embedding(4096, 16, padding_idx=padding_idx), rank=6)
    ids = torch.tensor([[7, 7, 4095, 0, 1000], [3, 7, 1000, 2222, 64]])   # repeats, both ends, the padding row
    timed: list = []
    _timed_as(monkeypatch, "half rows", timed)
    y = emb(ids)
    assert emb.ran_as is LookupWay.HALF_ROWS and "half rows" in timed and "gathered product" in timed
    weight = emb.weight().detach().requires_grad_()
    ref = F.embedding(ids, weight, padding_idx=padding_idx)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(y)
    params = list(emb.parameters())
    got = torch.autograd.grad(y, params, upstream, allow_unused=True)
    table_grad = torch.autograd.grad(ref, weight, upstream)[0]
    want = torch.autograd.grad(emb.weight(), params, table_grad, allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    measured.forget()


def test_a_bag_of_few_ids_takes_the_half_rows_when_they_win(monkeypatch):
    measured.forget()
    torch.manual_seed(1)
    bag = TTMEmbeddingBag.from_embedding_bag(nn.EmbeddingBag(50_000, 16, mode="sum"), rank=4)
    ids, offsets = torch.tensor([5, 49_999, 5, 12_345]), torch.tensor([0, 2])
    timed: list = []
    _timed_as(monkeypatch, "half rows", timed)
    out = bag(ids, offsets)
    assert bag.ran_as is LookupWay.HALF_ROWS
    ref = F.embedding_bag(ids, bag.weight().detach(), offsets, mode="sum")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    measured.forget()


def test_the_half_rows_are_a_candidate_only_while_they_need_fewer_rows_than_the_halves_hold():
    torch.manual_seed(0)
    emb = TTMEmbedding.from_embedding(nn.Embedding(4096, 16), rank=6)
    split = lookup.choose_split_at(emb, 40)
    modes = emb.layout.row_modes
    held = math.prod(modes[:split]) + math.prod(modes[split:])
    like = emb.cores[0]
    few = lookup._candidates(emb, like, held - 1, split, LookupWay.GATHERED_PRODUCT)
    many = lookup._candidates(emb, like, held, split, LookupWay.GATHERED_PRODUCT)
    assert "half rows" in few and "half rows" not in many
    # on a device the row counts would be a host read inside a capturable step: never a candidate
    meta = torch.empty(0, device="meta")
    assert "half rows" not in lookup._candidates(emb, meta, held - 1, split, LookupWay.GATHERED_PRODUCT)
