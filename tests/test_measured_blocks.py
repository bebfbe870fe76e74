"""Issue 54: fused blocks and TTM lookups choose among their correct ways by measurement,
as a TT linear does -- the feed-forward block (fused kernel vs the layers one by one), the
sibling linears (one pass vs each layer), the TTM lookup (gathered product vs the whole
merged table) -- and ``compile(batch_sizes=...)`` measures ahead, so the first step at a
named batch size times nothing."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile import tuning
from tncompile.runtime import TTLinear, TTMEmbedding
from tncompile.runtime.fused.feed_forward import tt_feed_forward
from tncompile.runtime.fused.siblings import tt_siblings
from tncompile.runtime.native import native_ops
from tncompile.runtime.ways import feed_forward, lookup, measured, siblings
from tncompile.runtime.ways.feed_forward import FeedForwardWay
from tncompile.runtime.ways.linear import LinearWay
from tncompile.runtime.ways.lookup import LookupWay
from tncompile.runtime.ways.siblings import SiblingsWay
from tncompile.testing import small_encoder

native = pytest.mark.skipif(native_ops() is None, reason="native kernels not built here")


@pytest.fixture(autouse=True)
def fresh_winners():
    measured.forget()
    yield
    measured.forget()


def _timed_as(monkeypatch, module, fastest: str, timed: list | None = None) -> None:
    """``module``'s candidate ways timed so that ``fastest`` wins (each name asked is noted in ``timed``)."""
    def timer(*args):
        return lambda way: (timed.append(way) if timed is not None else None) or (0.001 if way == fastest else 0.01)
    monkeypatch.setattr(module, "_timer", timer)


def _grads(outputs, inputs):
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    return torch.autograd.grad([o.square().sum() for o in outputs], inputs, allow_unused=True)


def _tt(fin, fout, rank, seed):
    torch.manual_seed(seed)
    return TTLinear.from_linear(nn.Linear(fin, fout), rank=rank)


@native
@pytest.mark.parametrize("fastest", [FeedForwardWay.FUSED, FeedForwardWay.LAYERS])
def test_the_feed_forward_block_runs_the_way_measured_fastest(fastest, monkeypatch):
    first, second = _tt(64, 256, 8, 0), _tt(256, 64, 8, 1)
    x = torch.randn(512, 64, requires_grad=True)
    _timed_as(monkeypatch, feed_forward, fastest.value)
    with tuning.override(FUSE_FLOP_SLACK=1e9):
        assert feed_forward.choose(x, first, second, True, "gelu") is fastest
        y = tt_feed_forward(x, first, second, "gelu")
    ran = first.ran_as, second.ran_as
    if fastest is FeedForwardWay.FUSED:
        assert ran == (fastest, fastest)              # the report's "ran as" for both layers
    else:
        assert all(isinstance(w, LinearWay) for w in ran)
    params = [x, *first.parameters(), *second.parameters()]
    ref = nn.functional.linear(F.gelu(nn.functional.linear(x, first.weight(), first.bias)), second.weight(),
                               second.bias)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    for got, want in zip(_grads(y, params), _grads(ref, params)):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    # the block, once; layer by layer, each layer's own row ways too
    assert measured.stats()["measured"] == (1 if fastest is FeedForwardWay.FUSED else 3)


@native
@pytest.mark.parametrize("fastest", [SiblingsWay.ONE_PASS, SiblingsWay.EACH])
def test_sibling_linears_run_the_way_measured_fastest(fastest, monkeypatch):
    layers = [_tt(64, 64, 8, 2), _tt(64, 64, 8, 3), _tt(64, 96, 6, 4)]
    x = torch.randn(320, 64, requires_grad=True)
    _timed_as(monkeypatch, siblings, fastest.value)
    with tuning.override(FUSE_FLOP_SLACK=1e9):
        assert siblings.choose(x, layers, True) is fastest
        outs = tt_siblings(x, layers)
    if fastest is SiblingsWay.ONE_PASS:
        assert all(m.ran_as is fastest for m in layers)
    else:
        assert all(isinstance(m.ran_as, LinearWay) for m in layers)
    refs = [nn.functional.linear(x, m.weight(), m.bias) for m in layers]
    params = [x, *(p for m in layers for p in m.parameters())]
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
    for got, want in zip(_grads(outs, params), _grads(refs, params)):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def _embedding(rows=120, dim=32, seed=0, padding_idx=None):
    torch.manual_seed(seed)
    return TTMEmbedding.from_embedding(nn.Embedding(rows, dim, padding_idx=padding_idx), rank=6)


@pytest.mark.parametrize("fastest", [LookupWay.GATHERED_PRODUCT, LookupWay.WHOLE_TABLE])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_the_lookup_runs_the_way_measured_fastest(fastest, padding_idx, monkeypatch):
    emb = _embedding(padding_idx=padding_idx)
    ids = torch.randint(0, 120, (4, 50))
    ids[0, :5] = 3
    timed = []
    _timed_as(monkeypatch, lookup, fastest.value, timed)
    assert lookup.choose(emb, ids) is fastest
    y = emb(ids)
    assert emb.ran_as is fastest and sorted(timed) == ["gathered product", "whole table"]
    weight = emb.weight().detach().requires_grad_()
    ref = F.embedding(ids, weight, padding_idx=padding_idx)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    # gradients: the cores' through the dense table's chain rule
    upstream = torch.randn_like(y)
    got = torch.autograd.grad(y, list(emb.parameters()), upstream, allow_unused=True)
    table_grad = torch.autograd.grad(ref, weight, upstream)[0]
    want = torch.autograd.grad(emb.weight(), list(emb.parameters()), table_grad, allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_the_whole_table_is_the_dense_table_and_its_gradient_checks():
    left = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)    # (M_L, N_L, r)
    right = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)   # (M_R, r, N_R)
    want = torch.einsum("anr,brm->abnm", left, right).reshape(6, 24)
    torch.testing.assert_close(lookup.whole_table(left, right), want)
    assert torch.autograd.gradcheck(lookup.whole_table, (left, right))


def test_a_table_far_larger_than_the_rows_looked_up_is_not_a_candidate(monkeypatch):
    emb = _embedding(rows=4096, dim=16)
    timed = []
    _timed_as(monkeypatch, lookup, "whole table", timed)
    emb(torch.arange(40).reshape(4, 10))     # 40 ids: the table holds 100x more rows
    assert emb.ran_as is LookupWay.GATHERED_PRODUCT and sorted(set(timed)) == ["gathered product", "half rows"]
    timed.clear()
    with tuning.override(WHOLE_TABLE_SLACK=1000):
        emb(torch.arange(40).reshape(4, 10))
    assert emb.ran_as is LookupWay.WHOLE_TABLE and sorted(set(timed)) == ["gathered product", "half rows", "whole table"]


def test_no_lookup_is_timed_where_the_choice_must_not_depend_on_timing():
    emb = _embedding()
    ids = torch.randint(0, 120, (4, 50))
    with torch.no_grad():
        emb(ids)
    with tuning.override(MEASURE_WAYS=False):
        emb(ids)
    assert emb.ran_as is LookupWay.GATHERED_PRODUCT and measured.stats()["measured"] == 0
    emb(ids)                                 # a training call measures, once
    emb(ids)
    assert measured.stats()["measured"] == 1


def test_the_ways_of_blocks_and_lookups_are_what_a_cache_file_may_name():
    names = ["fused native", "layer by layer", "one pass", "each layer", "gathered product", "half rows", "whole table",
             "triton lookup"]
    assert measured.check_winners({f"k{i}": n for i, n in enumerate(names)})
    with pytest.raises(ValueError, match="not a known way"):
        measured.check_winners({"k": "fused traced ops"})   # not a way timing chooses


def _encoder_step(model, ids):
    model(ids).square().mean().backward()


@native
def test_compile_with_batch_sizes_measures_ahead_and_the_first_step_times_nothing():
    ids = torch.randint(1, 1000, (8, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lazy = tncompile.compile(small_encoder(d_model=64, d_ff=256, max_len=64), target_ratio=0.2,
                                 example_inputs=(ids[:2],))
        assert measured.stats()["measured"] == 0           # no batch sizes named: nothing timed at compile
        ahead = tncompile.compile(small_encoder(d_model=64, d_ff=256, max_len=64), target_ratio=0.2,
                                  example_inputs=(ids[:2],), batch_sizes=[8])
    record = next(r for r in ahead.program.history if r.name == "measure_ways")
    timed = measured.stats()["measured"]
    at_compile = set(measured.snapshot())
    assert timed >= 3 and record.matches["shapes timed"] == timed   # linears, feed-forward, siblings
    assert {key.split("|")[0] for key in at_compile} >= {"tt_linear", "tt_feed_forward"}
    _encoder_step(ahead, ids)
    # every linear's and block's shape at a batch of 8 was known; lookups are timed on first
    # use (their rows are the batch's distinct ids: data)
    assert {key.split("|")[0] for key in set(measured.snapshot()) - at_compile} <= {"ttm_lookup"}
    ran = {m.ran_as for m in ahead.modules() if isinstance(m, TTLinear)}
    assert ran and all(isinstance(w, (LinearWay, FeedForwardWay, SiblingsWay)) for w in ran)
    timed = measured.stats()["measured"]
    _encoder_step(lazy, ids)                               # the same shapes: known here too
    assert measured.stats()["measured"] == timed
    lazy.load_state_dict(ahead.state_dict())
    torch.testing.assert_close(lazy.eval()(ids), ahead.eval()(ids), rtol=1e-4, atol=1e-5)  # no dropout


def test_nothing_is_measured_at_compile_where_measuring_is_off():
    ids = torch.randint(1, 1000, (8, 32))
    with warnings.catch_warnings(), tuning.override(MEASURE_WAYS=False):
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(small_encoder(d_model=64, d_ff=256, max_len=64), target_ratio=0.2,
                                     example_inputs=(ids[:2],), batch_sizes=[8])
    assert measured.stats()["measured"] == 0
    assert not next(r for r in compiled.program.history if r.name == "measure_ways").matches


def test_batch_sizes_too_large_to_time_ahead_are_left_to_first_use():
    """Named batch sizes whose timing tensors would pass ``tuning.MEASURE_AHEAD_BYTES`` are
    not timed at compile (``batch_sizes=[2**30]`` must not allocate gigabytes)."""
    from tncompile.testing import mlp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(mlp((256, 256, 10)), target_ratio=0.3, prefer="size",
                                     batch_sizes=[64, 2**30])
    matches = next(r for r in compiled.program.history if r.name == "measure_ways").matches
    assert matches["left to first use (over tuning.MEASURE_AHEAD_BYTES)"] >= 1
    assert matches["shapes timed"] == measured.stats()["measured"] >= 1


def _tied_head(vocab=600, dim=48, rank=8, bias=True):
    from tncompile.runtime import TTMTiedLinear
    torch.manual_seed(0)
    emb = TTMEmbedding.from_embedding(nn.Embedding(vocab, dim), rank=rank)
    return TTMTiedLinear(emb, bias=bias)


@pytest.mark.parametrize("fastest", ["merged table", "half tables per call", "planned contraction"])
def test_a_tied_head_trains_the_way_measured_fastest(fastest, monkeypatch):
    from tncompile.runtime.ways import tied_head
    from tncompile.runtime.ways.tied_head import TiedHeadWay
    head = _tied_head()
    with torch.no_grad():
        head.bias.normal_()
    timed = []
    _timed_as(monkeypatch, tied_head, fastest, timed)
    x = torch.randn(3, 7, 48, requires_grad=True)
    assert tied_head.choose(head, x) is TiedHeadWay(fastest)
    y = head(x)
    assert head.ran_as is TiedHeadWay(fastest) and sorted(timed) == sorted(w.value for w in tied_head.MEASURED)
    table = head.embedding.weight()
    ref = F.linear(x, table, head.bias)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    params = [x, *head.embedding.parameters(), head.bias]
    for got, want in zip(_grads(y, params), _grads(ref, params)):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_the_merged_table_is_the_network_and_its_gradient_checks():
    from tncompile.formats import TTMLayout
    from tncompile.formats.factorization import random_cores, ttm_to_dense
    from tncompile.runtime.ways.lookup import merged_table
    layout = TTMLayout(ranks=(3, 4), num_embeddings=50, embedding_dim=20, row_modes=(3, 4, 5), col_modes=(2, 2, 5))
    cores = [c.requires_grad_() for c in random_cores(layout, 1.0)]   # float64
    torch.testing.assert_close(merged_table(cores, layout)[:50, :20], ttm_to_dense(cores, layout))
    assert torch.autograd.gradcheck(lambda *cs: merged_table(list(cs), layout), tuple(cores))


def test_a_tied_head_is_never_timed_without_autograd():
    from tncompile.runtime.ways.tied_head import TiedHeadWay
    head = _tied_head()
    with torch.no_grad():
        head(torch.randn(4, 48))
    assert head.ran_as in (TiedHeadWay.KEPT_TABLE, TiedHeadWay.HALF_TABLES) and measured.stats()["measured"] == 0
