"""The native CPU attention kernel (attention.cpp): against the written steps, its dropout
against the reference Philox, gradients (float64 gradcheck), and where FusedAttention uses it."""
import math

import pytest
import torch
from torch import nn

from test_dropout import philox4x32_10
from tncompile.runtime.ways import attention as attention_kernel
from tncompile.runtime.fused.attention import FusedAttention
from tncompile.runtime.ways.attention import native_attention
from tncompile.runtime.fused.dropout import FastDropout
from tncompile.runtime.ways.dropout import _seed

f64 = torch.float64


@pytest.fixture
def spy(call_spy):
    """Shapes of q of every native attention call."""
    return call_spy(attention_kernel._NativeAttention, 1)


def written(q, k, v, mask, scale, keep=None):
    """The steps as a model writes them; ``keep`` (0 or 1/(1-p) per weight) is the dropout."""
    s = scale * q @ k.transpose(-2, -1)
    if mask is not None:
        s = s + mask
    w = s.softmax(-1)
    return (w * keep if keep is not None else w) @ v


def head_views(batch, heads, length, width, dtype=f64):
    """q, k, v as a model's projections give them: (B, L, H, E) memory seen as (B, H, L, E)."""
    qkv = torch.randn(batch, length, 3, heads, width, dtype=dtype)
    return [t.requires_grad_() for t in qkv.permute(2, 0, 3, 1, 4).unbind(0)]


@pytest.mark.parametrize("mask_shape", [None, (2, 1, 1, 9), (1, 1, 7, 9), (2, 3, 7, 9), (7, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_no_dropout_equals_the_written_steps_forward_and_backward(ops, spy, mask_shape, dtype):
    q = torch.randn(2, 7, 3, 5, dtype=dtype).transpose(1, 2).requires_grad_()   # L = 7, strided
    k = torch.randn(2, 3, 9, 5, dtype=dtype, requires_grad=True)                 # S = 9, contiguous
    v = torch.randn(2, 9, 3, 4, dtype=dtype).transpose(1, 2).requires_grad_()   # F = 4
    mask = None if mask_shape is None else torch.randn(mask_shape, dtype=dtype)
    out = native_attention(q, k, v, mask, 0.4, 0.0)
    expected = written(q, k, v, mask, 0.4)
    tol = {} if dtype == f64 else {"atol": 1e-5, "rtol": 1e-4}
    torch.testing.assert_close(out, expected, **tol)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), g),
                               torch.autograd.grad(expected, (q, k, v), g), **tol)
    assert spy == [q.shape]


def test_masked_out_keys_get_no_weight_and_fully_masked_rows_are_nan_as_in_pytorch(ops):
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=f64) for _ in range(3))
    mask = torch.zeros(4, 4, dtype=f64)
    mask[:, 1] = float("-inf")
    out = native_attention(q, k, v, mask, 1.0, 0.0)
    torch.testing.assert_close(out, written(q, k, v, mask, 1.0))
    mask[2] = float("-inf")
    out = native_attention(q, k, v, mask, 1.0, 0.0)
    assert out[:, :, 2].isnan().all() and written(q, k, v, mask, 1.0)[:, :, 2].isnan().all()
    assert not out[:, :, [0, 1, 3]].isnan().any()


@pytest.mark.parametrize("keys", [10, 64])  # words gathered across a padded group / read in place
def test_dropout_mask_is_the_reference_philox_bit_for_bit(ops, keys):
    """Uniform weights (q = k = 0) times the identity show the dropped weights: element j of row
    r = (b H + h) L + i is kept when word j // G of counter r G + j % G (G = ceil(S / 4)) is at
    least round(p 2^32), under the seed drawn from PyTorch's generator."""
    B, H, L, S, p = 2, 3, 5, keys, 0.3
    q, k = torch.zeros(B, H, L, 4, dtype=f64), torch.zeros(B, H, S, 4, dtype=f64)
    v = torch.eye(S, dtype=f64).expand(B, H, S, S)
    torch.manual_seed(11)
    seed = _seed()
    torch.manual_seed(11)
    out = native_attention(q, k, v, None, 1.0, p)
    key, G, threshold = (seed & 0xFFFFFFFF, seed >> 32), (S + 3) // 4, round(p * 2 ** 32)
    keep = torch.tensor([[philox4x32_10(((r * G + j % G) & 0xFFFFFFFF, (r * G + j % G) >> 32, 0, 0), key)[j // G]
                          >= threshold for j in range(S)] for r in range(B * H * L)]).reshape(B, H, L, S)
    torch.testing.assert_close(out, keep.to(f64) / (S * (1 - p)), rtol=1e-12, atol=0)


def test_dropout_statistics_gradcheck_and_seeding(ops):
    B, H, S, p = 4, 8, 64, 0.3
    q = k = torch.zeros(B, H, S, 16)
    v = torch.eye(S).expand(B, H, S, S)
    torch.manual_seed(0)
    first = native_attention(q, k, v, None, 1.0, p)
    zeros = float((first == 0).double().mean())
    n = first.numel()
    assert abs(zeros - p) < 5 * math.sqrt(p * (1 - p) / n)
    torch.testing.assert_close(first[first != 0], torch.full_like(first[first != 0], 1 / (S * (1 - p))))
    torch.manual_seed(0)
    assert torch.equal(native_attention(q, k, v, None, 1.0, p), first)          # manual_seed repeats it
    assert not torch.equal(native_attention(q, k, v, None, 1.0, p), first)      # the next call draws anew

    qg, kg, vg = head_views(1, 2, 6, 3)
    mask = torch.randn(1, 1, 1, 6, dtype=f64)

    def seeded(q, k, v):  # one mask for every call, so finite differences see one function
        torch.manual_seed(3)
        return native_attention(q, k, v, mask, 0.7, 0.4)
    assert torch.autograd.gradcheck(seeded, (qg, kg, vg))


def test_fused_attention_runs_the_kernel_in_training_with_the_lowered_dropout(ops, spy):
    q, k, v = head_views(2, 3, 8, 4, torch.float32)
    mask = torch.zeros(2, 1, 1, 8)
    fused = FusedAttention("div", FastDropout(0.2))
    out = fused(q, k, v, mask, 2.0)
    assert spy == [q.shape] and out.shape == (2, 3, 8, 4)
    out.sum().backward()
    assert all(t.grad is not None for t in (q, k, v))
    fused.eval()                                        # eval: no dropout, PyTorch's fused kernel
    torch.testing.assert_close(fused(q, k, v, mask, 2.0), written(q, k, v, mask, 0.5))
    torch_dropout = FusedAttention("div", nn.Dropout(0.2))   # PyTorch's dropout kept: the written steps
    torch_dropout(q, k, v, mask, 2.0)
    assert len(spy) == 1


def test_inputs_it_does_not_take_return_none(ops):
    q, k, v = (torch.randn(2, 3, 4, 5) for _ in range(3))
    assert native_attention(q.half(), k.half(), v.half(), None, 1.0, 0.1) is None
    assert native_attention(q, k, v, torch.zeros(4, 4, requires_grad=True), 1.0, 0.1) is None  # mask with grad
    assert native_attention(q, k, v, torch.zeros(3, 4, 4, 4), 1.0, 0.1) is None  # would broadcast the scores up
    assert native_attention(q[None], k[None], v[None], None, 1.0, 0.1) is None  # 5-D
    three = native_attention(q[0], k[0], v[0], None, 1.0, 0.0)                      # (B, L, E): one head
    torch.testing.assert_close(three, written(q[0], k[0], v[0], None, 1.0), atol=1e-5, rtol=1e-4)


class _WithMultiheadAttention(nn.Module):
    """nn.MultiheadAttention inside an fx-traceable model: the frontend's SelfAttention."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.mha = nn.MultiheadAttention(64, 4, dropout=0.2, batch_first=True)
        self.out = nn.Linear(64, 4)

    def forward(self, x, pad):
        h = self.inp(x)
        return self.out(self.mha(h, h, h, key_padding_mask=pad, need_weights=False)[0])


def test_lowered_multihead_attention_runs_the_kernel_in_training_only(ops, spy):
    import tncompile
    from tncompile.runtime.fused.attention import SelfAttention
    torch.manual_seed(0)
    x, pad = torch.randn(4, 16, 32), torch.zeros(4, 16, dtype=torch.bool)
    pad[:, 12:] = True
    compiled = tncompile.compile(_WithMultiheadAttention(), target_ratio=0.6, mode="graph", example_inputs=(x, pad))
    matches = next(r.matches for r in compiled.program.history if r.name == "lower_dropout")
    assert matches["attention-dropout"] == 1
    attend = [m for m in compiled.modules() if isinstance(m, SelfAttention)]
    assert len(attend) == 1 and attend[0].native_dropout and "native_dropout=True" in repr(attend[0])
    compiled.train()
    compiled(x, pad).sum().backward()
    assert spy == [(4, 4, 16, 16)]
    full = pad.clone()
    full[0] = True                               # a sequence of padding only: the kernel too, zeros as PyTorch's
    assert not compiled(x, full).isnan().any() and len(spy) == 2
    compiled.eval()
    compiled(x, pad)
    assert len(spy) == 2
    kept = tncompile.compile(_WithMultiheadAttention(), target_ratio=0.6, mode="graph", example_inputs=(x, pad),
                             passes=tncompile.default_pipeline().remove("lower_dropout"))
    assert not [m for m in kept.modules() if isinstance(m, SelfAttention)][0].native_dropout
    kept.train()(x, pad)
    assert len(spy) == 2                         # the pass removed: PyTorch's attention, no kernel call
