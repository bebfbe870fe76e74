"""Issue 55, bf16 done right: under autocast a compressed layer merges its cores in fp32
(small products, exact) and casts only the merged factors, once per batch of layers
(:class:`~tncompile.runtime.kernels.factor_batch.BatchedFactors`) or per peerless layer
(:func:`~tncompile.runtime.ways.linear.own_factors`); its rows go through bf16 GEMMs. A
training step of a compressed model then launches no more cast kernels than its dense
original (it cast 20 more for four layers before: each core at each product of the merge,
forward and backward)."""
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tncompile
from tncompile import tuning
from tncompile.runtime import TTLinear
from tncompile.runtime.ways.linear import LinearWay


class _Casts(TorchDispatchMode):
    """Counts ``aten._to_copy`` (every dtype cast autocast or a layer makes)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def _step(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().square().mean().backward()
    return y


def _casts_per_step(model, x) -> int:
    for _ in range(2):   # warm: merges planned, batches made
        _step(model, x)
    model.zero_grad(set_to_none=True)
    counter = _Casts()
    with counter:
        _step(model, x)
    return counter.count


@pytest.fixture
def mlp():
    """Three layers of one layout (one batch) and a fourth of its own (merged alone)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256),
                         nn.ReLU(), nn.Linear(256, 128))


@pytest.mark.parametrize("whole", [False, True], ids=["thin-pairs", "whole-matrices-allowed"])
def test_a_compressed_step_casts_no_more_than_its_dense_one(mlp, whole):
    x = torch.randn(512, 256)
    with warnings.catch_warnings(), tuning.override(MEASURE_WAYS=False, WHOLE_MATRICES=whole):
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(mlp, target_ratio=0.2, init="random", example_inputs=(x[:8],))
        dense_casts = _casts_per_step(mlp, x)
        casts = _casts_per_step(compiled, x)
    ran = {layer.ran_as for layer in compiled.modules() if isinstance(layer, TTLinear)}
    assert ran <= {LinearWay.THIN_PAIR, LinearWay.WHOLE_MATRIX} and len(ran) >= 1
    assert casts <= dense_casts, (casts, dense_casts)


def test_merged_factors_under_autocast_are_bf16_and_train_like_fp32(mlp):
    """The factors reach the rows' GEMMs in bf16; outputs and core gradients agree with the
    same step in fp32 to bf16's precision."""
    x = torch.randn(256, 256)
    with warnings.catch_warnings(), tuning.override(MEASURE_WAYS=False, WHOLE_MATRICES=False):
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(mlp, target_ratio=0.2, init="random", example_inputs=(x[:8],))
        y16 = _step(compiled, x)
        grads16 = [p.grad.clone() for p in compiled.parameters()]
        compiled.zero_grad(set_to_none=True)
        y32 = compiled(x)
        y32.square().mean().backward()
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, rtol=5e-2, atol=5e-2 * y32.abs().max().item())
    for g16, p in zip(grads16, compiled.parameters()):
        assert g16.dtype == torch.float32
        scale = p.grad.abs().max().item() + 1e-12
        assert (g16 - p.grad).abs().max().item() <= 0.08 * scale
