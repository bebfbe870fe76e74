"""Every TT / TTM op against the dense matrix it stands for."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
import torch.nn.functional as F
from torch import nn

import cotengra as ctg
from tncompile.formats import TTLayout, TTMLayout
from tncompile.ir import TensorNetwork
from tncompile.runtime import TTLinear, TTMEmbedding, TTMTiedLinear
from tncompile.runtime.ways.linear import through_factors_at
from tncompile.runtime.ways.tied_head import _half_table_rows

f64 = torch.float64


def _randomize(mod):
    with torch.no_grad():
        for c in mod.cores:
            c.normal_()
        for g in mod.gates:
            g.uniform_(0.5, 1.5)  # non-trivial gates must be part of the function
    return mod


@given(in_f=st.integers(2, 40), out_f=st.integers(2, 40), d=st.integers(1, 3),
       rank=st.integers(1, 6), lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
       bias=st.booleans())
@settings(max_examples=40, deadline=None)
def test_tt_linear_forward_and_grads_match_dense(in_f, out_f, d, rank, lead, bias):
    try:
        lay = TTLayout.for_shape(in_f, out_f, d, ranks=rank)
    except ValueError:
        return  # too small for d modes
    tt = _randomize(TTLinear(lay, bias=bias, dtype=f64))
    x = torch.randn(*lead, in_f, dtype=f64, requires_grad=True)
    y = tt(x)
    w = tt.weight()
    ref = x @ w.t() + (tt.bias if bias else 0)
    assert y.shape == (*lead, out_f)
    assert torch.allclose(y, ref, atol=1e-10)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *tt.cores, *tt.gates], g)
    ref_grads = torch.autograd.grad(ref, [x, *tt.cores, *tt.gates], g)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-9)


def test_tt_linear_gradcheck():
    tt = _randomize(TTLinear(TTLayout.for_shape(6, 10, 2, ranks=3), dtype=f64))
    x = torch.randn(4, 6, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *p: tt(x), (x, *tt.cores, *tt.gates))


def test_tt_linear_from_linear_exact_at_full_rank():
    lin = nn.Linear(30, 20).double()
    tt = TTLinear.from_linear(lin, rank=10 ** 6, num_cores=2)
    x = torch.randn(7, 30, dtype=f64)
    assert torch.allclose(tt(x), lin(x), atol=1e-10)
    assert torch.allclose(tt.to_dense_module()(x), lin(x), atol=1e-10)


def test_tt_linear_network_contracts_to_weight_with_cotengra():
    tt = _randomize(TTLinear(TTLayout.for_shape(12, 20, 2, ranks=3), bias=False, dtype=f64))
    net = TensorNetwork.of(tt)
    x = torch.randn(5, 12, dtype=f64)
    inputs, output, size = net.to_cotengra(5)
    arrays = {"x": x.reshape(5, *tt.layout.in_modes)}
    arrays.update({f"G{k}": c for k, c in enumerate(tt.cores)})
    arrays.update({f"g{k + 1}": g for k, g in enumerate(tt.gates)})
    y = ctg.array_contract([arrays[n] for n in net.tensor_names()], inputs, output)
    assert torch.allclose(y.reshape(5, -1)[:, :20], tt(x), atol=1e-10)
    assert net.graph.number_of_nodes() == 1 + 4 + 3  # input, cores, gates


@given(V=st.integers(8, 300), D=st.integers(4, 40), d=st.integers(1, 3), rank=st.integers(1, 5),
       pad=st.booleans())
@settings(max_examples=40, deadline=None)
def test_ttm_embedding_matches_dense_table(V, D, d, rank, pad):
    try:
        lay = TTMLayout.for_shape(V, D, d, ranks=rank)
    except ValueError:
        return
    emb = _randomize(TTMEmbedding(lay, padding_idx=1 if pad else None, dtype=f64))
    ids = torch.randint(0, V, (3, 5))
    ids[0, 0] = 1
    out = emb(ids)
    table = emb.weight()
    ref = table[ids]
    if pad:  # nn.Embedding's meaning: the row's value, no gradient from these positions
        ref = torch.where((ids == 1).unsqueeze(-1), ref.detach(), ref)
    assert out.shape == (3, 5, D)
    assert torch.allclose(out, ref, atol=1e-10)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [*emb.cores, *emb.gates], g)
    ref_grads = torch.autograd.grad(ref, [*emb.cores, *emb.gates], g)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-9)


def test_ttm_gradcheck_and_tied_head_gradcheck():
    emb = _randomize(TTMEmbedding(TTMLayout.for_shape(20, 6, 2, ranks=3), dtype=f64))
    ids = torch.tensor([[0, 3, 19], [7, 7, 2]])
    assert torch.autograd.gradcheck(lambda *p: emb(ids), tuple(emb.cores) + tuple(emb.gates))
    head = TTMTiedLinear(emb, bias=True).double()
    x = torch.randn(3, 6, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *p: head(x), (x, *emb.cores, head.bias))
    assert torch.allclose(head(x), x @ emb.weight().t() + head.bias, atol=1e-10)


def test_padding_idx_row_is_the_tables_and_gets_no_gradient():
    """nn.Embedding's meaning: a padding lookup returns the stored row (zero for a
    zero dense row at full rank) and sends no gradient; to_dense keeps that row, so a
    tied head reading it matches the dense model exactly."""
    dense = nn.Embedding(50, 8, padding_idx=0).double()
    emb = TTMEmbedding.from_embedding(dense, rank=10 ** 6, num_cores=2)
    only_pad = torch.zeros(4, dtype=torch.long)
    out = emb(only_pad)
    assert torch.allclose(out, torch.zeros_like(out), atol=1e-12)
    out.sum().backward()
    assert all(c.grad is None or torch.count_nonzero(c.grad) == 0 for c in emb.cores)
    ids = torch.tensor([0, 5, 49])
    assert torch.allclose(emb(ids), dense(ids), atol=1e-10)
    with torch.no_grad():  # a padding row that is not zero (e.g. trained through a tied head)
        emb.cores[0].add_(0.1)
    assert emb(only_pad).abs().max() > 0.01
    back = emb.to_dense_module()
    torch.testing.assert_close(back(ids), emb(ids))
    torch.testing.assert_close(back.weight, emb.weight())


def test_embedding_errors():
    emb = TTMEmbedding(TTMLayout.for_shape(50, 8, 2, ranks=2))
    with pytest.raises(IndexError, match="id 50 out of range"):
        emb(torch.tensor([1, 50]))
    with pytest.raises(IndexError, match="id -1"):
        emb(torch.tensor([-1]))
    with pytest.raises(TypeError, match="integer ids"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="max_norm"):
        TTMEmbedding.from_embedding(nn.Embedding(50, 8, max_norm=1.0))
    with pytest.raises(ValueError, match="expected last dim"):
        TTLinear(TTLayout.for_shape(8, 8, 2, ranks=2))(torch.randn(3, 9))


def test_layer_to_device_dtype_and_state_dict():
    tt = TTLinear.from_linear(nn.Linear(16, 24), rank=4, num_cores=2)
    tt2 = tt.to(torch.float64)
    assert all(c.dtype == f64 for c in tt2.cores)
    fresh = TTLinear(tt.layout, bias=True, dtype=f64)
    fresh.load_state_dict(tt2.state_dict())
    x = torch.randn(2, 16, dtype=f64)
    assert torch.equal(fresh(x), tt2(x))


def test_bfloat16_forward_runs():
    tt = TTLinear.from_linear(nn.Linear(16, 24), rank=4, num_cores=2).to(torch.bfloat16)
    y = tt(torch.randn(3, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


def test_autocast_bf16_forward_and_backward_keep_fp32_grads():
    """Under autocast the planned executor and the TTM lookup run in bf16 and
    their backward re-enters the same autocast state (fp32 master grads)."""
    tt = _randomize(TTLinear(TTLayout.for_shape(48, 96, 2, ranks=6)))
    emb = _randomize(TTMEmbedding(TTMLayout.for_shape(500, 32, 3, ranks=5)))
    x = torch.randn(64, 48)
    ids = torch.randint(0, 500, (200,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tt(x)
        e = emb(ids)
    assert y.dtype == torch.bfloat16 and e.dtype == torch.bfloat16
    (y.float().sum() + e.float().sum()).backward()
    for p in [*tt.cores, *tt.gates, *emb.cores]:
        assert p.grad is not None and p.grad.dtype == torch.float32
    ref_y = x @ tt.weight().t() + tt.bias
    assert torch.allclose(y.float(), ref_y, rtol=5e-2, atol=5e-2 * ref_y.abs().max().item())


@pytest.mark.parametrize("merge", [True, False])
def test_tied_head_training_paths_are_the_same_function(merge, monkeypatch):
    """With autograd the tied head contracts the network per row or multiplies by the table
    merged (differentiably) once per call, whichever costs fewer multiply-adds: same values,
    same gradients (float64 gradcheck of both)."""
    emb = _randomize(TTMEmbedding(TTMLayout.for_shape(40, 6, 2, ranks=3), dtype=f64))
    head = TTMTiedLinear(emb, bias=True).double()
    monkeypatch.setattr(TTMTiedLinear, "merges_at", lambda self, rows: merge)
    x = torch.randn(5, 6, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *p: head(x), (x, *emb.cores, *emb.gates, head.bias))
    assert torch.allclose(head(x), x @ emb.weight().t() + head.bias, atol=1e-10)


def test_tied_head_merges_the_table_past_a_few_rows():
    """A vocabulary-sized output: contracting per row costs many dense heads, so past a few
    rows the merged table is cheaper (the report counts what runs)."""
    from tncompile.runtime import tied_merge_macs
    emb = TTMEmbedding.from_embedding(nn.Embedding(5000, 64), rank=16)
    head = TTMTiedLinear(emb)
    assert not head.merges_at(1) and head.merges_at(512)
    assert tied_merge_macs(emb.layout, 512) < head.plan_for(512).fwd_flops


@pytest.mark.parametrize("rank,bias", [(3, True), (40, False)])
def test_tt_linear_inference_multiplies_by_merged_factors_and_follows_updates(rank, bias):
    """No autograd: two thin merged factors (rank 3) or the whole matrix (rank 40: the factors
    would be larger), cached until a core or gate changes; the same function as the network."""
    tt = _randomize(TTLinear(TTLayout.for_shape(30, 20, 2, ranks=rank), bias=bias, dtype=f64))
    x = torch.randn(4, 7, 30, dtype=f64)
    trained = tt(x)                                             # the network (autograd on)
    with torch.no_grad():
        merged = tt(x)
        a, b = tt.inference_factors()
        assert (b is None) == (rank == 40) and tt.inference_factors()[0] is a      # cached
        torch.testing.assert_close(merged, trained.detach())
        tt.gates[0].mul_(0.5)                                   # a gate changes in place: merged again
        assert tt.inference_factors()[0] is not a
        torch.testing.assert_close(tt(x), F.linear(x, tt.weight(), tt.bias))
        a, b = tt.inference_factors()
        factor_macs = a.numel() + (b.numel() if b is not None else 0)
        merges = through_factors_at(tt, 28, (a, b))
        assert tt.inference_macs(28) == (28 * factor_macs if merges else tt.plan_for(28).fwd_flops)
        tt.merge_in_inference = False
        torch.testing.assert_close(tt(x), F.linear(x, tt.weight(), tt.bias))
        assert tt.inference_macs(28) == tt.plan_for(28).fwd_flops
    assert "_inference" in TTLinear.transient_state                                # never saved


def test_ttm_lookup_keeps_its_half_tables_in_inference_until_a_core_changes():
    emb = _randomize(TTMEmbedding(TTMLayout.for_shape(200, 12, 2, ranks=4), dtype=f64))
    ids = torch.tensor([[3, 199, 3], [0, 57, 120]])
    trained = emb(ids)                                           # merged afresh (autograd on)
    with torch.no_grad():
        torch.testing.assert_close(emb(ids), trained.detach())
        kept = emb.__dict__["_halves"][1][0]
        emb(ids)
        assert emb.__dict__["_halves"][1][0] is kept             # reused
        emb.cores[0].mul_(2.0)                                   # an optimizer step: merged again
        torch.testing.assert_close(emb(ids), emb.weight()[ids])
        assert emb.__dict__["_halves"][1][0] is not kept
    assert "_halves" in TTMEmbedding.transient_state


def test_tied_head_multiplies_by_the_merged_table_in_inference_and_follows_updates():
    """No autograd: the tied head uses its merged table (a dense head's cost), kept until a core
    changes; with autograd it computes the same values."""
    from tncompile.runtime import TTMEmbedding, TTMTiedLinear
    torch.manual_seed(0)
    emb = TTMEmbedding.from_embedding(nn.Embedding(500, 64).double(), rank=8)
    head = TTMTiedLinear(emb, bias=True)
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    trained = head(x)                                   # the contraction (autograd on)
    with torch.no_grad():
        merged = head(x)
        first = head.merged_weight_t()
        assert head.merged_weight_t() is first            # cached
        torch.testing.assert_close(merged, trained.detach())
        emb.cores[0].mul_(1.5)                          # an optimizer step changes a core in place
        assert head.merged_weight_t() is not first
        torch.testing.assert_close(head(x), F.linear(x, emb.weight(), head.bias))
    head.merge_in_inference = False
    with torch.no_grad():
        head(x)
    state = head.__dict__
    assert "_merged" in state and "_merged" in TTMTiedLinear.transient_state  # never saved


def test_tied_head_half_tables_are_the_table_at_every_split_and_follow_updates():
    """Over a few rows in inference the tied head multiplies through two half tables
    (``runtime.tied_head``) instead of the merged table: at every split, with a padded
    vocabulary (500 of 504 rows) and a padded dimension (11 of 12), and a bias, it is
    ``x @ E.T + b``; the halves are kept until a core changes, and never saved."""
    lay = TTMLayout(ranks=(4, 5), num_embeddings=500, embedding_dim=11, row_modes=(7, 8, 9),
                    col_modes=(2, 3, 2))
    emb = _randomize(TTMEmbedding(lay, dtype=f64))
    head = TTMTiedLinear(emb, bias=True).double()
    with torch.no_grad():
        head.bias.normal_()
        x = torch.randn(3, 11, dtype=f64)
        for split in (1, 2):
            torch.testing.assert_close(_half_table_rows(head, x, split), x @ emb.weight().t() + head.bias)
        kept = head.__dict__["_halves"][1][0]
        _half_table_rows(head, x, 2)
        assert head.__dict__["_halves"][1][0] is kept                       # reused
        emb.gates[1].mul_(0.5)                                               # a gate changes in place
        torch.testing.assert_close(_half_table_rows(head, x, 2), x @ emb.weight().t() + head.bias)
        assert head.__dict__["_halves"][1][0] is not kept
    assert "_halves" in TTMTiedLinear.transient_state


def test_tied_head_reads_half_tables_over_few_rows_and_the_merged_table_over_many(monkeypatch):
    """GPT-2's tied head at ratio 0.1's ranks: one decoding row through the half tables costs
    ~120M multiply-adds, reading the 50400 x 768 table costs more (``TABLE_READ_WEIGHT``);
    past ~10 rows the merged table wins. The forward takes whichever form is chosen and both
    give the table's product."""
    from tncompile import tuning
    from tncompile.runtime.ways.tied_head import best_split, half_product_macs
    gpt2 = TTMLayout(ranks=(112, 124, 64), num_embeddings=50257, embedding_dim=768,
                     row_modes=(14, 15, 15, 16), col_modes=(8, 6, 4, 4))
    assert half_product_macs(gpt2, 2, 1) == 210 * 124 * 16 * (48 + 240)
    assert best_split(gpt2, 1) == 2 and best_split(gpt2, 64) is None
    monkeypatch.setattr(tuning, "TABLE_READ_WEIGHT", 0.0)                    # a table read is free
    assert best_split(gpt2, 1) is None
    emb = _randomize(TTMEmbedding(TTMLayout.for_shape(3000, 24, 3, ranks=4), dtype=f64))
    head = TTMTiedLinear(emb).double()
    x = torch.randn(2, 5, 24, dtype=f64)
    for weight in (0.0, 1e6):                                                # merged, then halves
        monkeypatch.setattr(tuning, "TABLE_READ_WEIGHT", weight)
        assert (best_split(emb.layout, 10) is None) == (weight == 0.0)
        with torch.no_grad():
            torch.testing.assert_close(head(x), x @ emb.weight().t())
    assert "_halves" in head.__dict__ and "_merged" in head.__dict__


def test_a_compressed_layers_weight_answers_what_tools_read_and_refuses_dense_writes():
    """``layer.weight()`` is the dense matrix; ``weight.shape`` / ``dtype`` / ``device`` answer
    without making it (PEFT places adapters by them); ``weight.data`` does not exist, so code
    written for a dense weight fails instead of writing into a temporary copy."""
    from tncompile.runtime import TTLinear, TTMEmbedding
    torch.manual_seed(0)
    lin = TTLinear.from_linear(torch.nn.Linear(24, 40, dtype=torch.float64), rank=4, num_cores=2)
    emb = TTMEmbedding.from_embedding(torch.nn.Embedding(60, 16), rank=3)
    for layer, shape, dtype in ((lin, (40, 24), torch.float64), (emb, (60, 16), torch.float32)):
        w = layer.weight
        assert w.shape == torch.Size(shape) and w.dtype == dtype and w.device == torch.device("cpu")
        assert w().shape == torch.Size(shape) and "call it" in repr(w)
        with pytest.raises(AttributeError):
            w.data.add_(1.0)
    x = torch.randn(5, 24, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ lin.weight().t() + lin.bias)
