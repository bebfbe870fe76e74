"""tncompile's Triton kernels, checked against the dense matrix they stand for: compiled on a
GPU (``cuda`` marker), through Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, how
every CI run tests them without a GPU). Forward, gradients, float64 gradcheck, the custom
op's fake kernel and autograd registration (``torch.library.opcheck``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tncompile.runtime import TTLinear
from tncompile.runtime.triton import interpreting, runs_triton, thin_pair, thin_pair_kept, thin_pair_train

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
            for s in ((3, 7), (7, 2), (2, 5), (5,))]
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


# ---------------------------------------------------------------- the training thin pair
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float64, 1e-10), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_training_pair_keeps_its_middle_and_matches_the_dense_product(device, dtype, tol, with_bias):
    """``thin_pair_train``: forward as the plain op; gradients of x, A, B and the bias from the
    kept middle (``[x A, 1]^T dy`` gives dB and the bias gradient in one product)."""
    torch.manual_seed(4)
    x = torch.randn(37, 50, device=device, dtype=dtype, requires_grad=True)
    a = torch.randn(50, 7, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(7, 45, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(45, device=device, dtype=dtype, requires_grad=True) if with_bias else None
    inputs = (x, a, b) + ((bias,) if with_bias else ())
    y = thin_pair_train(x, a, b, bias)
    ref = x.double() @ (a.double() @ b.double()) + (bias.double() if with_bias else 0)
    scale = ref.abs().max()
    torch.testing.assert_close(y.double() / scale, ref / scale, rtol=tol, atol=tol)
    dy = torch.randn_like(y)
    for g, w, name in zip(torch.autograd.grad(y, inputs, dy), torch.autograd.grad(ref, inputs, dy.double()),
                          ("x", "a", "b", "bias")):
        s = w.abs().max()
        torch.testing.assert_close(g.double() / s, w.double() / s, rtol=tol, atol=tol, msg=name)
    y_kept, t1 = thin_pair_kept(x.detach(), a.detach(), b.detach(), None if bias is None else bias.detach())
    assert t1.shape == (37, 7 + with_bias) and torch.equal(y_kept, y.detach())
    if with_bias:
        assert torch.equal(t1[:, 7], torch.ones(37, device=device, dtype=dtype))


def test_the_training_pair_gradchecks_and_its_op_registers(device):
    torch.manual_seed(5)
    args = [torch.randn(*s, device=device, dtype=torch.float64, requires_grad=True)
            for s in ((3, 7), (7, 2), (2, 5), (5,))]
    assert torch.autograd.gradcheck(thin_pair_train, tuple(args))
    assert torch.autograd.gradcheck(lambda x, a, b: thin_pair_train(x, a, b, None), tuple(args[:3]))
    assert torch.autograd.gradcheck(lambda a, b: thin_pair_train(args[0].detach(), a, b), tuple(args[1:3]))
    torch.library.opcheck(thin_pair_kept, tuple(t.detach() for t in args))


# ---------------------------------------------------------------- activation epilogues
_REFERENCE_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu}


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float64, 1e-10), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("activation", sorted(_REFERENCE_ACTIVATIONS))
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_activation_epilogue_is_the_pair_then_the_activation(device, dtype, tol, activation, with_bias):
    """``act(x A B + bias)`` in one launch, its backward launch forming ``dy * act'(pre)``
    from the kept middle: output and every gradient against float64 PyTorch, with and
    without ``dx`` (no ``dx``: the derivative in PyTorch ops). A 16-bit ReLU's kink is
    where the kernel's own output says (the reference's float64 ``pre`` may round to the
    other side)."""
    torch.manual_seed(11)
    x = torch.randn(37, 50, device=device, dtype=dtype, requires_grad=True)
    a = torch.randn(50, 7, device=device, dtype=dtype, requires_grad=True)
    b = (0.3 * torch.randn(7, 45, device=device, dtype=dtype)).requires_grad_()
    bias = torch.randn(45, device=device, dtype=dtype, requires_grad=True) if with_bias else None
    inputs = (x, a, b) + ((bias,) if with_bias else ())
    y = thin_pair_train(x, a, b, bias, activation)
    pre = x.double() @ (a.double() @ b.double()) + (bias.double() if with_bias else 0)
    ref = pre * (y.detach() > 0) if activation == "relu" else _REFERENCE_ACTIVATIONS[activation](pre)
    scale = ref.abs().max()
    torch.testing.assert_close(y.double() / scale, ref / scale, rtol=tol, atol=tol)
    dy = torch.randn_like(y)
    want = torch.autograd.grad(ref, inputs, dy.double())
    for got, skip in ((torch.autograd.grad(y, inputs, dy), 0),
                      (torch.autograd.grad(thin_pair_train(x.detach(), a, b, bias, activation), inputs[1:], dy), 1)):
        for g, w, name in zip(got, want[skip:], ("x", "a", "b", "bias")[skip:]):
            s = w.abs().max()
            torch.testing.assert_close(g.double() / s, w.double() / s, rtol=tol, atol=tol, msg=name)


def test_the_activation_epilogue_gradchecks_and_its_ops_register(device):
    from tncompile.runtime.triton import thin_pair_activation_grad
    torch.manual_seed(12)
    args = [torch.randn(*s, device=device, dtype=torch.float64, requires_grad=True)
            for s in ((5, 6), (6, 3), (3, 4), (4,))]
    for activation in _REFERENCE_ACTIVATIONS:
        assert torch.autograd.gradcheck(lambda *t: thin_pair_train(*t, activation=activation), tuple(args))
    x, a, b, bias = (t.detach() for t in args)
    torch.library.opcheck(thin_pair_kept, (x, a, b, bias, 1))
    kept = torch.cat([x @ a, x.new_ones(5, 1)], 1)
    torch.library.opcheck(thin_pair_activation_grad, (torch.randn_like(x @ a @ b), b.t(), a.t(), kept, b, bias, 2))
    with pytest.raises(ValueError, match="unknown activation 'swish'.*gelu"):
        thin_pair_train(x, a, b, bias, "swish")


@pytest.mark.parametrize("activation", [torch.nn.GELU(), torch.nn.GELU(approximate="tanh"), torch.nn.ReLU()],
                         ids=["gelu", "gelu_tanh", "relu"])
def test_a_feed_forward_block_folds_its_activation_into_the_first_launch(device, activation, monkeypatch):
    """A compiled ``Linear -> act -> Linear`` block under ``tuning.TRITON_KERNELS``: the
    activation runs in the first TT linear's launches (its backward launch runs, with the
    activation's code), and output and gradients are the default path's."""
    import copy
    import warnings
    import tncompile
    from tncompile import tuning
    import importlib
    thin_pair_module = importlib.import_module("tncompile.runtime.triton.thin_pair")   # the package exports the op
    torch.manual_seed(13)
    block = torch.nn.Sequential(torch.nn.Linear(64, 160), activation, torch.nn.Linear(160, 48))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        base = tncompile.compile(block, target_ratio=0.4).to(device).double()
    x = torch.randn(2, 10, 64, device=device, dtype=torch.float64, requires_grad=True)
    results, calls, real = [], [], thin_pair_module._activation_grad
    monkeypatch.setattr(thin_pair_module, "_activation_grad", lambda *a: calls.append(a[-1]) or real(*a))
    for triton_on in (False, True):
        model = copy.deepcopy(base)
        monkeypatch.setattr(tuning, "TRITON_KERNELS", triton_on)
        calls.clear()
        y = model(x)
        grads = torch.autograd.grad(y.square().sum(), [x, *model.parameters()])
        assert calls == ([thin_pair_module.ACTIVATIONS[_name(activation)]] if triton_on else [])
        results.append((y.detach(), grads))
    (y_ref, g_ref), (y, g) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(g, g_ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_torch_compile_runs_the_triton_ops_in_one_graph(device, monkeypatch):
    """``torch.compile(model, fullgraph=True)`` under ``tuning.TRITON_KERNELS``: the thin pair
    and the activation epilogue are opaque ops in the compiled graph (their fake kernels
    trace it; their registered backwards run), and the step equals the eager default path."""
    import copy
    import warnings
    import tncompile
    from tncompile import tuning
    from torch.profiler import profile
    torch.manual_seed(14)
    block = torch.nn.Sequential(torch.nn.Linear(64, 160), torch.nn.GELU(), torch.nn.Linear(160, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 48))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        base = tncompile.compile(block, target_ratio=0.4).to(device)
    x = torch.randn(2, 10, 64, device=device, requires_grad=True)

    def step(model):
        y = model(x)
        return y.detach(), torch.autograd.grad(y.square().sum(), [x, *model.parameters()])

    y_ref, g_ref = step(copy.deepcopy(base))
    monkeypatch.setattr(tuning, "TRITON_KERNELS", True)
    compiled = torch.compile(copy.deepcopy(base), fullgraph=True)
    step(compiled)
    with profile() as prof:
        y, g = step(compiled)
    ran = {e.name for e in prof.events()}
    assert {"tncompile::thin_pair_kept", "tncompile::thin_pair_activation_grad"} <= ran, sorted(ran)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    for got, want in zip(g, g_ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _name(activation: torch.nn.Module) -> str:
    if isinstance(activation, torch.nn.ReLU):
        return "relu"
    return "gelu_tanh" if activation.approximate == "tanh" else "gelu"


# ---------------------------------------------------------------- the batched merge
def _merge_case(n, in_modes, out_modes, ranks_of, device, dtype, equal):
    """``n`` networks' cores and gates, stacked as factor_groups stacks them, the plan, and
    each network's factors and gradients by ``tt_factors`` under autograd."""
    from tncompile.runtime.kernels.factor_batch import FactorBatch
    modes = [*in_modes, *out_modes]
    d = len(modes)
    nets = []
    for m in range(n):
        rk = [1, *ranks_of(m), 1]
        cores = [torch.randn(rk[k], modes[k], rk[k + 1], device=device, dtype=dtype, requires_grad=True)
                 for k in range(d)]
        gates = [torch.rand(rk[k + 1], device=device, dtype=dtype, requires_grad=True) for k in range(d - 1)]
        nets.append((cores, gates))
    batch = FactorBatch(len(in_modes), [[tuple(c.shape) for c in cs] for cs, _ in nets],
                        [[tuple(g.shape) for g in gs] for _, gs in nets])
    assert batch.params.equal == equal
    return batch, nets


@pytest.mark.parametrize("in_modes, out_modes", [((4, 5, 3), (3, 4, 6)), ((4, 5), (3, 4)),
                                                 ((2, 3, 2, 2), (3, 2)), ((2, 3), (3, 2, 2, 2)),
                                                 ((4, 5, 3), (6,)), ((7,), (3, 4)), ((5,), (6,))])
@pytest.mark.parametrize("equal", [True, False], ids=["equal-ranks", "padded-ranks"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_the_batched_merge_is_tt_factors_of_the_gated_cores(device, in_modes, out_modes, equal, dtype, tol):
    """Every network's A and B, and every core's and gate's gradient, from the merge's few
    launches: against ``tt_factors`` of its own gated cores under autograd, ranks equal
    (stacked network after network) or not (zero-padded, stacked position after position),
    sides of one core (its factor a gated copy) included."""
    from tncompile.formats.factorization import tt_factors
    from tncompile.runtime.triton.batched_factors import TritonFactors
    torch.manual_seed(6)
    bonds = len(in_modes) + len(out_modes) - 1
    batch, nets = _merge_case(3, in_modes, out_modes,
                              (lambda m: [3 + (k % 3) for k in range(bonds)]) if equal else
                              (lambda m: [2 + (k + m) % 4 for k in range(bonds)]), device, dtype, equal)
    tensors = [t for cores, gates in nets for t in (*cores, *gates)]
    out = TritonFactors.apply((batch,), *tensors)
    n = batch.n
    d_out = [torch.randn_like(f) for f in out]
    got = torch.autograd.grad(out, tensors, d_out)
    for m, (cores, gates) in enumerate(nets):
        a, b = tt_factors([c * g for c, g in zip(cores[:-1], gates)] + [cores[-1]], len(in_modes))
        s = max(a.abs().max(), b.abs().max())
        torch.testing.assert_close(out[m] / s, a / s, rtol=tol, atol=tol)
        torch.testing.assert_close(out[n + m] / s, b / s, rtol=tol, atol=tol)
        want = torch.autograd.grad((a * d_out[m]).sum() + (b * d_out[n + m]).sum(), [*cores, *gates])
        mine = got[m * len(want):(m + 1) * len(want)]
        for k, (g, w) in enumerate(zip(mine, want)):
            torch.testing.assert_close(g / w.abs().max(), w / w.abs().max(), rtol=tol, atol=tol, msg=f"net {m} #{k}")


def test_batches_of_different_layouts_merge_together_in_one_launch_per_step(device, monkeypatch):
    """A model's batches of different modes, core counts and rank patterns merged by one
    joint plan: as many launches as the deepest batch needs (here 2 + 4 cores: 3 forward,
    3 backward and the gates' finish), every network's factors and gradients those of
    ``tt_factors``; a batch none of whose factors is used gets no gradient."""
    from tncompile.formats.factorization import tt_factors
    from tncompile.runtime.triton.batched_factors import TritonFactors, merge_key
    from tncompile.runtime.triton import merge_factors
    torch.manual_seed(9)
    cases = [(((4, 5, 3), (3, 4, 6)), True, lambda m: [3, 4, 5, 4, 3]),
             (((7,), (3, 4)), False, lambda m: [2 + m, 3]),
             (((2, 3), (3, 2, 2, 2)), True, lambda m: [2, 3, 3, 2, 2]),
             (((5,), (6,)), True, lambda m: [4])]
    made = [_merge_case(2 + i % 2, *modes, ranks, device, torch.float64, equal)
            for i, (modes, equal, ranks) in enumerate(cases)]
    batches = tuple(b for b, _ in made)
    tensors = [t for _, nets in made for cores, gates in nets for t in (*cores, *gates)]
    launches = []
    real = merge_factors._launch_tasks
    monkeypatch.setattr(merge_factors, "_launch_tasks", lambda rows, *a: launches.append(len(rows)) or real(rows, *a))
    plans = [merge_factors.plan_of(merge_key(b)) for b in batches]
    out = TritonFactors.apply(batches, *tensors)
    assert len(launches) == max(len(p.forward) for p in plans) == 3 < sum(len(p.forward) for p in plans)
    start, used, want_out = 0, [], []
    for (batch, nets), (modes, _, _) in zip(made, cases):
        n = batch.n
        for m, (cores, gates) in enumerate(nets):
            a, b = tt_factors([c * g for c, g in zip(cores[:-1], gates)] + [cores[-1]], len(modes[0]))
            torch.testing.assert_close(out[start + m], a, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(out[start + n + m], b, rtol=1e-10, atol=1e-10)
            if batch is not batches[2]:        # batch 2's factors go unused
                used += [(out[start + m], a), (out[start + n + m], b)]
        start += 2 * n
    d_out = [torch.randn_like(f) for f, _ in used]
    got = torch.autograd.grad([f for f, _ in used], tensors, d_out, allow_unused=True)
    assert len(launches) == 3 + max(len(p.backward) for p in plans) == 6   # + the gates' finish, one launch
    want = torch.autograd.grad([a for _, a in used], tensors, d_out, allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    unused = {id(t) for cores, gates in made[2][1] for t in (*cores, *gates)}
    assert all(g is None for t, g in zip(tensors, got) if id(t) in unused)


def test_an_unused_factor_gives_its_cores_no_gradient(device):
    """As the PyTorch merge: a network whose B went unused gets None for its output cores and
    gates, not zeros; a network whose factors both went unused gets None throughout."""
    from tncompile.runtime.triton.batched_factors import TritonFactors
    torch.manual_seed(7)
    batch, nets = _merge_case(2, (4, 5), (3, 4), lambda m: [3, 4, 3], device, torch.float64, True)
    tensors = [t for cores, gates in nets for t in (*cores, *gates)]
    out = TritonFactors.apply((batch,), *tensors)
    out[0].sum().backward()               # network 0's A only
    (c0, g0), (c1, g1) = nets
    assert c0[0].grad is not None and c0[1].grad is not None and g0[0].grad is not None and g0[1].grad is not None
    assert c0[2].grad is None and c0[3].grad is None and g0[2].grad is None
    assert all(t.grad is None for t in (*c1, *g1))


def test_tt_layers_train_the_same_on_the_triton_kernels(device, monkeypatch):
    """A compiled model's training step with ``tuning.TRITON_KERNELS``: the thin pair per layer
    and the batched merge per family give the outputs and every gradient of the default
    path, before and after rank cuts leave each layer its own ranks (padded batches)."""
    import copy
    import warnings
    import tncompile
    from tncompile import tuning
    from tncompile.runtime.triton import batched_factors as factor_groups
    from tncompile.passes import replan_module
    from tncompile.passes.truncate_ranks import cut_ranks
    from tncompile.testing import mlp
    torch.manual_seed(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        base = tncompile.compile(mlp((64, 128, 128, 128, 10)), target_ratio=0.4).to(device).double()
    x = torch.randn(20, 64, device=device, dtype=torch.float64)

    def step(model, triton_on):
        monkeypatch.setattr(tuning, "TRITON_KERNELS", triton_on)
        model.zero_grad(set_to_none=True)
        y = model(x)
        y.square().sum().backward()
        return y.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    merges = []
    real = factor_groups.TritonFactors.apply
    monkeypatch.setattr(factor_groups.TritonFactors, "apply", lambda *a: merges.append(1) or real(*a))
    for cut in (False, True):
        model = copy.deepcopy(base)
        if cut:
            for i, layer in enumerate(m for m in model.modules() if isinstance(m, TTLinear)):
                cut_ranks(layer, [torch.arange(max(1, r - 1 - (i + k) % 3)) for k, r in enumerate(layer.layout.ranks)])
                replan_module(layer)
        y_ref, g_ref = step(model, False)
        before = len(merges)
        y, g = step(model, True)
        assert len(merges) > before, "the Triton merge did not run"
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        assert g.keys() == g_ref.keys()
        for name in g:
            torch.testing.assert_close(g[name], g_ref[name], rtol=1e-9, atol=1e-10, msg=name)


# ---------------------------------------------------------------- TTM lookups
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("cores", [3, 4])
def test_ttm_lookups_on_the_triton_kernels_are_the_table_rows(device, padding_idx, cores, monkeypatch):
    """``tuning.TRITON_KERNELS``: a TTM embedding's rows from its halves merged in one launch
    and gathered in one, against the dense table (the network's own matrix); gradients of
    every core and gate against the PyTorch path's, repeated ids summed, the padding
    row's positions sending none."""
    from tncompile import tuning
    from tncompile.runtime import TTMEmbedding
    from tncompile.runtime.triton import lookup_function as tt_layers
    torch.manual_seed(9)
    layer = TTMEmbedding.from_embedding(torch.nn.Embedding(1000, 48, padding_idx=padding_idx), rank=6,
                                        num_cores=cores).to(device).double()
    ids = torch.randint(0, 1000, (4, 40), device=device)
    ids[0, :5], ids[1, :30] = 3, 7
    dy = torch.randn(4, 40, 48, device=device, dtype=torch.float64)

    def step(triton_on):
        monkeypatch.setattr(tuning, "TRITON_KERNELS", triton_on)
        layer.zero_grad(set_to_none=True)
        y = layer(ids)
        (y * dy).sum().backward()
        return y.detach(), [p.grad.clone() for p in layer.parameters()]

    calls = []
    real = tt_layers.TritonLookup.apply
    monkeypatch.setattr(tt_layers.TritonLookup, "apply", lambda *a: calls.append(1) or real(*a))
    y_ref, g_ref = step(False)
    y, g = step(True)
    assert calls, "the Triton lookup did not run"
    torch.testing.assert_close(y, layer.weight()[ids], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(g, g_ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_the_lookup_and_merge_ops_register(device):
    """The gather, scatter and merge ops' schemas, fake kernels and mutation (``opcheck``)."""
    from tncompile.runtime.triton.ttm_lookup import lookup_table, ttm_gather_op, ttm_scatter_op
    torch.manual_seed(10)
    row_modes, col_modes, split = (4, 5, 3, 2), (2, 3, 2, 4), 2
    a = torch.randn(4 * 2 * 5 * 3, 6, device=device, dtype=torch.float64)
    b = torch.randn(6, 3 * 2 * 2 * 4, device=device, dtype=torch.float64)
    ids = torch.tensor([0, 5, 119, 5, 33], device=device)
    table = lookup_table(row_modes, col_modes, split, ids)
    torch.library.opcheck(ttm_gather_op, (a, b, ids, table, split, 6, 8))
    dout = torch.randn(5, 48, device=device, dtype=torch.float64)
    torch.library.opcheck(ttm_scatter_op, (torch.zeros_like(a), torch.zeros_like(b), a, b, ids, table, dout, split,
                                           6, 8, 5))
    from tncompile.runtime.triton.merge_factors import merge_backward_op, merge_forward_op, merge_plan
    cores = [(1, 8, 3), (3, 15, 6), (6, 6, 4), (4, 8, 1)]
    sizes = [a_ * b_ * c_ for a_, b_, c_ in cores] + [3, 6, 4]
    key, plan = merge_plan(2, 2, cores, [(sum(sizes[:p]), sum(sizes)) for p in range(7)], 2 * sum(sizes))
    work = torch.randn(plan.work_size, device=device, dtype=torch.float64)
    torch.library.opcheck(merge_forward_op, (work, key))
    torch.library.opcheck(merge_backward_op, (torch.randn(plan.grad_size, device=device, dtype=torch.float64), work,
                                              key))


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 48)
        self.up, self.down = torch.nn.Linear(48, 96), torch.nn.Linear(96, 48)
        self.up2, self.down2 = torch.nn.Linear(48, 96), torch.nn.Linear(96, 48)
        self.head = torch.nn.Linear(48, 5)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.down2(torch.relu(self.up2(h)))
        return self.head(h.mean(1))


def test_a_dry_run_on_the_triton_kernels_captures_and_leaves_no_fake_state(monkeypatch):
    """``dry_run`` (fake device copies) through the Triton ops' fake kernels: capturable, and
    what the ops keep per device (task and digit tables) is never a fake tensor -- a real step
    after it runs and matches the PyTorch path."""
    import warnings
    import torch.nn.functional as F
    import tncompile
    from tncompile import tuning
    from tncompile.runtime.triton import batched_factors as factor_groups
    from tncompile.runtime.triton import lookup_function as tt_layers
    from tncompile.train import dry_run
    torch.manual_seed(11)
    ids, y = torch.randint(0, 1000, (3, 10)), torch.randint(0, 5, (3,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(_TinyLM(), target_ratio=0.5, example_inputs=(ids,), embedding_cores=4)
    assert any(isinstance(m, TTLinear) for m in compiled.modules())
    calls = []
    for owner, name in ((tt_layers.TritonLookup, "apply"), (factor_groups.TritonFactors, "apply")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, tag=owner.__name__: calls.append(tag) or real(*a))
    monkeypatch.setattr(tuning, "TRITON_KERNELS", True)
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = dry_run(compiled, opt, F.cross_entropy, ids, y)
    assert report.ok, str(report)
    assert {"TritonLookup", "TritonFactors"} <= set(calls), calls
    loss = F.cross_entropy(compiled(ids), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in compiled.named_parameters()}
    monkeypatch.setattr(tuning, "TRITON_KERNELS", False)
    compiled.zero_grad(set_to_none=True)
    F.cross_entropy(compiled(ids), y).backward()
    for n, p in compiled.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("programs", [1, 256])
def test_the_thin_pair_splits_columns_among_programs_only_when_rows_are_few(device, programs, monkeypatch):
    """``PROGRAMS``: with few row blocks a launch splits y's columns among programs too
    (each forms its rows' middle again; only the first keeps it); with many, one program
    per row block. Both give the product and the kept middle."""
    import importlib
    module = importlib.import_module("tncompile.runtime.triton.thin_pair")
    monkeypatch.setattr(module, "PROGRAMS", programs)
    torch.manual_seed(12)
    x = torch.randn(70, 40, device=device, dtype=torch.float64)
    a, b = torch.randn(40, 5, device=device, dtype=torch.float64), torch.randn(5, 150, device=device, dtype=torch.float64)
    bias = torch.randn(150, device=device, dtype=torch.float64)
    y, t1 = thin_pair_kept(x, a, b, bias)
    torch.testing.assert_close(y, x @ a @ b + bias, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t1, torch.cat([x @ a, torch.ones(70, 1, device=device, dtype=torch.float64)], 1))
