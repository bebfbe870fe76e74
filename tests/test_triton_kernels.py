"""tncompile's Triton kernels, checked against the dense matrix they stand for: compiled on a
GPU (``cuda`` marker), through Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, how
every CI run tests them without a GPU). Forward, gradients, float64 gradcheck, the custom
op's fake kernel and autograd registration (``torch.library.opcheck``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tncompile.runtime import TTLinear
from tncompile.runtime.triton import interpreting, runs_triton, thin_pair

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if request.param == "cpu" and not interpreting():
        pytest.skip("the CPU runs Triton through its interpreter: TRITON_INTERPRET=1 before Triton loads "
                    "(tests/conftest.py sets it where there is no GPU)")
    return torch.device(request.param)


def test_the_thin_pair_is_the_tt_linear_it_stands_for(device):
    """A TT linear's merged factors through the kernel: the layer's dense matrix and bias."""
    torch.manual_seed(0)
    layer = TTLinear.from_linear(torch.nn.Linear(48, 70), rank=6, num_cores=2).to(device)
    a, b = layer.merged_factors()                      # (padded_in, r), (r, padded_out)
    x = torch.randn(3, 33, 48, device=device)
    assert runs_triton(x)
    padded = F.pad(x, (0, a.shape[0] - 48))
    with torch.no_grad():
        got = thin_pair(padded, a, b, None)[..., :70] + layer.bias
        want = x @ layer.weight().t() + layer.bias
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float64, 1e-10), (torch.bfloat16, 5e-2)])
def test_forward_and_gradients_match_the_dense_product(device, dtype, tol):
    torch.manual_seed(1)
    x = torch.randn(2, 41, 50, device=device, dtype=dtype, requires_grad=True)
    a = torch.randn(50, 7, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(7, 45, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(45, device=device, dtype=dtype, requires_grad=True)
    y = thin_pair(x, a, b, bias)
    ref = (x.double() @ (a.double() @ b.double()) + bias.double())
    scale = ref.abs().max()
    torch.testing.assert_close(y.double() / scale, ref / scale, rtol=tol, atol=tol)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, a, b, bias), dy)
    want = torch.autograd.grad(ref, (x, a, b, bias), dy.double())
    for g, w, name in zip(got, want, ("x", "a", "b", "bias")):
        s = w.abs().max()
        torch.testing.assert_close(g.double() / s, w.double() / s, rtol=tol, atol=tol, msg=name)


def test_float64_gradcheck_and_the_custom_op_registration(device):
    torch.manual_seed(2)
    args = [torch.randn(*s, device=device, dtype=torch.float64, requires_grad=True)
            for s in ((5, 20), (20, 3), (3, 17), (17,))]
    assert torch.autograd.gradcheck(thin_pair, tuple(args))
    assert torch.autograd.gradcheck(lambda x, a, b: thin_pair(x, a, b, None), tuple(args[:3]))
    torch.library.opcheck(thin_pair, tuple(args))


def test_shapes_at_the_edges(device):
    """No rows, one row, ranks and widths that are not block multiples, strided inputs."""
    torch.manual_seed(3)
    a, b = torch.randn(33, 1, device=device), torch.randn(1, 5, device=device)
    assert thin_pair(torch.randn(0, 33, device=device), a, b, None).shape == (0, 5)
    x = torch.randn(1, 33, device=device)
    torch.testing.assert_close(thin_pair(x, a, b, None), x @ a @ b, rtol=1e-5, atol=1e-5)
    wide = torch.randn(70, 40, device=device)
    x = torch.randn(9, 70, device=device)
    strided_a, strided_b = wide.t().contiguous().t(), torch.randn(5, 40, device=device).t()  # (70, 40), (40, 5)
    assert not strided_b.is_contiguous()
    torch.testing.assert_close(thin_pair(x, strided_a, strided_b, None), x @ strided_a @ strided_b,
                               rtol=1e-4, atol=1e-4)
