"""bench_gpu's per-kernel rows: bytes and FLOPs attributed from the launching op, GB/s and
TFLOP/s against the measured peaks (checked on synthetic profiler events and on a real CPU
profile's recorded shapes)."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd.profiler_util import Kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench_gpu_kernels = pytest.importorskip("bench_gpu_kernels")


def _op(name, shapes, dtypes, flops, kernels):
    return SimpleNamespace(name=name, input_shapes=shapes, input_dtypes=dtypes, flops=flops,
                           kernels=[Kernel(k, 0, us) for k, us in kernels])


def test_bytes_of_a_matmul_and_of_an_elementwise_op():
    bf16 = "c10::BFloat16"
    assert bench_gpu_kernels.op_bytes("aten::mm", [[8, 4], [4, 6]], [bf16, bf16]) == 2 * (32 + 24 + 48)
    # addmm(bias, a, b): the product's operands are the last two
    assert bench_gpu_kernels.op_bytes("aten::addmm", [[6], [8, 4], [4, 6]], ["float"] * 3) == 4 * (6 + 32 + 24 + 48)
    assert bench_gpu_kernels.op_bytes("aten::bmm", [[3, 8, 4], [3, 4, 6]], [bf16] * 2) == 2 * 3 * (32 + 24 + 48)
    # elementwise: inputs read, an output the size of the largest written; scalars skipped
    assert bench_gpu_kernels.op_bytes("aten::mul", [[8, 4], []], ["float", "Scalar"]) == 4 * 64
    # a tensor list's element dtype is not recorded: unknown, not guessed
    assert bench_gpu_kernels.op_bytes("aten::_foreach_add_", [[[8], [4]], [[8], [4]]],
                                      ["TensorList", "TensorList"]) is None


def test_kernel_rows_split_an_op_among_its_kernels_by_time():
    mm = _op("aten::mm", [[1024, 1024], [1024, 1024]], ["float", "float"], 2 * 1024**3, [("gemm_a", 100.0)])
    two = _op("aten::mm", [[1024, 1024], [1024, 1024]], ["float", "float"], 2 * 1024**3,
              [("gemm_a", 75.0), ("splitk_reduce", 25.0)])
    lists = _op("aten::_foreach_mul_", [[[10]]], ["TensorList"], 0, [("multi_tensor_apply_kernel", 50.0)])
    rows = {r["kernel"]: r for r in bench_gpu_kernels.kernel_rows([mm, two, lists], steps=1,
                                                                  peak_gb_s=100.0, peak_tflops=20.0)}
    moved = 3 * 1024 * 1024 * 4
    a = rows["gemm_a"]
    assert a["calls"] == 2 and a["ms"] == pytest.approx(0.175) and a["us_per_call"] == 87.5
    assert a["gb_per_s_est"] == pytest.approx(round((moved + 0.75 * moved) / 175e-6 / 1e9, 1))
    assert a["tflop_per_s"] == pytest.approx(round(1.75 * 2 * 1024**3 / 175e-6 / 1e12, 2))
    assert a["of_peak_flops"] == pytest.approx(a["tflop_per_s"] / 20.0, abs=2e-3)
    assert a["of_peak_bw"] == pytest.approx(a["gb_per_s_est"] / 100.0, abs=2e-3)
    assert rows["splitk_reduce"]["gb_per_s_est"] == pytest.approx(round(0.25 * moved / 25e-6 / 1e9, 1))
    tensor_lists = rows["multi_tensor_apply_kernel"]
    assert tensor_lists["gb_per_s_est"] is None and tensor_lists["kind"] == "optimizer"
    assert list(rows) == ["gemm_a", "multi_tensor_apply_kernel", "splitk_reduce"]   # costliest first
    capped = bench_gpu_kernels.kernel_rows([mm, two, lists], steps=1, top=1)
    assert [r["kernel"] for r in capped] == ["gemm_a", "(others: 2 kernels)"] and capped[1]["calls"] == 2


def test_the_profiler_records_what_op_bytes_reads():
    a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        torch.mm(a, b)
    (mm,) = [e for e in prof.events() if e.name == "aten::mm"]
    assert bench_gpu_kernels.op_bytes(mm.name, mm.input_shapes, mm.input_dtypes) == 2 * (64 * 32 + 32 * 16 + 64 * 16)
    assert mm.flops == 2 * 64 * 32 * 16
