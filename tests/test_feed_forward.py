"""Fused TT feed-forward blocks: the native kernel, tt_feed_forward and the fuse_feed_forward pass."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.formats import TTLayout
from tncompile import tuning
from tncompile.runtime import TTLinear
from tncompile.runtime.ways import feed_forward
from tncompile.runtime.fused.feed_forward import ACTIVATIONS, tt_feed_forward, uses_fused_kernel


@pytest.fixture(autouse=True)
def prior_only():
    """These tests check the fused kernel itself: the cost rule decides where it runs, not
    a timing (the measured choice between it and the layers: test_measured_blocks.py)."""
    with tuning.override(MEASURE_WAYS=False):
        yield
from tncompile.runtime.native import native_kernels
from tncompile.testing import small_encoder

f64 = torch.float64


@pytest.fixture
def fuse_small(monkeypatch):
    """Fuse from 1 row on, so that small shapes take the fused path."""
    monkeypatch.setattr(tuning, "FUSE_MIN_ROWS", 1)
    monkeypatch.setattr(tuning, "FUSE_FLOP_SLACK", 1e9)


@pytest.fixture
def spy(call_spy):
    """Shapes of the inputs of every fused autograd Function call."""
    return call_spy(feed_forward._FusedFeedForward, 2)


def _tt(fin, fout, rank, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = TTLayout.for_shape(fin, fout, 2).with_ranks(rank)
    tt = TTLinear.from_linear(nn.Linear(fin, fout, bias=bias).to(dtype), layout=lay, rank=None,
                              init="random", generator=g)
    with torch.no_grad():  # non-trivial gates and bias: both must reach the fused kernel
        for gate in tt.gates:
            gate.uniform_(0.5, 1.5, generator=g)
        if bias:
            tt.bias.normal_(generator=g)
    return tt


# (rows, r1, F, r2): rows off and on the kernel's 96-row chunks, F over its 512-unit tiles, ranks off the 8-column padding
@pytest.mark.parametrize("M, K1, F_, K2", [(50, 5, 40, 3), (24, 8, 33, 16), (7, 13, 70, 9), (0, 4, 16, 4),
                                           (200, 6, 1100, 5)])  # several row chunks and hidden-unit tiles
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_kernel_matches_torch(ops, M, K1, F_, K2, activation, dtype):
    g = torch.Generator().manual_seed(M + K1)
    t = torch.randn(M, K1, generator=g, dtype=dtype, requires_grad=True)
    w1 = torch.randn(K1, F_, generator=g, dtype=dtype, requires_grad=True)
    b1 = torch.randn(F_, generator=g, dtype=dtype, requires_grad=True)
    w2 = torch.randn(F_, K2, generator=g, dtype=dtype, requires_grad=True)
    ref = ACTIVATIONS[activation](t @ w1 + b1) @ w2
    du = torch.randn(M, K2, generator=g, dtype=dtype)
    grads = torch.autograd.grad(ref, (t, w1, b1, w2), du)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(ops.ffn_forward(t, w1, b1, w2, activation), ref, **tol)
    got = ops.ffn_backward(du, t, w1, b1, w2, activation, True, True, True, True)
    for a, b in zip(got, grads):
        torch.testing.assert_close(a, b, **tol)
    # one gradient at a time, and no bias
    ref_nb = ACTIVATIONS[activation](t @ w1) @ w2
    d_w2 = torch.autograd.grad(ref_nb, w2, du)[0]
    only = ops.ffn_backward(du, t, w1, None, w2, activation, False, False, False, True)
    assert only[0] is None and only[1] is None and only[2] is None
    torch.testing.assert_close(only[3], d_w2, **tol)


def test_kernel_gelu_is_exact_gelu_to_float_precision(ops):
    """The float32 GELU and its derivative inside the kernel (vector_math.h) against
    float64 F.gelu over [-12, 12], near 0, the chunk tails and special values: one
    hidden unit (r1 = F = r2 = 1, W1 = W2 = 1) makes the kernel's output gelu(t) and
    its dt gelu'(t) du. (PyTorch's own float32 GELU is off by up to 8.9e-7 here.)"""
    x = torch.cat([torch.linspace(-12, 12, 20011), torch.linspace(-0.01, 0.01, 2001),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0])])[:, None]
    x64 = x.double().requires_grad_()
    one = torch.ones(1, 1)
    ref = F.gelu(x64)
    du = torch.randn_like(x)
    (dx,) = torch.autograd.grad(ref, x64, du.double())
    tol = {"rtol": 2e-6, "atol": 6e-7}
    torch.testing.assert_close(ops.ffn_forward(x, one, None, one, "gelu"), ref.float(), **tol)
    got = ops.ffn_backward(du, x, one, None, one, "gelu", True, False, False, False)[0]
    torch.testing.assert_close(got, dx.float(), **tol)
    special = ops.ffn_forward(torch.tensor([[float("inf")], [float("nan")], [3e38]]), one, None, one, "gelu")
    assert special[0].item() == float("inf") and special[1].isnan().all() and special[2].item() == torch.tensor(3e38).item()


def test_kernel_rejects_bad_input(ops):
    t, w1, w2 = torch.randn(4, 3), torch.randn(3, 8), torch.randn(8, 2)
    with pytest.raises(RuntimeError, match="unknown activation 'swish'"):
        ops.ffn_forward(t, w1, None, w2, "swish")
    with pytest.raises(RuntimeError, match=r"need t \(M x r1\), W1 \(r1 x F\), W2 \(F x r2\)"):
        ops.ffn_forward(t, w1, None, torch.randn(7, 2), "gelu")
    with pytest.raises(RuntimeError, match="b1 must have F = 8"):
        ops.ffn_forward(t, w1, torch.randn(5), w2, "gelu")
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.ffn_forward(t, w1.double(), None, w2, "gelu")
    with pytest.raises(RuntimeError, match="du must be"):
        ops.ffn_backward(torch.randn(4, 3), t, w1, None, w2, "gelu", True, True, True, True)


def test_merged_factors_multiply_to_the_weight():
    tt = _tt(30, 70, 5, dtype=f64)  # both dims padded to their modes
    a, b = tt.merged_factors()
    assert a.shape[1] == b.shape[0] == tt.layout.ranks[0]
    torch.testing.assert_close((a @ b)[:30, :70], tt.weight().t())


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(9,), (2, 5)])
def test_fused_block_equals_layers_in_sequence(ops, fuse_small, spy, activation, bias, lead):
    first, second = _tt(30, 70, 4, f64, bias, seed=1), _tt(70, 20, 5, f64, bias, seed=2)
    x = torch.randn(*lead, 30, dtype=f64, requires_grad=True)
    ref = second(ACTIVATIONS[activation](first(x)))
    params = [x, *first.parameters(), *second.parameters()]
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, params, g)
    got_y = tt_feed_forward(x, first, second, activation)
    assert spy and got_y.shape == ref.shape
    torch.testing.assert_close(got_y, ref)
    for a, b in zip(torch.autograd.grad(got_y, params, g), want):
        torch.testing.assert_close(a, b)
    # and against the dense matrices the networks stand for
    dense = F.linear(ACTIVATIONS[activation](F.linear(x, first.weight(), first.bias)), second.weight(), second.bias)
    torch.testing.assert_close(got_y, dense)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_fused_function_gradcheck(ops, activation):
    g = torch.Generator().manual_seed(3)
    shapes = [(7, 12), (12, 3), (3, 18), (18,), (18, 2), (2, 8), (8,)]  # x, A1, B1, b1, A2, B2, b2
    args = [torch.randn(*s, generator=g, dtype=f64, requires_grad=True) for s in shapes]
    if activation == "relu":  # keep pre-activations away from the kink, where finite differences break
        with torch.no_grad():
            args[3].add_(torch.sign(args[3]) * 3)

    def block(*a):
        return feed_forward._FusedFeedForward.apply(ops, activation, *a)
    assert torch.autograd.gradcheck(block, tuple(args))


def test_falls_back_where_the_kernel_does_not_apply(ops, spy):
    first, second = _tt(30, 70, 4, seed=5), _tt(70, 20, 5, seed=6)
    few = torch.randn(3, 30)
    torch.testing.assert_close(tt_feed_forward(few, first, second, "relu"), second(F.relu(first(few))))
    assert not spy  # 3 rows: below tuning.FUSE_MIN_ROWS
    many = torch.randn(tuning.FUSE_MIN_ROWS, 30)
    with native_kernels(False):
        assert uses_fused_kernel(many, first, second) is None
        torch.testing.assert_close(tt_feed_forward(many, first, second, "relu"), second(F.relu(first(many))))
    assert not spy
    dense1, dense2 = nn.Linear(30, 70), nn.Linear(70, 20)  # e.g. after to_dense(): plain modules run in sequence
    torch.testing.assert_close(tt_feed_forward(many, dense1, dense2, "gelu"), dense2(F.gelu(dense1(many))))
    assert not spy
    assert uses_fused_kernel(many, first, second) is not None
    tt_feed_forward(many, first, second, "relu")
    assert spy
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        tt_feed_forward(many, first, second, "tanh")


def test_layers_with_forward_hooks_run_their_own_forward(ops, fuse_small, spy):
    """A hook on either layer (a user's activation hook, an FSDP2 unit's gather/free)
    sees the layer's true input and output: the block runs unfused."""
    first, second = _tt(30, 70, 4, seed=7), _tt(70, 20, 5, seed=8)
    x = torch.randn(12, 30)
    want = second(F.gelu(first(x)))
    seen = []
    for hook_on, kind in [(first, "forward"), (second, "pre"), (first, "global")]:
        spy.clear()
        if kind == "forward":
            handle = hook_on.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
        elif kind == "pre":
            handle = hook_on.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
        else:
            handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: seen.append(m is hook_on))
        torch.testing.assert_close(tt_feed_forward(x, first, second, "gelu"), want)
        handle.remove()
        assert not spy, f"fused past a {kind} hook"
    assert seen[:2] == [(12, 70), (12, 70)] and True in seen[2:]
    tt_feed_forward(x, first, second, "gelu")
    assert spy  # hooks removed: fused again


def test_flop_guard_skips_blocks_where_merging_costs_more(ops, monkeypatch):
    first, second = _tt(30, 70, 4, seed=7), _tt(70, 20, 5, seed=8)
    x = torch.randn(tuning.FUSE_MIN_ROWS, 30)
    monkeypatch.setattr(tuning, "FUSE_FLOP_SLACK", 1e-6)
    assert uses_fused_kernel(x, first, second) is None
    second.__dict__.pop("_fused_choice")
    monkeypatch.setattr(tuning, "FUSE_FLOP_SLACK", 1e9)
    assert uses_fused_kernel(x, first, second) is not None


class _Block(nn.Module):
    def __init__(self, act: nn.Module | None = None, tap: bool = False):
        super().__init__()
        self.up, self.down, self.act, self.tap = nn.Linear(64, 256), nn.Linear(256, 64), act, tap

    def forward(self, x):
        h = self.up(x)
        a = self.act(h) if self.act is not None else F.gelu(h, approximate="tanh")
        y = self.down(a)
        return y + h.mean(-1, keepdim=True) if self.tap else y  # tap: h has a second user


@pytest.mark.parametrize("act, name", [(None, "gelu_tanh"), (nn.GELU(), "gelu"), (nn.ReLU(), "relu")])
def test_pass_fuses_the_pattern_and_keeps_outputs(act, name):
    model = _Block(act)
    x = torch.randn(3, 64)
    fused = tncompile.compile(model, target_ratio=0.3)
    plain = tncompile.compile(model, target_ratio=0.3, passes=tncompile.default_pipeline().remove("fuse_feed_forward"))
    calls = [n for n in fused.program.graph.nodes if n.target is tt_feed_forward]
    assert len(calls) == 1 and calls[0].args[3] == name
    assert not any(n.op == "call_module" for n in fused.program.graph.nodes)  # up, act, down all folded in
    assert set(fused.tensorized_modules()) == {"up", "down"}
    torch.testing.assert_close(fused(x), plain(x))
    text = fused.program.dump()
    assert "= layer up  # TT" in text and "tt_feed_forward(%x, %up_1, %down_1, " in text
    torch.testing.assert_close(fused.to_dense()(x), plain.to_dense()(x))


def test_pass_leaves_shared_intermediates_alone():
    compiled = tncompile.compile(_Block(tap=True), target_ratio=0.3)
    assert not any(n.target is tt_feed_forward for n in compiled.program.graph.nodes)


def test_fused_encoder_trains_saves_and_loads(ops, trains_like, reloads_with):
    model = small_encoder(d_model=64, d_ff=256, max_len=64).eval()
    ids = torch.randint(1, 1000, (8, 64))  # 512 rows per linear: the fused kernel runs
    compiled = tncompile.compile(model, target_ratio=0.2, example_inputs=(ids[:2],))
    plain = tncompile.compile(model, target_ratio=0.2, example_inputs=(ids[:2],),
                              passes=tncompile.default_pipeline().remove("fuse_feed_forward"))
    plain.model.load_state_dict(compiled.model.state_dict())
    assert sum(n.target is tt_feed_forward for n in compiled.program.graph.nodes) == 2
    ff1, ff2 = compiled.model.get_submodule("layers.0.ff1"), compiled.model.get_submodule("layers.0.ff2")
    assert uses_fused_kernel(torch.empty(512, 64), ff1, ff2) is not None
    trains_like(compiled, plain, ids)
    reloads_with(compiled, ids, tt_feed_forward, 2, small_encoder(d_model=64, d_ff=256, max_len=64).eval())
