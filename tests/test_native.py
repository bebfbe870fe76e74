"""The native gathered-product kernel (TTM lookups) against the eager path and the dense table."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tncompile import tuning
from tncompile.runtime import TTMEmbedding, TTMTiedLinear
from tncompile.runtime.kernels import traced_lookup
from tncompile.runtime.ways.lookup import GatheredProduct as _GatheredProduct

f64 = torch.float64


def _eager(left, right, i, j, grad):
    out = torch.bmm(left[i], right[j])
    g_left = torch.zeros_like(left).index_add_(0, i, torch.bmm(grad, right[j].transpose(1, 2)))
    g_right = torch.zeros_like(right).index_add_(0, j, torch.bmm(left[i].transpose(1, 2), grad))
    return out, g_left, g_right


# sizes off the kernel's register blocks (6 / 8 rows, 2 vectors, the 32- and 16-byte column
# blocks, dL's rank padded to whole 16-byte vectors) and on them
@pytest.mark.parametrize("m_l, n_l, rank, m_r, n_r, T", [
    (5, 48, 32, 7, 16, 300), (3, 1, 1, 2, 1, 5), (4, 7, 5, 3, 12, 64), (6, 13, 6, 5, 20, 33),
    (2, 6, 9, 4, 35, 17), (9, 24, 7, 8, 8, 0), (5, 48, 30, 7, 16, 300), (4, 32, 20, 8, 4, 100),
    (3, 9, 37, 4, 5, 50), (2, 16, 33, 3, 7, 40),
])
@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_kernel_matches_eager_products(ops, m_l, n_l, rank, m_r, n_r, T, dtype):
    g = torch.Generator().manual_seed(T + rank)
    left = torch.randn(m_l, n_l, rank, generator=g, dtype=dtype)
    right = torch.randn(m_r, rank, n_r, generator=g, dtype=dtype)
    i = torch.randint(0, m_l, (T,), generator=g)
    j = torch.randint(0, m_r, (T,), generator=g)
    grad = torch.randn(T, n_l, n_r, generator=g, dtype=dtype)
    out, g_left, g_right = _eager(left, right, i, j, grad)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(ops.gathered_product(left, right, i, j), out, **tol)
    got_l, got_r = ops.gathered_product_backward(grad, left, right, i, j, True, True)
    torch.testing.assert_close(got_l, g_left, **tol)
    torch.testing.assert_close(got_r, g_right, **tol)


def test_kernel_gradcheck_and_one_sided_gradients(ops):
    g = torch.Generator().manual_seed(0)
    left = torch.randn(4, 6, 3, generator=g, dtype=f64, requires_grad=True)
    right = torch.randn(5, 3, 10, generator=g, dtype=f64, requires_grad=True)
    i = torch.tensor([0, 3, 3, 1, 0, 2])  # repeated rows accumulate
    j = torch.tensor([4, 4, 0, 1, 2, 4])
    assert torch.autograd.gradcheck(lambda a, b: _GatheredProduct.apply(a, b, i, j), (left, right))
    frozen = left.detach()
    out = _GatheredProduct.apply(frozen, right, i, j)
    out.square().sum().backward()
    assert frozen.grad is None and right.grad is not None


def test_kernel_rejects_bad_indices_and_shapes(ops):
    left, right = torch.randn(3, 4, 2), torch.randn(5, 2, 6)
    with pytest.raises(RuntimeError, match="index out of range"):
        ops.gathered_product(left, right, torch.tensor([0, 3]), torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match="index out of range"):
        ops.gathered_product(left, right, torch.tensor([0, 1]), torch.tensor([-1, 1]))
    with pytest.raises(RuntimeError, match=r"need L \(M_L, N_L, r\)"):
        ops.gathered_product(left, torch.randn(5, 3, 6), torch.tensor([0]), torch.tensor([0]))


@pytest.mark.parametrize("way", ["gathered product", "half rows"])
@pytest.mark.parametrize("pad", [None, 2])
def test_ttm_embedding_native_equals_eager_and_dense(ops, monkeypatch, pad, way):
    """The lookup the way named (timed as the fastest: the choice is a measurement) on the
    native gathered-product kernel against the same way on PyTorch's ops and the dense table."""
    from tncompile.runtime.ways import lookup as lookup_ways
    from tncompile.runtime.ways import measured
    measured.forget()   # no winner kept from another case
    monkeypatch.setattr(lookup_ways, "_timer", lambda *a: lambda name: 0.001 if name == way else 0.01)
    dense = nn.Embedding(150, 24, padding_idx=pad).double()
    emb = TTMEmbedding.from_embedding(dense, rank=4, num_cores=3, init="random")
    with torch.no_grad():
        for gate in emb.gates:
            gate.uniform_(0.5, 1.5)
    head = TTMTiedLinear(emb)
    ids = torch.tensor([[3, 2, 7, 149, 3], [0, 2, 2, 88, 101]])
    ids = torch.cat([ids] * 20)  # >= 64 ids with repeats: the de-duplicated lookup runs too
    x = torch.randn(4, 24, dtype=f64)

    def run():
        for p in emb.parameters():
            p.grad = None
        out = emb(ids)
        (out.square().sum() + head(x).sum()).backward()
        return out.detach(), [p.grad.clone() for p in emb.parameters()]

    calls = []

    class Spy:  # the real kernels, counting calls: the native path must be the one that ran
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ops, name)

    monkeypatch.setattr(traced_lookup, "kernels_for", lambda t: Spy())
    native_out, native_grads = run()
    assert emb.ran_as.value == way
    # the head is a matrix product; the half rows chain each half's cores by the kernel too
    links = 1 if way == "gathered product" else 1 + (3 - 2)   # 3 cores: one bond inside a half
    assert calls == ["gathered_product"] * links + ["gathered_product_backward"] * links
    monkeypatch.setattr(traced_lookup, "kernels_for", lambda t: None)
    eager_out, eager_grads = run()
    torch.testing.assert_close(native_out, eager_out)
    for a, b in zip(native_grads, eager_grads):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(native_out, emb.weight().detach()[ids])  # padding rows as stored
    measured.forget()


def test_disabled_by_environment_falls_back():
    code = ("import torch; from tncompile.runtime import TTMEmbedding; "
            "from tncompile.runtime.native import native_ops, native_status; "
            "e = TTMEmbedding.from_embedding(torch.nn.Embedding(100, 16), rank=3, num_cores=2); "
            "e(torch.arange(100)).sum().backward(); assert native_ops() is None; print(native_status())")
    env = {**os.environ, "TNCOMPILE_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "disabled by TNCOMPILE_NATIVE=0" in out.stdout


@pytest.fixture
def thin_everywhere(monkeypatch):
    """Send every thin product to the native kernels, however small (the size
    thresholds exist for speed, not correctness)."""
    monkeypatch.setattr(tuning, "THIN_OUTPUT", 0)
    monkeypatch.setattr(tuning, "GEMM_TINY", 0)
    monkeypatch.setattr(tuning, "BIG_OUTPUT", 0)
    monkeypatch.setattr(tuning, "WEIGHT_GRAD_MIN_K", 0)


@pytest.mark.parametrize("M, K, N", [(4096, 30, 3072), (100, 7, 50), (13, 1, 33), (37, 64, 70), (0, 5, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_thin_kernels_match_matmul(ops, M, K, N, dtype):
    g = torch.Generator().manual_seed(M + K)
    t, w = torch.randn(M, K, generator=g, dtype=dtype), torch.randn(K, N, generator=g, dtype=dtype)
    bias, dy = torch.randn(N, generator=g, dtype=dtype), torch.randn(M, N, generator=g, dtype=dtype)
    x, a = torch.randn(M, N, generator=g, dtype=dtype), torch.randn(N, K, generator=g, dtype=dtype)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(ops.thin_expand(t, w, bias), torch.addmm(bias, t, w), **tol)
    torch.testing.assert_close(ops.thin_expand(t, w, None), t @ w, **tol)
    torch.testing.assert_close(ops.thin_project(x, a), x @ a, **tol)
    torch.testing.assert_close(ops.thin_project(x, a.t().contiguous().t()), x @ a, **tol)  # strided weight
    for want in [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]:
        d_t, d_w, d_bias = ops.thin_expand_backward(dy, t, w, *want)
        for got, ref, wanted in zip((d_t, d_w, d_bias), (dy @ w.t(), t.t() @ dy, dy.sum(0)), want):
            if wanted:
                torch.testing.assert_close(got, ref, **tol)
            else:
                assert got is None


@pytest.mark.parametrize("rows, k, n", [(4096, 35, 768), (1024, 48, 100), (4096, 1, 768), (1024, 49, 768)])
@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_weight_gradient_on_the_native_kernel_equals_mm(ops, rows, k, n, dtype):
    """``cpu_gemm(t.T, x)``, a core block's gradient over many rows, runs the native
    kernel up to tuning.WEIGHT_GRAD_ROWS output rows and equals ``t.T @ x``."""
    from tncompile.runtime.kernels.cpu_gemm import cpu_gemm
    from tncompile.runtime.native import watch
    g = torch.Generator().manual_seed(rows + k)
    t, x = torch.randn(rows, k, generator=g, dtype=dtype), torch.randn(rows, n, generator=g, dtype=dtype)
    calls = []
    with watch(calls.append):
        got = cpu_gemm(t.t(), x)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(got, t.t() @ x, **tol)
    assert got.shape == (k, n)
    assert ("tncompile::thin_expand_backward" in calls) == (k <= tuning.WEIGHT_GRAD_ROWS and n > tuning.THIN_RANK)


def test_thin_kernels_reject_bad_input(ops):
    with pytest.raises(RuntimeError, match=r"thin_expand: \(M x r\) @ \(r x N\)"):
        ops.thin_expand(torch.randn(4, 3), torch.randn(2, 5), None)
    with pytest.raises(RuntimeError, match="float32 or float64 only"):
        ops.thin_project(torch.randn(4, 3).bfloat16(), torch.randn(3, 2).bfloat16())
    with pytest.raises(RuntimeError, match="thin_expand_backward: need dy"):
        ops.thin_expand_backward(torch.randn(4, 5), torch.randn(4, 2), torch.randn(3, 5), True, True, True)


@pytest.mark.parametrize("strategy", ["merge-cores-first", "left-to-right"])
def test_tt_linear_on_thin_kernels_matches_dense_and_gradchecks(ops, thin_everywhere, monkeypatch, strategy):
    from tncompile.formats import TTLayout
    from tncompile.planning import plan_contraction
    from tncompile.runtime import TTLinear
    from tncompile.runtime.kernels import cpu_gemm, gemms
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ops, name)

    for module in (cpu_gemm, gemms):
        monkeypatch.setattr(module, "kernels_for", lambda t: Spy())
    lay = TTLayout.for_shape(288, 96, 3).with_ranks(5)  # wide enough (> THIN_RANK) on both sides
    layer = TTLinear(lay, dtype=f64)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    inputs, output, sizes = layer.planner_problem()
    for rows in (6, 16):
        layer.plans[rows] = plan_contraction(inputs, output, {**sizes, "b": rows}, strategies=[strategy])
    x = torch.randn(2, 8, 288, dtype=f64, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, x @ layer.weight().t() + layer.bias)
    assert torch.autograd.gradcheck(lambda x, *p: torch.func.functional_call(
        layer, dict(zip([n for n, _ in layer.named_parameters()], p)), (x,)),
        (x, *layer.parameters()))
    if strategy == "merge-cores-first":  # x @ A, t @ B + bias, and the fused backward of the latter
        assert {"thin_project", "thin_expand", "thin_expand_backward"} <= set(calls)
    # (passing the input through the cores one by one has no wide thin product at this size)


@pytest.mark.parametrize("in_f, out_f, cores, rank, lead, bias", [
    (768, 768, 3, 8, (1,), True), (20, 30, 2, 4, (2,), True), (7, 13, 3, 3, (1, 2), False),
    (33, 40, 4, 5, (1, 1), True),  # padded input and output modes
])
def test_tt_linear_chain_at_few_rows_matches_planned_and_dense(ops, monkeypatch, in_f, out_f, cores, rank, lead,
                                                               bias):
    from tncompile.formats import TTLayout
    from tncompile.runtime import TTLinear
    from tncompile.runtime.kernels import tt_chain
    lay = TTLayout.for_shape(in_f, out_f, cores).with_ranks(rank)
    layer = TTLinear(lay, bias=bias, dtype=f64)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)  # gates are part of the function
    x = torch.randn(*lead, in_f, dtype=f64, requires_grad=True)
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ops, name)

    monkeypatch.setattr(tt_chain, "kernels_for", lambda t: Spy())
    monkeypatch.setattr(tuning, "CHAIN_FLOP_FLOOR", 1 << 40)  # these small layers: always the chain
    monkeypatch.setattr(tuning, "MEASURE_WAYS", False)  # ... by the prior (not whichever is timed faster)

    def run(chain: bool):
        monkeypatch.setattr(tuning, "CHAIN_ROWS", 2 if chain else 0)
        for p in [x, *layer.parameters()]:
            p.grad = None
        y = layer(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=f64).reshape(y.shape)).sum().backward()
        return [y.detach(), x.grad, *[p.grad for p in layer.parameters()]]

    chained = run(True)
    assert calls[:1] == ["tt_chain"]  # one op; its C++ autograd node runs the backward
    planned = run(False)
    for a, b in zip(chained, planned):
        torch.testing.assert_close(a, b)
    dense = x.detach() @ layer.weight().detach().t() + (layer.bias.detach() if bias else 0)
    torch.testing.assert_close(chained[0], dense)
    monkeypatch.setattr(tuning, "CHAIN_ROWS", 2)
    names = [n for n, _ in layer.named_parameters()]
    assert torch.autograd.gradcheck(
        lambda x, *p: torch.func.functional_call(layer, dict(zip(names, p)), (x,)), (x, *layer.parameters()))


def test_chain_only_for_few_rows_and_rejects_bad_cores(ops, monkeypatch):
    from tncompile.formats import TTLayout
    from tncompile.runtime import TTLinear
    from tncompile.runtime.kernels import tt_chain
    layer = TTLinear(TTLayout.for_shape(24, 24, 2).with_ranks(3))
    calls = []
    monkeypatch.setattr(tt_chain, "kernels_for", lambda t: calls.append(t.shape) or ops)
    monkeypatch.setattr(tuning, "MEASURE_WAYS", False)  # the prior's choice: the chain at one row
    layer(torch.randn(tuning.CHAIN_ROWS + 1, 24))
    assert calls == []
    layer(torch.randn(1, 24))
    assert len(calls) == 1 and calls[0][0] == 1  # one row: the chain (asked for once, when chosen)
    assert layer.ran_as.value == "native chain"
    cores = [c.detach() for c in layer.cores]
    gates = [g.detach() for g in layer.gates]
    with pytest.raises(RuntimeError, match="tt_chain: core 1 must be"):
        ops.tt_chain_forward(torch.randn(1, 24), [cores[0], cores[1][:2], *cores[2:]], gates, None, 2)
    with pytest.raises(RuntimeError, match="tt_chain: x has 23 features"):
        ops.tt_chain_forward(torch.randn(1, 23), cores, gates, None, 2)


def test_build_is_named_by_its_sources(tmp_path, monkeypatch):
    """Two checkouts sharing the extension cache keep a build each (named by a hash
    of the sources, headers and flags) instead of rebuilding over each other."""
    import shutil

    from tncompile.runtime.native import loader as native

    name = native.build_name()
    assert name.startswith("tncompile_native_") and name == native.build_name()
    copies = []
    for src in native._SOURCES:
        dst = tmp_path / Path(src).name
        shutil.copy(src, dst)
        copies.append(str(dst))
    monkeypatch.setattr(native, "_SOURCES", copies)
    assert native.build_name() == name  # same contents elsewhere: the same build
    Path(copies[0]).write_text(Path(copies[0]).read_text() + "\n// edited\n")
    assert native.build_name() != name


def test_build_is_named_by_its_environment(monkeypatch):
    """Two virtual environments sharing the extension cache keep a build each: the name
    changes with the torch version, the torch installation's path and the Python ABI."""
    from tncompile.runtime.native import loader as native

    name = native.build_name()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert native.build_name() != name
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert native.build_name() != name
    monkeypatch.undo()
    monkeypatch.setattr(native.sys.implementation, "cache_tag", "cpython-399")
    assert native.build_name() != name
    monkeypatch.undo()
    assert native.build_name() == name


def test_a_build_is_announced_before_it_starts_even_with_a_library_present(tmp_path, monkeypatch, caplog):
    """A library of the build's name already there does not silence the notice when torch builds
    anyway: a load running past ``BUILD_NOTICE_SECONDS`` announces itself while it runs."""
    import logging

    from tncompile.runtime.native import loader as native

    said = []

    def slow_load(**kwargs):
        time.sleep(0.5)
        said.append(caplog.text)  # what was on stderr while the build ran

    monkeypatch.setattr(native, "BUILD_NOTICE_SECONDS", 0.1)
    monkeypatch.setattr(native, "_built", lambda name: True)
    monkeypatch.setattr("torch.utils.cpp_extension.load", slow_load)
    with caplog.at_level(logging.WARNING, logger="tncompile.native"):
        native._build()
    assert "building the native CPU kernels" in said[0]
    caplog.clear()
    monkeypatch.setattr(native, "_built", lambda name: False)
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: said.append(caplog.text))
    with caplog.at_level(logging.WARNING, logger="tncompile.native"):
        native._build()
    assert "building the native CPU kernels" in said[-1]  # announced before load was called


def test_a_lock_left_by_a_killed_build_is_removed_a_live_one_kept(tmp_path, monkeypatch, caplog):
    """torch waits without limit on a build's lock file: one left by a killed build
    (older than any real build) is removed with a notice; a fresh one -- another
    process building now -- is left for torch to wait on."""
    import logging

    from tncompile.runtime.native import loader as native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "tncompile_native_locktest"
    assert native.clear_stale_lock(name) is False  # no lock: nothing to do
    lock = tmp_path / name / "lock"
    lock.touch()
    assert native.clear_stale_lock(name) is False and lock.exists()  # fresh: someone is building
    aged = time.time() - native.STALE_LOCK_SECONDS - 60
    os.utime(lock, (aged, aged))
    with caplog.at_level(logging.WARNING, logger="tncompile.native"):
        assert native.clear_stale_lock(name) is True
    assert not lock.exists()
    assert "stale native-build lock" in caplog.text and str(lock) in caplog.text
