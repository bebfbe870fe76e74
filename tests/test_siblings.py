"""fuse_siblings / tt_siblings: TT linears sharing an input, through one pass over it."""
import pytest
import torch
from torch import nn

import tncompile
from tncompile import tuning
from tncompile.formats import TTLayout
from tncompile.runtime import TTLinear
from tncompile.runtime.ways import siblings
from tncompile.runtime.fused.siblings import sibling_kernels, tt_siblings
from tncompile.testing import small_encoder

f64 = torch.float64


@pytest.fixture(autouse=True)
def prior_only():
    """These tests check the fused kernel itself: the cost rule decides where it runs, not
    a timing (the measured choice between it and the layers: test_measured_blocks.py)."""
    with tuning.override(MEASURE_WAYS=False):
        yield


@pytest.fixture
def spy(call_spy):
    """Input shapes of every one-pass sibling call."""
    return call_spy(siblings._SiblingLinears, 2)


def tt_layer(fin, fout, rank, bias=True, dtype=f64, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = TTLinear.from_linear(nn.Linear(fin, fout, bias=bias), layout=TTLayout.for_shape(fin, fout, 2).with_ranks(rank),
                                 rank=None, init="random").to(dtype)
    with torch.no_grad():  # random everything (default init gives zero gate gradients)
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    return layer


def params(layers):
    return [p for m in layers for p in m.parameters()]


def test_one_pass_equals_each_layer_forward_and_gradients(ops, spy):
    layers = [tt_layer(48, 48, 5, seed=1), tt_layer(48, 40, 3, bias=False, seed=2), tt_layer(48, 96, 7, seed=3)]
    x = torch.randn(4, 80, 48, dtype=f64, requires_grad=True)  # 320 rows: from FUSE_MIN_ROWS on
    outs = tt_siblings(x, layers)
    ref = [m(x) for m in layers]
    assert spy == [(320, 48)] and [o.shape for o in outs] == [r.shape for r in ref]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o, r)
    grads = [torch.randn_like(r) for r in ref]
    grads[1] = None  # one output unused: its layer gets no gradient from it
    used = [(o, g) for o, g in zip(outs, grads) if g is not None]
    used_ref = [(r, g) for r, g in zip(ref, grads) if g is not None]
    got = torch.autograd.grad([o for o, _ in used], [x, *params(layers)], [g for _, g in used], allow_unused=True)
    want = torch.autograd.grad([r for r, _ in used_ref], [x, *params(layers)], [g for _, g in used_ref],
                               allow_unused=True)
    for a, b in zip(got, want):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b)


def test_gradcheck_through_input_cores_gates_and_biases(ops, monkeypatch):
    monkeypatch.setattr(tuning, "FUSE_MIN_ROWS", 4)
    layers = [tt_layer(8, 8, 2, seed=4), tt_layer(8, 12, 3, seed=5)]
    x = torch.randn(6, 8, dtype=f64, requires_grad=True)
    assert sibling_kernels(x, layers) is not None
    # gradcheck perturbs its inputs in place: passing the parameters themselves checks their gradients
    assert torch.autograd.gradcheck(lambda x, *ps: tt_siblings(x, layers), (x, *params(layers)))


def test_falls_back_to_each_layer_where_it_does_not_apply(ops, spy):
    layers = [tt_layer(48, 48, 5, dtype=torch.float32, seed=6), tt_layer(48, 48, 5, dtype=torch.float32, seed=7)]
    few = torch.randn(10, 48)                         # under FUSE_MIN_ROWS rows
    for o, m in zip(tt_siblings(few, layers), layers):
        torch.testing.assert_close(o, m(few))
    hooked = []
    handle = layers[1].register_forward_hook(lambda mod, inp, out: hooked.append(out.shape))
    many = torch.randn(300, 48)
    tt_siblings(many, layers)                         # a hooked layer runs its own forward (and its hook)
    handle.remove()
    assert hooked == [(300, 48)] and spy == []
    assert sibling_kernels(many, [layers[0], nn.Linear(48, 48)]) is None
    assert sibling_kernels(many.double(), layers) is None  # dtype differs from the cores'


def test_pass_groups_query_key_value_and_keeps_parameter_names(ops, spy, trains_like, reloads_with):
    model = small_encoder(d_model=64, d_ff=256, max_len=64).eval()
    ids = torch.randint(1, 1000, (8, 64))  # 512 rows per linear
    compiled = tncompile.compile(model, target_ratio=0.2, example_inputs=(ids[:2],))
    plain = tncompile.compile(model, target_ratio=0.2, example_inputs=(ids[:2],),
                              passes=tncompile.default_pipeline().remove("fuse_siblings"))
    assert list(compiled.model.state_dict()) == list(plain.model.state_dict())
    plain.model.load_state_dict(compiled.model.state_dict())
    counts = next(r.matches for r in compiled.program.history if r.name == "fuse_siblings")
    assert counts == {"siblings": 2}                   # q, k, v of each of the two layers
    assert "tt_siblings(" in compiled.program.dump()
    trains_like(compiled, plain, ids)
    assert len(spy) == 4                               # two layers, two forwards: one pass over x each
    reloads_with(compiled, ids, tt_siblings, 2, small_encoder(d_model=64, d_ff=256, max_len=64).eval())


def test_graph_functions_survive_pickling(ops):
    """fx pickles a graph module as its source and traces it again on load: the
    rewrites' functions (``tt_siblings``, ``tt_feed_forward``) stay one call each."""
    import pickle
    from tncompile.runtime.fused.feed_forward import tt_feed_forward
    model = small_encoder(d_model=64, d_ff=256, max_len=64).eval()
    ids = torch.randint(1, 1000, (2, 16))
    compiled = tncompile.compile(model, target_ratio=0.2, example_inputs=(ids,))
    back = pickle.loads(pickle.dumps(compiled))
    targets = [n.target for n in back.program.graph.nodes]
    assert targets.count(tt_siblings) == 2 and targets.count(tt_feed_forward) == 2
    assert back.program.graph_module is back.model
    assert torch.equal(back(ids), compiled(ids))
