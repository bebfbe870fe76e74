"""Issue 54: every op's way is a value -- ``ways.<op>.choose(...)`` says it for each context
(eager, no-grad, ``torch.compile``, ``torch.export``), and the op runs what it says."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tncompile import tuning
from tncompile.runtime import TTMEmbedding, TTMTiedLinear
from tncompile.runtime.native import native_ops
from tncompile.runtime.ways import attention, dropout, tied_head
from tncompile.runtime.ways.attention import AttentionWay
from tncompile.runtime.ways.dropout import DropoutWay
from tncompile.runtime.ways.tied_head import TiedHeadWay

native = pytest.mark.skipif(native_ops() is None, reason="native kernels not built here")


def _compiled_choice(fn, *args):
    """What ``fn(*args)`` returns while ``torch.compile`` traces (a constant of the graph)."""
    seen = []

    def probe(*xs):
        seen.append(fn(*xs))
        return xs[0] * 1
    torch._dynamo.reset()
    torch.compile(probe, backend="eager", fullgraph=True)(*args)
    return seen[0]


@native
def test_dropout_ways():
    x = torch.randn(8, 16)
    assert dropout.choose(x, 0.1) is DropoutWay.NATIVE
    assert dropout.choose(x, 0.1, training=False) is DropoutWay.PYTORCH      # eval: the identity
    assert dropout.choose(x, 0.0) is DropoutWay.PYTORCH
    assert dropout.choose(x, 0.1, inplace=True) is DropoutWay.PYTORCH
    assert dropout.choose(x.double(), 0.1) is DropoutWay.NATIVE
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dropout.choose(x, 0.1) is DropoutWay.PYTORCH                  # autocast: PyTorch's
    assert _compiled_choice(lambda t: dropout.choose(t, 0.1), x) is DropoutWay.TRACED_OP


@native
def test_attention_ways():
    q = torch.randn(2, 3, 5, 4)
    assert attention.choose(q) is AttentionWay.NATIVE
    assert attention.choose(q.half()) is AttentionWay.PYTORCH
    assert _compiled_choice(attention.choose, q) is AttentionWay.TRACED_OP


def _head(vocab: int = 1000):
    torch.manual_seed(0)
    emb = TTMEmbedding.from_embedding(nn.Embedding(vocab, 48), rank=8, num_cores=3, init="random")
    return TTMTiedLinear(emb, bias=True)


def test_tied_head_ways_are_what_runs():
    # a few rows of a large table: two half tables; a small table: the kept merged one
    for head, x, expected in ((_head(8000), torch.randn(1, 48), TiedHeadWay.HALF_TABLES),
                              (_head(1000), torch.randn(512, 48), TiedHeadWay.KEPT_TABLE)):
        with torch.no_grad():
            assert tied_head.choose(head, x) is expected
            y = head(x)
        assert head.ran_as is expected
        torch.testing.assert_close(y, x @ head.embedding.weight().t() + head.bias, rtol=1e-4, atol=1e-4)
    head = _head()
    for rows in (1, 512):
        x = torch.randn(rows, 48)
        with tuning.override(MEASURE_WAYS=False):   # the prior (timed: test_measured_blocks.py)
            way = tied_head.choose(head, x)
            assert way is (TiedHeadWay.MERGED_TABLE if head.merges_at(rows) else TiedHeadWay.PLANNED)
            head(x)
        assert head.ran_as is way
        way = tied_head.choose(head, x)             # measured: the fastest of the differentiable ways
        assert way in tied_head.MEASURED
        head(x)
        assert head.ran_as is way


def test_a_tied_head_exported_is_its_own_way(monkeypatch):
    head = _head().eval()
    real = tied_head._decide
    seen = []

    def spy(layer, x):
        got = real(layer, x)
        seen.append(got[0])
        return got
    monkeypatch.setattr(tied_head, "_decide", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.export(head, (torch.randn(2, 48),))
    assert seen and set(seen) == {TiedHeadWay.EXPORTED}


def test_experts_ways():
    from tncompile.runtime.layers.experts import ExpertLinear, TTExperts
    from tncompile.runtime.ways import experts
    from tncompile.runtime.ways.experts import ExpertsWay
    torch.manual_seed(0)
    dense = ExpertLinear(nn.Parameter(torch.randn(4, 24, 16) * 0.1))
    layer = TTExperts.from_experts(dense, rank=4)
    x = torch.randn(10, 16)
    assert experts.choose(layer, x) is ExpertsWay.PER_EXPERT
    assert _compiled_choice(lambda t: experts.choose(layer, t), x) is ExpertsWay.GROUPED
    offs = torch.tensor([3, 5, 8, 10])
    y = layer(x, offs)
    assert layer.ran_as is ExpertsWay.PER_EXPERT
    torch.testing.assert_close(y, experts.grouped_mm(x, layer.weight().transpose(-2, -1), offs), rtol=1e-4,
                               atol=1e-4)


@native
def test_feed_forward_and_sibling_ways():
    from tncompile.runtime import TTLinear
    from tncompile.runtime.ways import feed_forward, siblings
    from tncompile.runtime.ways.feed_forward import FeedForwardWay
    from tncompile.runtime.ways.siblings import SiblingsWay
    from tncompile import tuning
    torch.manual_seed(0)
    first = TTLinear.from_linear(nn.Linear(64, 256), rank=8)
    second = TTLinear.from_linear(nn.Linear(256, 64), rank=8)
    x = torch.randn(512, 64)
    with tuning.override(FUSE_FLOP_SLACK=1e9, MEASURE_WAYS=False):  # the prior (timing: test_measured_blocks.py)
        assert feed_forward.choose(x, first, second, True) is FeedForwardWay.FUSED
        assert feed_forward.choose(x, first, second, False) is FeedForwardWay.LAYERS     # not two TT linears
        assert feed_forward.choose(x[:8], first, second, True) is FeedForwardWay.LAYERS  # under FUSE_MIN_ROWS
        assert _compiled_choice(lambda t: feed_forward.choose(t, first, second, True), x) is FeedForwardWay.TRACED
        q, k = (TTLinear.from_linear(nn.Linear(64, 64), rank=8) for _ in range(2))
        assert siblings.choose(x, [q, k], True) is SiblingsWay.ONE_PASS
        assert siblings.choose(x, [q], True) is SiblingsWay.EACH
        assert _compiled_choice(lambda t: siblings.choose(t, [q, k], True), x) is SiblingsWay.EACH
