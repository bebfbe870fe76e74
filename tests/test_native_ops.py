"""The native kernels as torch.library custom ops: fake kernels, autograd, opcheck, fake tensors."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tncompile.runtime.native import native_kernels, traced

f64 = torch.float64


def _args(name, dtype, bias=True, grad=True):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)
    if name == "thin_expand":
        return (r(37, 5), r(5, 70), r(70) if bias else None)
    if name == "thin_project":
        return (r(37, 300), r(300, 6))
    if name == "ffn":
        return (r(33, 4), r(4, 50), r(50) if bias else None, r(50, 3), "gelu")
    raise KeyError(name)


def _reference(name, *a):
    if name == "thin_expand":
        t, w, b = a
        return t @ w + (b if b is not None else 0)
    if name == "thin_project":
        return a[0] @ a[1]
    t, w1, b1, w2, act = a
    return F.gelu(t @ w1 + (b1 if b1 is not None else 0)) @ w2


CASES = [("thin_expand", True), ("thin_expand", False), ("thin_project", True), ("ffn", True),
         ("ffn", False)]


@pytest.mark.parametrize("name, bias", CASES)
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_opcheck_fake_kernel_and_autograd(name, bias, native):
    op = getattr(torch.ops.tncompile, f"traced_{name}").default
    with native_kernels(native):
        torch.library.opcheck(op, _args(name, torch.float32, bias))


@pytest.mark.parametrize("name, bias", CASES)
def test_matches_the_dense_reference_and_gradcheck(name, bias):
    fn = getattr(traced, name)
    args = _args(name, f64, bias)
    torch.testing.assert_close(fn(*args), _reference(name, *args))
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def call(*xs):
        it = iter(xs)
        return fn(*[next(it) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args])
    assert torch.autograd.gradcheck(call, tensors)


@pytest.mark.parametrize("name, bias", CASES)
def test_runs_on_fake_tensors(name, bias):
    args = _args(name, torch.float32, bias, grad=False)
    expected = _reference(name, *args)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = getattr(traced, name)(*fake)
    assert out.shape == expected.shape and out.dtype == expected.dtype


def _attention_args(dtype, mask=True, grad=True, keep_probs=True, empty_rows_zero=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, e, generator=g, dtype=dtype).requires_grad_(grad)
               for n, e in ((5, 4), (7, 4), (7, 6)))
    bias = torch.randn(2, 1, 5, 7, generator=g, dtype=dtype) if mask else None
    return (q, k, v, bias, 0.5, 0.25, torch.tensor(1234), keep_probs, empty_rows_zero)


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no-mask"])
def test_dropout_and_attention_ops_opcheck_and_equal_the_eager_kernels(ops, mask):
    """traced_dropout / traced_attention: opcheck, and the eager kernels' values for the same seed."""
    x = torch.randn(6, 33, requires_grad=True)
    torch.library.opcheck(torch.ops.tncompile.traced_dropout.default, (x, 0.3, torch.tensor(77)))
    y, keep = traced.dropout(x, 0.3, torch.tensor(77))
    eager_y, eager_keep = ops.dropout_forward(x.detach(), 0.3, 77)
    assert torch.equal(y, eager_y) and torch.equal(keep, eager_keep)
    args = _attention_args(torch.float32, mask)
    torch.library.opcheck(torch.ops.tncompile.traced_attention.default, args)
    q, k, v, bias, scale, p, seed, _, _ = args
    out, probs = traced.attention(*args)
    eager_out, eager_probs = ops.attention_forward(q.detach(), k.detach(), v.detach(), bias, scale, p, 1234, True,
                                                   False)
    assert torch.equal(out, eager_out) and torch.equal(probs, eager_probs) and out.stride() == eager_out.stride()
    no_probs = traced.attention(*args[:-2], False, False)
    assert torch.equal(no_probs[0], out) and no_probs[1].numel() == 0


def test_dropout_and_attention_ops_gradcheck(ops):
    """Gradients through the ops (float64) equal the written steps with the op's own masks."""
    x = torch.randn(4, 9, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: traced.dropout(t, 0.4, torch.tensor(5))[0], (x,))
    q, k, v, bias, scale, p, seed, keep_probs, _ = _attention_args(f64)
    assert torch.autograd.gradcheck(lambda a, b, c: traced.attention(a, b, c, bias, scale, p, seed, True, False)[0],
                                    (q, k, v))
    _, probs = traced.attention(q, k, v, bias, scale, p, seed, True, False)
    keep = ~torch.signbit(probs)  # the kernel's encoding: a dropped weight saved negated
    weights = torch.softmax(scale * q @ k.transpose(-2, -1) + bias, -1)
    torch.testing.assert_close(traced.attention(q, k, v, bias, scale, p, seed, True, False)[0],
                               (weights * keep / (1 - p)) @ v)


@pytest.mark.parametrize("name", ["dropout", "attention"])
def test_dropout_and_attention_ops_run_on_fake_tensors(name):
    args = (torch.randn(3, 8), 0.2, torch.tensor(3)) if name == "dropout" else _attention_args(torch.float32, grad=False)
    real = getattr(traced, name)(*args)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = getattr(traced, name)(*fake)
    for a, b in zip(out, real):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
