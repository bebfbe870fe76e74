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


@pytest.mark.parametrize("rows, bias", [(20, True), (3, False), (300, True)])
def test_planned_contraction_as_one_op(rows, bias):
    """tncompile::traced_contract: opcheck, and the same values and gradients as the layer."""
    from torch import nn

    from tncompile.runtime import TTLinear
    from tncompile.runtime.traced_contract import register, traced_contract
    from tncompile.runtime.tt_layers import _drop_boundary
    layer = TTLinear.from_linear(nn.Linear(48, 60, bias=bias).double(), rank=4)
    lay = layer.layout
    x = torch.randn(rows, 48, dtype=f64)
    h = F.pad(x, (0, lay.padded_in - 48)).reshape(rows, *lay.in_modes).requires_grad_()
    cores = [c.detach().requires_grad_() for c in _drop_boundary(layer.scaled_cores())]
    b = layer.bias.detach().requires_grad_() if bias else None
    key = register(layer.plan_for(rows))._traced_key
    torch.library.opcheck(torch.ops.tncompile.traced_contract.default, ([h, *cores], b, key))
    out = traced_contract([h, *cores], b, key)[0]
    torch.testing.assert_close(out.reshape(rows, -1)[:, :60], layer(x))
    # 300 rows: 14,400 inputs; fast mode checks the Jacobian along random directions (a full
    # numerical Jacobian took a minute on 2 cores)
    assert torch.autograd.gradcheck(lambda h, *c: traced_contract([h, *c], b, key)[0], (h, *cores),
                                    fast_mode=rows > 50)
