"""Issue 64 item 5: subnormal floats are flushed to zero on every intra-op thread while a
compressed model computes on the CPU, forward and backward, and only then."""
from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tncompile
from tncompile import tuning
from tncompile.runtime.kernels import denormals
from tncompile.runtime.native import native_ops

TINY = torch.finfo(torch.float32).tiny


def _subnormals(t: torch.Tensor) -> int:
    a = t.detach().abs()
    return int(((a > 0) & (a < TINY)).sum())


def _kept_subnormals() -> int:
    """Subnormals an elementwise op over a large (parallelized) tensor keeps."""
    x = torch.full((1 << 20,), 1e-40)
    return _subnormals(x * 1.0)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(native_ops() is None, reason="needs the native kernels")
def test_every_intra_op_thread_flushes_inside_the_block_and_not_after(two_threads):
    assert _kept_subnormals() == 1 << 20
    with denormals.flushing():
        assert _kept_subnormals() == 0            # both threads' halves, not just the caller's
        with denormals.flushing():                # nested: still on, and still on after it
            pass
        assert _kept_subnormals() == 0
    assert _kept_subnormals() == 1 << 20          # the caller's IEEE state is back


class _Counter(TorchDispatchMode):
    """Subnormal values in the outputs of every op run inside it."""

    def __init__(self):
        super().__init__()
        self.by_op = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                n = _subnormals(t)
                if n:
                    self.by_op[str(func)] += n
        return out


def _tt_backward(flush: bool):
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(96, 192), nn.GELU(), nn.Linear(192, 96))
    model = tncompile.compile(dense, target_ratio=0.3, prefer="size", init="random")
    x = (torch.randn(64, 96) * 1e-9).requires_grad_()      # tiny activations ...
    with tuning.override(FLUSH_DENORMALS=flush):
        out = model(x)
        grad_out = torch.full_like(out, 1e-30)               # ... and tiny gradients: products below 1.2e-38
        with _Counter() as counter:
            out.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return model, x, grad_out, grads, counter.by_op


def test_a_tt_backward_makes_no_subnormal_and_keeps_the_dense_gradients(two_threads):
    _, _, _, ieee_grads, ieee_counts = _tt_backward(flush=False)
    assert sum(ieee_counts.values()) > 0                      # the case makes subnormals without the flush
    model, x, grad_out, grads, counts = _tt_backward(flush=True)
    assert sum(counts.values()) == 0, dict(counts)             # none in any op of the model's backward
    for name, g in grads.items():                              # sums of flushed values: far below any trained gradient
        torch.testing.assert_close(g, ieee_grads[name], rtol=1e-4, atol=1e-36)
    reference = model.to_dense()                               # the input's gradient against the dense matrix
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).backward(grad_out)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-3, atol=1e-36)
    assert _kept_subnormals() > 0                               # and the process is IEEE again after it


def test_the_flush_stays_off_the_gpu_path_and_can_be_turned_off(monkeypatch):
    calls = []
    monkeypatch.setattr(denormals, "flush_denormals", lambda on: calls.append(on) or False)
    model = tncompile.compile(nn.Sequential(nn.Linear(96, 192), nn.GELU(), nn.Linear(192, 96)), target_ratio=0.3,
                              prefer="size", init="random")
    model(torch.randn(4, 96)).sum().backward()
    assert calls == [True, False, True, False]                # forward on/off, backward on/off
    calls.clear()
    with tuning.override(FLUSH_DENORMALS=False):
        model(torch.randn(4, 96)).sum().backward()
    assert calls == []
