"""Native dropout (Philox masks): statistics, gradients, reproducibility, and the lower_dropout pass."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.runtime.ways import dropout as dropout_mod
from tncompile.runtime.fused.dropout import FastDropout, dropout
from tncompile.runtime.native import native_kernels
from tncompile.testing import small_encoder


@pytest.fixture
def spy(call_spy):
    """Shapes of the inputs of every native dropout call."""
    return call_spy(dropout_mod._NativeDropout, 1)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masks_have_dropouts_statistics(ops, p, dtype):
    n = 1 << 20
    x = torch.rand(n, dtype=dtype) + 0.5  # nonzero everywhere: zeros in y are drops
    y, mask = ops.dropout_forward(x, p, 12345)
    assert mask.dtype == torch.bool and y.dtype == dtype
    assert torch.equal(mask, y != 0)
    torch.testing.assert_close(y[mask], x[mask] / (1 - p))
    keep = mask.double()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma
    # neighbours, elements four apart (one Philox call) and 256 apart (one block) are uncorrelated
    centred = keep - keep.mean()
    for lag in (1, 4, 64, 256):
        corr = (centred[:-lag] * centred[lag:]).mean() / centred.square().mean()
        assert abs(corr.item()) < 5 / math.sqrt(n), lag
    # another seed gives another, uncorrelated mask
    other = ops.dropout_forward(x, p, 54321)[1].double() - (1 - p)
    assert abs(((other * centred).mean() / centred.square().mean()).item()) < 5 / math.sqrt(n)


def philox4x32_10(counter, key):
    """Reference Philox4x32-10 (Salmon et al., SC'11) on Python ints: four 32-bit
    counter words and two key words -> four random words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1, p0 & 0xFFFFFFFF
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c0, c1, c2, c3


def test_reference_philox_matches_random123_known_answers():
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masks_are_philox_words_against_the_threshold(ops, dtype):
    """Every element's keep bit is word j of counter b*64 + g (element b*256 + j*64 + g)
    compared with round(p 2^32): the vectorized generator, its float32 and
    float64 paths and the partial last block, bit for bit against the reference."""
    n, p, seed = 1000, 0.3, 0x0123456789ABCDEF
    key = (seed & 0xFFFFFFFF, seed >> 32)
    threshold = round(p * 2 ** 32)
    expected = []
    for e in range(n):
        block, j, g = e // 256, e % 256 // 64, e % 64
        counter = block * 64 + g
        word = philox4x32_10((counter & 0xFFFFFFFF, counter >> 32, 0, 0), key)[j]
        expected.append(word >= threshold)
    x = torch.rand(n, dtype=dtype) + 0.5
    y, mask = ops.dropout_forward(x, p, seed)
    assert mask.tolist() == expected
    torch.testing.assert_close(y, torch.where(mask, x / (1 - p), torch.zeros_like(x)))
    g = torch.randn(n, dtype=dtype)
    torch.testing.assert_close(ops.dropout_backward(g, mask, 1 / (1 - p)), g * mask / (1 - p))


def test_masks_repeat_per_seed_on_any_thread_count(ops):
    x = torch.randn(3, 1000, 37)  # not a multiple of the 256-element blocks
    y1, m1 = ops.dropout_forward(x, 0.3, 7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y2, m2 = ops.dropout_forward(x, 0.3, 7)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(m1, m2) and torch.equal(y1, y2)
    assert not torch.equal(m1, ops.dropout_forward(x, 0.3, 8)[1])


def test_kernel_rejects_bad_input(ops):
    with pytest.raises(RuntimeError, match=r"p must be in \[0, 1\)"):
        ops.dropout_forward(torch.randn(4), 1.0, 0)
    with pytest.raises(RuntimeError, match="float32 or float64 only"):
        ops.dropout_forward(torch.randn(4).half(), 0.1, 0)
    with pytest.raises(RuntimeError, match="bool mask of the same shape"):
        ops.dropout_backward(torch.randn(4), torch.ones(5, dtype=torch.bool), 1.0)


def test_dropout_gradient_and_gradcheck(ops, spy):
    x = torch.randn(40, 7, dtype=torch.float64, requires_grad=True)
    y = dropout(x, 0.4)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(dx, g * (y != 0) / 0.6)

    def seeded(inp):  # the same mask on every call, so finite differences see one function
        torch.manual_seed(0)
        return dropout(inp, 0.4)
    assert torch.autograd.gradcheck(seeded, (x,))
    assert spy


def test_manual_seed_repeats_and_noncontiguous_inputs(ops, spy):
    x = torch.randn(64, 48).t()  # a transposed view
    torch.manual_seed(3)
    a = dropout(x, 0.2)
    torch.manual_seed(3)
    b = dropout(x, 0.2)
    assert torch.equal(a, b) and a.shape == x.shape
    kept = a != 0
    torch.testing.assert_close(a[kept], x[kept] / 0.8)
    assert not torch.equal(dropout(x, 0.2), a)  # the generator moved on


def test_falls_back_to_torch_where_native_does_not_apply(ops, spy):
    x = torch.randn(100, 100)
    assert torch.equal(dropout(x, 0.3, training=False), x)
    assert torch.equal(dropout(x, 0.0), x)
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    with native_kernels(False):
        y = dropout(x, 0.3)
    assert ((y == 0) | torch.isclose(y, x / 0.7)).all()
    z = x.clone()
    dropout(z, 0.3, inplace=True)  # in place: PyTorch's kernel writes into z
    assert (z == 0).any()
    assert not spy
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout(x, 1.5)


def test_fast_dropout_module_keeps_dropouts_behaviour(ops, spy):
    src = nn.Dropout(0.25)
    src.eval()
    mod = FastDropout.from_dropout(src)
    assert isinstance(mod, nn.Dropout) and mod.p == 0.25 and not mod.training and not mod.inplace
    x = torch.randn(8, 16)
    assert torch.equal(mod(x), x) and not spy
    mod.train()
    y = mod(x)
    assert spy and ((y == 0) | torch.isclose(y, x / 0.75)).all()
    assert mod.state_dict() == {}


class _Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        h = F.dropout(self.a(x), 0.2, training=self.training)
        return torch.dropout(self.b(h), 0.1, train=self.training)


def test_pass_swaps_modules_and_functional_calls(ops, spy):
    model = small_encoder()
    compiled = tncompile.compile(model, target_ratio=0.3, example_inputs=(torch.randint(1, 1000, (2, 32)),))
    drops = [m for m in compiled.model.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(type(m) is FastDropout for m in drops)
    assert all(type(m) is nn.Dropout for m in model.modules() if isinstance(m, nn.Dropout))  # model untouched
    ids = torch.randint(1, 1000, (4, 32))
    compiled(ids)
    assert spy
    compiled.eval()
    plain = tncompile.compile(model, target_ratio=0.3, example_inputs=(torch.randint(1, 1000, (2, 32)),),
                              passes=tncompile.default_pipeline().remove("lower_dropout")).eval()
    plain.model.load_state_dict(compiled.model.state_dict())
    torch.testing.assert_close(compiled(ids), plain(ids))
    assert not any(type(m) is FastDropout for m in plain.model.modules())

    fn_model = tncompile.compile(_Functional(), target_ratio=0.5)   # functional: modules that follow the mode
    assert {n: (type(m), m.p) for n, m in fn_model.model.named_modules() if isinstance(m, nn.Dropout)} == \
        {"dropout_fn": (FastDropout, 0.2), "dropout_fn_1": (FastDropout, 0.1)}
    spy.clear()
    out = fn_model(torch.randn(3, 64))
    assert len(spy) == 2 and out.shape == (3, 64)
