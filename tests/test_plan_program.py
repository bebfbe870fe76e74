"""Generated straight-line code for plans: same numbers as the generic step
loop, for every gradient pattern, and never pickled with the plan."""
import copy
import io
import pickle
import traceback

import pytest
import torch

from tncompile.planning import plan_contraction
from tncompile.runtime.kernels import executor
from tncompile.runtime.kernels.executor import contract

f64 = torch.float64
NETWORK = ([("b", "i0", "i1"), ("i0", "r1"), ("r1", "i1", "r2"), ("r2", "j0", "r3"), ("r3", "j1")],
           ("b", "j0", "j1"))
SIZES = dict(i0=2, i1=3, j0=3, j1=2, r1=2, r2=3, r3=2)
STRATEGIES = ["left-to-right", "merge-cores-first", "cotengra-flops"]


def _operands(plan, rows, want):
    sizes = {**SIZES, "b": rows}
    return [torch.randn(*[sizes[i] for i in ix], dtype=f64, requires_grad=w)
            for ix, w in zip(plan.inputs, want)]


def _generic(plan):
    """The same plan run by the generic step loop (as for a plan saved without sizes)."""
    old = copy.copy(plan)
    old.sizes = None
    return old


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("want", [(True,) * 5, (False, True, True, True, True), (True, False, True, False, True)])
def test_generated_code_matches_the_generic_loop(strategy, rows, want):
    plan = plan_contraction(*NETWORK, {**SIZES, "b": rows}, strategies=[strategy])
    ops = _operands(plan, rows, want)
    bias = torch.randn(6, dtype=f64, requires_grad=True)
    out = contract(plan, ops, bias)
    assert plan.__dict__.get("_program") is not None  # it ran the generated code
    ref = contract(_generic(plan), ops, bias)
    assert torch.equal(out, ref)
    leaves = [t for t in (bias, *ops) if t.requires_grad]
    g = torch.randn_like(out)
    for got, exp in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g)):
        assert torch.allclose(got, exp, atol=1e-12)


def test_rows_vary_within_a_bucket_and_gradcheck_passes():
    plan = plan_contraction(*NETWORK, {**SIZES, "b": 64}, strategies=["merge-cores-first"])
    for rows in (33, 64, 0):  # an empty batch too: forward, and gradients (zeros) with a bias
        ops = _operands(plan, rows, (True,) * 5)
        bias = torch.randn(6, dtype=f64, requires_grad=True)
        out = contract(plan, ops, bias)
        ref = torch.einsum("abc,bd,dce,efg,gh->afh", *ops) + bias.reshape(3, 2)
        assert out.shape == ref.shape and torch.allclose(out, ref)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, [bias, *ops], g)
        want = torch.autograd.grad(ref, [bias, *ops], g)
        assert all(a.shape == b.shape and torch.allclose(a, b) for a, b in zip(got, want))
    ops = _operands(plan, 17, (True,) * 5)
    assert torch.autograd.gradcheck(lambda *t: contract(plan, t), ops)


def test_source_is_readable_and_the_program_is_not_pickled():
    plan = plan_contraction(*NETWORK, {**SIZES, "b": 8}, strategies=["left-to-right"])
    contract(plan, _operands(plan, 8, (True,) * 5)).sum().backward()
    src = executor.generated_code(plan)
    assert src.startswith("def forward(ops, bias, mm):") and "def backward(ops, grad_out, mm):" in src
    assert "# b i0 i1 . i0 r1 -> b i1 r1" in src and "rows = o0.shape[0]" in src
    buf = io.BytesIO()
    pickle.dump(plan, buf)
    loaded = pickle.loads(buf.getvalue())
    assert "_program" not in loaded.__dict__ and loaded == plan
    with pytest.raises(ValueError, match="re-plan"):
        executor.generated_code(_generic(plan))
    ops = _operands(loaded, 8, (True,) * 5)
    assert torch.equal(contract(loaded, ops), contract(_generic(plan), ops))


def test_a_traceback_shows_the_generated_line():
    plan = plan_contraction(*NETWORK, {**SIZES, "b": 8}, strategies=["left-to-right"])
    ops = _operands(plan, 8, (False,) * 5)
    ops[1] = torch.randn(3, 2, dtype=f64)  # wrong core shape for the plan
    with pytest.raises(RuntimeError) as info:
        contract(plan, ops)
    text = "".join(traceback.format_exception(info.value))
    assert 'File "<tncompile forward' in text and "= mm(o" in text  # the generated line itself
