"""Contraction planning per bucket and the planned executor."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import tncompile
from tncompile.formats import TTLayout, TTMLayout
from tncompile.planning import plan_contraction
from tncompile.runtime.kernels.plans import bucket_of
from tncompile import tuning
from tncompile.runtime import TTLinear, TTMEmbedding, TTMTiedLinear
from tncompile.runtime.kernels.executor import contract
from tncompile.testing import small_encoder

f64 = torch.float64


def test_bucket_of_powers_of_two():
    assert [bucket_of(r) for r in (0, 1, 2, 3, 4, 5, 4096, 4097)] == [1, 1, 2, 4, 4, 8, 4096, 8192]


def test_small_and_large_batches_get_different_orders():
    tt = TTLinear(TTLayout.for_shape(768, 3072, 3, ranks=30))
    one, many = tt.plan_bucket(1), tt.plan_bucket(4096)
    names = ["x"] + [f"G{k}" for k in range(6)]
    assert one.order(names) != many.order(names)
    # one token: the input walks through the cores; 4096: cores merge first, then skinny products
    assert one.order(names).startswith("((((((x.G0)")
    assert "(G0.G1)" in many.order(names) and "(G4.G5)" in many.order(names)
    dense_macs = 4096 * 768 * 3072
    assert dense_macs / many.fwd_flops > 18  # near the 20.5x FLOP limit of rank 30
    assert many.cost <= min(many.candidates.values()) + 1e-6


@given(d=st.integers(1, 3), rank=st.integers(1, 5), rows=st.integers(1, 70), seed=st.integers(0, 99))
@settings(max_examples=30, deadline=None)
def test_every_plan_matches_the_dense_matrix_with_gradients(d, rank, rows, seed):
    torch.manual_seed(seed)
    try:
        lay = TTLayout.for_shape(12, 20, d, ranks=rank)
    except ValueError:
        return
    tt = TTLinear(lay, dtype=f64)
    with torch.no_grad():
        for c in tt.cores:
            c.normal_()
        for g in tt.gates:
            g.uniform_(0.5, 1.5)
    inputs, output, sizes = tt.planner_problem()
    x = torch.randn(rows, 12, dtype=f64, requires_grad=True)
    for strategy in ("left-to-right", "merge-cores-first", "cotengra-flops"):
        plan = plan_contraction(inputs, output, {**sizes, "b": rows})
        if strategy not in plan.candidates:
            continue
        tt.plans.clear()
        y = tt(x)
        ref = x @ tt.weight().t() + tt.bias
        assert torch.allclose(y, ref, atol=1e-10)
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, *tt.cores, *tt.gates], g)
        want = torch.autograd.grad(ref, [x, *tt.cores, *tt.gates], g)
        assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(got, want))


@pytest.mark.parametrize("rows", [1, 3, 33])
def test_planned_executor_gradcheck_linear_and_tied(rows):
    tt = TTLinear(TTLayout.for_shape(6, 12, 2, ranks=3), dtype=f64)
    with torch.no_grad():
        for c in tt.cores:
            c.normal_()
    x = torch.randn(rows, 6, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *p: tt(x), (x, *tt.cores, *tt.gates))
    emb = TTMEmbedding(TTMLayout.for_shape(20, 6, 2, ranks=3), dtype=f64)
    with torch.no_grad():
        for c in emb.cores:
            c.normal_()
    head = TTMTiedLinear(emb)
    assert torch.autograd.gradcheck(lambda x, *p: head(x), (x, *emb.cores))


def test_plan_executor_on_every_candidate_order():
    inputs = [("b", "i0", "i1"), ("i0", "r1"), ("r1", "i1", "r2"), ("r2", "j0", "r3"), ("r3", "j1")]
    output = ("b", "j0", "j1")
    sizes = dict(b=7, i0=2, i1=3, j0=3, j1=2, r1=2, r2=3, r3=2)
    ts = [torch.randn(*[sizes[i] for i in ix], dtype=f64, requires_grad=True) for ix in inputs]
    ref = torch.einsum("abc,bd,dce,efg,gh->afh", *ts)
    plan = plan_contraction(inputs, output, sizes)
    assert set(plan.candidates) >= {"left-to-right", "merge-cores-first", "cotengra-flops"}
    assert torch.allclose(contract(plan, ts), ref)
    assert torch.autograd.gradcheck(lambda *t: contract(plan, t), ts)


def test_new_batch_size_planned_once_then_cached(monkeypatch):
    tt = TTLinear(TTLayout.for_shape(64, 64, 2, ranks=4))
    calls = []
    original = TTLinear.plan_bucket

    def counting(self, bucket):
        calls.append(bucket)
        return original(self, bucket)

    monkeypatch.setattr(TTLinear, "plan_bucket", counting)
    for rows in (5, 7, 8, 6, 5):
        tt(torch.randn(rows, 64))
    assert calls == [8]
    tt(torch.randn(2, 9, 64))  # 18 rows -> bucket 32
    assert calls == [8, 32]


def test_compile_batch_sizes_plan_ahead_and_load_plans_on_first_use(tmp_path):
    model = small_encoder().eval()
    ids = torch.randint(1, 1000, (2, 16))  # 32 rows per linear at batch 2
    c = tncompile.compile(model, target_ratio=0.2, example_inputs=(ids,), batch_sizes=[1, 64])
    ff1 = c.model.get_submodule("layers.0.ff1")
    assert set(ff1.plans) == {16, 32, 1024}  # batch 1 x 16, traced 2 x 16, batch 64 x 16
    assert "plan rows<=1024" in c.program.dump()
    assert [r.name for r in c.program.history][-6:] == ["plan_contractions", "fuse_feed_forward", "lower_dropout",
                                                        "fuse_attention", "fuse_siblings", "measure_ways"]
    path = tmp_path / "m.tnc"
    tncompile.save(c, path)
    loaded = tncompile.load(path, model=small_encoder().eval())
    lff1 = loaded.model.get_submodule("layers.0.ff1")
    assert not lff1.plans  # a file's batch sizes and layouts size no search at load: first use plans
    assert torch.equal(loaded(ids), c(ids))
    loaded(torch.randint(1, 1000, (64, 16)))
    assert set(lff1.plans) == {32, 1024}
    assert lff1.plans[1024].order() == ff1.plans[1024].order()


def test_bfloat16_planned_forward_backward():
    tt = TTLinear.from_linear(nn.Linear(64, 96), rank=8, num_cores=2).to(torch.bfloat16)
    x = torch.randn(33, 64, dtype=torch.bfloat16, requires_grad=True)
    y = tt(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad is not None and torch.isfinite(x.grad.float()).all()


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_ttm_lookup_with_repeated_ids_and_padding_matches_dense(d):
    emb = TTMEmbedding(TTMLayout.for_shape(300, 24, d, ranks=4), padding_idx=7, dtype=f64)
    with torch.no_grad():
        for c in emb.cores:
            c.normal_()
        for g in emb.gates:
            g.uniform_(0.5, 1.5)
    ids = torch.randint(0, 12, (8, 40))  # 320 ids, at most 12 distinct: the dedup path
    ids[0, :5] = 7
    table = emb.weight()
    ref = torch.where((ids == 7).unsqueeze(-1), table[ids].detach(), table[ids])  # nn.Embedding: the row, no grad
    out = emb(ids)
    assert torch.allclose(out, ref, atol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [*emb.cores, *emb.gates], g)
    want = torch.autograd.grad(ref, [*emb.cores, *emb.gates], g)
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(got, want))
    few = torch.tensor([7, 7, 7])  # only padding: the row, and no gradient
    emb.zero_grad()
    emb(few).sum().backward()
    assert all(c.grad is None or not c.grad.any() for c in emb.cores)


def test_ttm_lookup_split_is_planned_and_cached():
    emb = TTMEmbedding(TTMLayout.for_shape(30522, 768, 4, ranks=32))
    plan = emb.plan_bucket(4096)
    assert plan.split in (1, 2, 3) and plan.cost == min(plan.candidates.values())
    assert plan.speedup > 2  # far cheaper than contracting every id's slices along the chain
    emb(torch.randint(0, 30522, (4096,)))
    assert 4096 in emb.plans
    with pytest.raises(IndexError, match="out of range"):
        emb(torch.tensor([30522]))


@pytest.mark.parametrize("rows,strategy", [(64, "merge-cores-first"), (3, "left-to-right"),
                                           (5, "cotengra-flops")])
def test_bias_inside_the_last_gemm_matches_and_has_gradients(rows, strategy, monkeypatch):
    from tncompile.runtime.kernels import gemms
    from tncompile.runtime.kernels.executor import fuses_bias
    # every output counts as big: the bias rides in the GEMM as an extra rank, forward and backward
    monkeypatch.setattr(tuning, "BIG_OUTPUT", 0)
    inputs = [("b", "i0", "i1"), ("i0", "r1"), ("r1", "i1", "r2"), ("r2", "j0", "r3"), ("r3", "j1")]
    output = ("b", "j0", "j1")
    sizes = dict(b=rows, i0=2, i1=3, j0=3, j1=2, r1=2, r2=3, r3=2)
    plan = plan_contraction(inputs, output, sizes, strategies=[strategy])
    ts = [torch.randn(*[sizes[i] for i in ix], dtype=f64, requires_grad=True) for ix in inputs]
    bias = torch.randn(6, dtype=f64, requires_grad=True)
    ref = torch.einsum("abc,bd,dce,efg,gh->afh", *ts) + bias.reshape(3, 2)
    assert torch.allclose(contract(plan, ts, bias), ref)
    assert torch.autograd.gradcheck(lambda b, *t: contract(plan, t, b), (bias, *ts))
    if strategy == "merge-cores-first":
        assert fuses_bias(plan)
        # all of the last step's gradients, the bias's included, come from one call
        # (checked by the gradcheck above); the generated backward does call it
        from tncompile.runtime.kernels.plan_program import program_for
        program = program_for(plan, gemms.GENERATED_CODE_NAMESPACE)
        assert "_expand_grads(" in program.backward_source((True,) * 5, True)
        assert "True, True, True)" in program.backward_source((True,) * 5, True)
        assert "True, True, False)" in program.backward_source((True,) * 5, False)


@pytest.mark.parametrize("case", ["bias-as-rank", "transposed-weight-grad", "skinny-colmajor",
                                  "padded-columns", "padded-rows", "thin-expand", "plain"])
def test_pairwise_cpu_layout_paths_match_tensordot(case, monkeypatch):
    """Each CPU GEMM path of the executor (bias riding as an extra rank, x.T @ g
    computed as (g.T @ x).T, skinny right operand copied column-major, a
    column count padded to a multiple of 8, 9 output rows run as 12, a thin product
    while autograd records: not the native kernels, which have no gradient formula)
    gives tensordot's result, with gradients, in float64."""
    from tncompile.runtime.kernels import cpu_gemm
    from tncompile.runtime.kernels.executor import pairwise
    f64 = torch.float64
    bias = None
    if case == "bias-as-rank":        # (rows, r) . (r, n) + bias, r small: [h, 1] @ [B; b]
        a, b, ax = torch.randn(512, 5, dtype=f64), torch.randn(5, 16, 8, dtype=f64), ((1,), (0,))
        monkeypatch.setattr(tuning, "BIG_OUTPUT", 512 * 128)  # this output counts as big
        bias = torch.randn(128, dtype=f64, requires_grad=True)
    elif case == "transposed-weight-grad":  # x.T @ g: contract the rows, 40 free columns
        a, b, ax = torch.randn(96, 4, 50, dtype=f64), torch.randn(96, 40, dtype=f64), ((0,), (0,))
    elif case == "skinny-colmajor":   # (rows, k) @ (k, 3), right row-major
        a, b, ax = torch.randn(64, 30, dtype=f64), torch.randn(30, 3, dtype=f64), ((1,), (0,))
    elif case == "padded-columns":    # (rows, k) @ (k, 30): 30 columns run as 32, cropped
        a, b, ax = torch.randn(300, 260, dtype=f64), torch.randn(260, 30, dtype=f64), ((1,), (0,))
        assert cpu_gemm.padded_columns(300, 260, 30) == 32
    elif case == "padded-rows":       # h.T @ g with 9 rows (a rank-8 core gradient plus the bias row)
        a, b, ax = torch.randn(1024, 9, dtype=f64), torch.randn(1024, 1024, dtype=f64), ((0,), (0,))
        assert cpu_gemm.padded_rows(9, 1024, 1024) == 12
    elif case == "thin-expand":       # (rows, 8) @ (8, 1024): a native kernel's shape, but autograd records
        a, b, ax = torch.randn(512, 8, dtype=f64), torch.randn(8, 1024, dtype=f64), ((1,), (0,))
    else:
        a, b, ax = torch.randn(8, 6, dtype=f64), torch.randn(6, 9, dtype=f64), ((1,), (0,))
    a.requires_grad_(True), b.requires_grad_(True)
    out = pairwise(a, ax[0], b, ax[1], bias)
    ref = torch.tensordot(a, b, dims=ax)
    if bias is not None:
        ref = ref + bias.reshape(ref.shape[1:])
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-12)
    g = torch.randn_like(ref)
    leaves = [t for t in (a, b, bias) if t is not None]
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, leaves, g)
    assert all(torch.allclose(x, y, atol=1e-12) for x, y in zip(got, want))
