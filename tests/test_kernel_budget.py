"""Issue 42's kernel budget: a compressed training step launches at most dense's kernels
plus 10%. The paper's six-encoder at 1/44.9, batch 1 (128 tokens), counted on the CPU as
``benchmarks/bench_dispatch.py`` counts (ATen ops that launch a kernel, run as on CUDA;
each Triton op as the launches it makes on a GPU), forward and backward, the optimizer
left out. With ``tuning.TRITON_KERNELS`` (a thin pair per TT linear, a feed-forward block's
activation in its first layer's launches, one batched merge per family of layers, a gather
and a scatter per TTM lookup) the step fits; PyTorch's ops alone
(the default until a GPU measures the kernels) take twice dense's."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tncompile import tuning
from tncompile.planning import REFERENCE
from tncompile.runtime.native import native_kernels

_native = os.environ.get("TNCOMPILE_NATIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench_dispatch = pytest.importorskip("bench_dispatch")
sys.path.pop(0)
if _native is None:   # the benchmark turns the native CPU kernels off for its whole process; not for the suite
    os.environ.pop("TNCOMPILE_NATIVE", None)
else:
    os.environ["TNCOMPILE_NATIVE"] = _native

BUDGET = 1.10


@pytest.fixture(scope="module")
def six_encoder_at_batch_1():
    with pytest.MonkeyPatch.context() as mp, native_kernels(False):   # the PyTorch ops a GPU runs
        mp.setattr(tuning, "DEVICE_SPEED", REFERENCE)   # planned for the reference CPU: host-independent
        mp.setattr(tuning, "WHOLE_MATRICES", False)
        mp.setattr(tuning, "MEASURE_WAYS", False)       # the prior's ways: counts that no timing moves
        dense, make_compiled, loss_of = bench_dispatch._six_encoder(1)
        return dense, make_compiled(), loss_of


@native_kernels(False)
def test_a_compressed_step_launches_at_most_dense_plus_ten_percent(six_encoder_at_batch_1, monkeypatch):
    dense, compiled, loss_of = six_encoder_at_batch_1
    monkeypatch.setattr(tuning, "DEVICE_SPEED", REFERENCE)
    monkeypatch.setattr(tuning, "WHOLE_MATRICES", False)
    monkeypatch.setattr(tuning, "MEASURE_WAYS", False)
    monkeypatch.setattr(tuning, "TRITON_KERNELS", True)
    bench_dispatch.ops_as_on_cuda(monkeypatch.setattr)
    dense_count = bench_dispatch.count_ops(dense, loss_of)["kernel_like"]
    got = bench_dispatch.count_ops(compiled, loss_of)
    by_op = got["kernel_like_by_op"]
    # 36 TT linears, each way; the 6 feed-forward blocks' GELU in their first layer's launches
    assert by_op.get("tncompile::thin_pair_kept") == 66 and by_op.get("tncompile::thin_pair_activation_grad") == 6
    assert not any("gelu" in op for op in by_op), by_op
    assert got["kernel_like_by_op"].get("tncompile merge launches", 0) > 0
    assert got["kernel_like"] <= BUDGET * dense_count, (got["kernel_like"], dense_count, got["kernel_like_by_op"])
    monkeypatch.setattr(tuning, "TRITON_KERNELS", False)   # the same step on PyTorch's ops: the budget bites
    assert bench_dispatch.count_ops(compiled, loss_of)["kernel_like"] > 1.5 * dense_count
