"""Merged factors of many TT linears in one batched pass (tncompile.runtime.layers.factor_groups)."""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import tncompile
from tncompile import tuning
from tncompile.formats import TTLayout
from tncompile.formats.factorization import tt_factors
from tncompile.formats.indices import BATCH, planner_problem
from tncompile.passes import replan_module
from tncompile.passes.truncate_ranks import cut_ranks
from tncompile.planning import REFERENCE, DeviceSpeed, layer_step_seconds, plan_contraction
from tncompile.runtime import TTLinear
from tncompile.runtime.kernels import executor
from tncompile.runtime.kernels.executor import is_merge_first
from tncompile.runtime.layers.factor_groups import BatchedFactors, FactorBatch, peers_of
from tncompile.runtime.layers.factor_links import link_factor_groups
from tncompile.runtime.ways.linear import _runs_whole

f64 = torch.float64


def _networks(n, in_modes, out_modes, ranks, dtype=f64, seed=0):
    """``n`` TT linears of one layout with random cores and non-trivial gates."""
    g = torch.Generator().manual_seed(seed)
    lay = TTLayout(in_modes=in_modes, out_modes=out_modes, ranks=ranks)
    layers = []
    for _ in range(n):
        layer = TTLinear(lay, bias=True, dtype=dtype)
        with torch.no_grad():
            for c in layer.cores:
                c.copy_(torch.randn(c.shape, generator=g, dtype=dtype))
            for gate in layer.gates:
                gate.uniform_(0.5, 1.5, generator=g)
        layers.append(layer)
    return layers


def _flat(layers):
    return [t for m in layers for group in (list(m.cores), list(m.gates)) for t in group]


LAYOUTS = [((2, 3), (3, 2), (2, 3, 2)),        # two cores a side
           ((4,), (2, 3), (3, 2)),               # A is the first core alone
           ((2, 2), (5,), (3, 2)),               # B is the last core alone
           ((2, 3, 2), (2, 2, 3), (2, 3, 4, 3, 2))]


@pytest.mark.parametrize("in_modes,out_modes,ranks", LAYOUTS)
def test_batched_factors_equal_each_networks_own(in_modes, out_modes, ranks):
    layers = _networks(3, in_modes, out_modes, ranks)
    out = BatchedFactors.apply(FactorBatch.of(layers), False, *_flat(layers))
    for m, layer in enumerate(layers):
        a, b = tt_factors(layer.scaled_cores(), len(in_modes))
        torch.testing.assert_close(out[m], a)
        torch.testing.assert_close(out[3 + m], b)
    # gradients of every core and gate, against autograd through the plain merge
    weights = [torch.randn(o.shape, dtype=f64) for o in out]
    sum((o * w).sum() for o, w in zip(out, weights)).backward()
    got = [t.grad.clone() for t in _flat(layers)]
    for t in _flat(layers):
        t.grad = None
    plain = [tt_factors(layer.scaled_cores(), len(in_modes)) for layer in layers]
    sum((f * w).sum() for f, w in zip([p[0] for p in plain] + [p[1] for p in plain], weights)).backward()
    for g, t in zip(got, _flat(layers)):
        torch.testing.assert_close(g, t.grad)


@pytest.mark.parametrize("in_modes,out_modes,ranks", LAYOUTS[:3])
def test_batched_factors_gradcheck(in_modes, out_modes, ranks):
    layers = _networks(2, in_modes, out_modes, ranks)
    batch = FactorBatch.of(layers)
    tensors = [t.detach().clone().requires_grad_() for t in _flat(layers)]
    assert torch.autograd.gradcheck(lambda *ts: BatchedFactors.apply(batch, False, *ts), tensors)


def _mixed(in_modes, out_modes, rank_sets, seed=1):
    """One network per ranks in ``rank_sets`` (same modes), random cores and gates."""
    return [_networks(1, in_modes, out_modes, ranks, seed=seed + i)[0] for i, ranks in enumerate(rank_sets)]


@pytest.fixture(autouse=True)
def prior_ways(monkeypatch):
    """These tests check how layers batch their merges where the cost model's prior runs
    them from merged factors (plans that merge cores first); which way is measured fastest
    is tests/test_measured_ways.py's."""
    monkeypatch.setattr(tuning, "MEASURE_WAYS", False)


@pytest.fixture(params=["copies", "index"])
def packing(request, monkeypatch):
    """Both ways padded batches pack and unpack: one copy per tensor (the CPU's) and
    index scatters and gathers (an accelerator's), forced here on the CPU."""
    from tncompile.runtime.kernels import factor_batch  # noqa: PLC0415
    monkeypatch.setattr(factor_batch, "_by_index", lambda device: request.param == "index")
    return request.param


MIXED = [((2, 3), (3, 2), [(2, 3, 2), (3, 1, 2), (1, 3, 3)]),     # every bond differs somewhere
         ((4,), (2, 3), [(3, 2), (2, 2), (3, 1)]),                  # A the first core alone
         ((2, 2), (5,), [(3, 2), (1, 2), (3, 3)]),                  # B the last core alone
         ((2, 3, 2), (2, 2, 3), [(2, 3, 4, 3, 2), (2, 2, 4, 1, 2)])]


@pytest.mark.parametrize("in_modes,out_modes,rank_sets", MIXED)
def test_padded_batch_of_different_ranks_equals_each_networks_own(in_modes, out_modes, rank_sets, packing):
    layers = _mixed(in_modes, out_modes, rank_sets)
    batch = FactorBatch.of(layers)
    assert batch.waste() > 1.0
    out = BatchedFactors.apply(batch, False, *_flat(layers))
    n = len(layers)
    plain = [tt_factors(layer.scaled_cores(), len(in_modes)) for layer in layers]
    for m in range(n):
        assert out[m].shape == plain[m][0].shape and out[n + m].shape == plain[m][1].shape
        torch.testing.assert_close(out[m], plain[m][0])
        torch.testing.assert_close(out[n + m], plain[m][1])
    weights = [torch.randn(o.shape, dtype=f64) for o in out]
    sum((o * w).sum() for o, w in zip(out, weights)).backward()
    got = [t.grad.clone() for t in _flat(layers)]
    for t in _flat(layers):
        t.grad = None
    sum((f * w).sum() for f, w in zip([p[0] for p in plain] + [p[1] for p in plain], weights)).backward()
    for g, t in zip(got, _flat(layers)):
        assert g.shape == t.shape
        torch.testing.assert_close(g, t.grad)


@pytest.mark.parametrize("in_modes,out_modes,rank_sets", MIXED[:3])
def test_padded_batch_gradcheck(in_modes, out_modes, rank_sets, packing):
    layers = _mixed(in_modes, out_modes, rank_sets)
    batch = FactorBatch.of(layers)
    tensors = [t.detach().clone().requires_grad_() for t in _flat(layers)]
    assert torch.autograd.gradcheck(lambda *ts: BatchedFactors.apply(batch, False, *ts), tensors)


def test_padded_batch_with_unused_factors_gives_no_gradient(packing):
    layers = _mixed((2, 3), (3, 2), [(2, 3, 2), (3, 1, 2), (1, 3, 3)])
    out = BatchedFactors.apply(FactorBatch.of(layers), False, *_flat(layers))
    (out[1].sum() + out[3 + 2].sum()).backward()  # A of the second, B of the third
    assert all(t.grad is not None for t in [*layers[1].cores[:2], *layers[1].gates[:1]])
    assert all(t.grad is None for t in _flat(layers[:1]))
    assert all(t.grad is None for t in layers[1].cores[2:])
    assert layers[2].cores[-1].grad is not None and layers[2].cores[0].grad is None


def test_families_split_where_padding_would_pass_the_limit(monkeypatch):
    """Four networks at rank 2 and one at 12 of one family: padded to 12 all five would
    hold 4.3x their own elements (limit 3), so the big one takes two small ones (2.8x)
    and the other two batch on their own; at a loose limit all five batch together."""
    from tncompile.runtime.layers.factor_groups import _batches  # noqa: PLC0415
    layers = _mixed((4, 4), (4, 4), [(2, 2, 2)] * 4 + [(12, 12, 12)])
    assert FactorBatch.of(layers).waste() > tuning.FACTOR_PAD_LIMIT
    assert _batches(layers) == [[layers[0], layers[1], layers[4]], [layers[2], layers[3]]]  # model order kept
    monkeypatch.setattr(tuning, "FACTOR_PAD_LIMIT", 100.0)
    assert _batches(layers) == [layers]
    monkeypatch.setattr(tuning, "FACTOR_PAD_LIMIT", 1.0)
    assert _batches(layers) == [layers[:4]]


def test_factors_used_by_some_networks_only_give_the_others_no_gradient():
    layers = _networks(3, (2, 3), (3, 2), (2, 3, 2))
    out = BatchedFactors.apply(FactorBatch.of(layers), False, *_flat(layers))
    (out[0].sum() + out[3 + 2].sum()).backward()  # A of the first, B of the last
    assert all(t.grad is not None for t in [*layers[0].cores[:2], *layers[0].gates[:1]])
    assert all(t.grad is None for t in _flat(layers[1:2]))   # unused: None, not zeros
    assert all(t.grad is None for t in layers[0].cores[2:])  # its B was not used either
    assert layers[2].cores[-1].grad is not None


class _Stack(nn.Module):
    """Four 96x96 linears (one layout) and a 96->48 head; ``shared`` runs one layer twice."""

    def __init__(self, shared=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(96, 96) for _ in range(4))
        self.head = nn.Linear(96, 48)
        self.shared = shared

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        if self.shared:
            x = torch.relu(self.layers[0](x))
        return self.head(x)


def _compiled(shared=False, mode="graph", dtype=f64, rows=300):
    torch.manual_seed(0)
    model = _Stack(shared).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    # rank_pattern pins every rank: the four hidden layers share one layout
    compiled = tncompile.compile(model, target_ratio=0.6, example_inputs=(x,), mode=mode,
                                 rank_pattern={"re:.*": 6}, init="random")
    return compiled, x


@pytest.fixture
def batches(monkeypatch):
    """The network count of every :class:`BatchedFactors` call."""
    calls = []
    real = BatchedFactors.apply

    def counting(batch, *rest):
        calls.append(batch.n)
        return real(batch, *rest)
    monkeypatch.setattr(BatchedFactors, "apply", counting)
    return calls


def _tt_layers(model):
    return [m for m in model.modules() if isinstance(m, TTLinear)]


def _step(model, x, group: bool, monkeypatch):
    monkeypatch.setattr(tuning, "GROUP_FACTORS", group)
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().mean().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], msg=name)


@pytest.mark.parametrize("mode,fused", [("graph", True), ("graph", False), ("swap", False)])
def test_compiled_model_batches_one_layout_and_trains_as_without(mode, fused, monkeypatch, batches, call_spy):
    """Graph mode fuses the relu-separated pairs (the fused kernel takes the factors);
    unfused and in swap mode each layer runs ``x A B`` from its factors (``thin_pair``)."""
    if not fused:
        monkeypatch.setattr(tuning, "FUSE_MIN_ROWS", 1 << 40)
    pairs = call_spy(executor._ThinPair, 0)
    model, x = _compiled(mode=mode)
    layers = _tt_layers(model)
    assert len(layers) == 5 and peers_of(layers[0]) is not None
    assert all(peers_of(m) is peers_of(layers[0]) for m in layers)
    assert all(is_merge_first(m.plan_for(x.shape[0])) for m in layers)
    plain = _step(model, x, False, monkeypatch)
    assert batches == []
    grouped = _step(model, x, True, monkeypatch)
    assert batches == [4]  # the four hidden layers in one batch; the head merges its own
    assert len(pairs) == (1 if fused else 5)  # the head (merging its own factors) too
    _assert_same(grouped, plain)


def test_batching_cuts_the_dispatched_ops(monkeypatch):
    """What batching is for: each layer's dozen merging products and gate products
    become a few batched ones per layout (forward and backward)."""
    model, x = _compiled()

    def ops(group):
        monkeypatch.setattr(tuning, "GROUP_FACTORS", group)
        model(x).sum().backward()  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x).sum().backward()
        return sum(1 for e in prof.events() if e.name.startswith("aten::")
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    plain, grouped = ops(False), ops(True)
    assert grouped < 0.8 * plain, (grouped, plain)


def test_layer_called_twice_and_two_forwards_before_backward(monkeypatch):
    model, x = _compiled(shared=True)
    _assert_same(_step(model, x, True, monkeypatch), _step(model, x, False, monkeypatch))

    def accumulated(group):  # gradient accumulation: two forwards, then their backward passes
        monkeypatch.setattr(tuning, "GROUP_FACTORS", group)
        model.zero_grad(set_to_none=True)
        first, second = model(x[:150]), model(x[150:])
        second.square().mean().backward()
        first.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    a, b = accumulated(True), accumulated(False)
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name)


def test_factors_are_never_used_after_the_weights_change(monkeypatch):
    """Factors left unused by one forward (the head only runs some layers) must not be
    taken after an optimizer step changed the cores, nor under another grad mode."""
    def train(group):
        monkeypatch.setattr(tuning, "GROUP_FACTORS", group)
        model, x = _compiled()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        layers = _tt_layers(model)
        for step in range(3):
            if step == 1:  # run one layer alone: the batch leaves the other three's factors waiting
                with torch.no_grad():
                    layers[0](x)
                layers[0](x).sum().backward()
                opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model(x).detach()
    torch.testing.assert_close(train(True), train(False))


def test_cut_layer_stays_in_its_batch_padded_and_all_still_match(monkeypatch, batches):
    """A cut gives one layer lower ranks: it keeps merging with the others (its cores
    zero-padded), and a cut far below them (padding past FACTOR_PAD_LIMIT) leaves the
    batch instead."""
    model, x = _compiled()
    layers = _tt_layers(model)
    keep = [torch.arange(r - 1 if i == 1 else r) for i, r in enumerate(layers[1].layout.ranks)]
    cut_ranks(layers[1], keep)
    replan_module(layers[1])
    grouped = _step(model, x, True, monkeypatch)
    assert batches == [4]
    _assert_same(grouped, _step(model, x, False, monkeypatch))
    batches.clear()
    monkeypatch.setattr(tuning, "FACTOR_PAD_LIMIT", 1.0)  # no padding allowed
    grouped = _step(model, x, True, monkeypatch)
    assert batches == [3]
    _assert_same(grouped, _step(model, x, False, monkeypatch))


def test_copies_and_files_batch_their_own_layers(tmp_path, monkeypatch):
    model, x = _compiled()
    _step(model, x, True, monkeypatch)  # leaves nothing behind that copies would share
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        mine, theirs = _tt_layers(model), _tt_layers(other)
        peers = peers_of(theirs[0])
        assert peers is not peers_of(mine[0]) and {id(m) for m in peers.layers} == {id(m) for m in theirs}
        assert all(peers_of(m) is peers for m in theirs)  # one set of peers, as in the original
        _assert_same(_step(other, x, True, monkeypatch), _step(model, x, True, monkeypatch))
        assert all(p.grad is not None for p in other.parameters())
    tncompile.save(model, tmp_path / "m.tnc")
    loaded = tncompile.load(tmp_path / "m.tnc", model=_Stack(False).to(f64))
    assert peers_of(_tt_layers(loaded)[0]) is not None
    _assert_same(_step(loaded, x, True, monkeypatch), _step(model, x, False, monkeypatch))


def test_not_under_torch_compile_tracing_or_when_off(monkeypatch):
    model, x = _compiled()
    layer = _tt_layers(model)[0]
    monkeypatch.setattr(tuning, "GROUP_FACTORS", False)
    assert peers_of(layer).factors(layer) is None
    monkeypatch.setattr(tuning, "GROUP_FACTORS", True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert peers_of(layer).factors(layer) is None


def test_link_replaces_earlier_links_and_skips_lone_layers():
    layers = _networks(2, (2, 3), (3, 2), (2, 3, 2))
    holder = nn.Sequential(*layers)
    first = link_factor_groups(holder)
    second = link_factor_groups(holder)
    assert first is not second and all(peers_of(m) is second for m in layers)
    lone = nn.Sequential(layers[0])
    assert link_factor_groups(lone) is None and peers_of(layers[0]) is None


def test_merge_first_detection():
    lay = TTLayout.for_shape(64, 64, 3).with_ranks(4)
    layer = TTLinear(lay)
    assert is_merge_first(layer.plan_for(4096))  # many rows: the cores are merged first
    inputs, output, sizes = planner_problem(lay, False)
    rows = {**sizes, BATCH: 4096}
    assert is_merge_first(plan_contraction(inputs, output, rows, batch=BATCH, strategies=["merge-cores-first"]))
    assert not is_merge_first(plan_contraction(inputs, output, rows, batch=BATCH, strategies=["left-to-right"]))


def test_speed_model_shares_the_merging_kernels_among_a_layouts_layers():
    from tncompile.planning import DeviceSpeed, layer_step_seconds  # noqa: PLC0415
    from tncompile.planning.speed_model import ROW_KERNELS, network_kernels  # noqa: PLC0415
    lay = TTLayout.for_shape(64, 64, 3).with_ranks(4)
    inputs, output, sizes = planner_problem(lay, False)
    rows = {**sizes, BATCH: 4096}
    merged = plan_contraction(inputs, output, rows, batch=BATCH, strategies=["merge-cores-first"])
    chain = plan_contraction(inputs, output, rows, batch=BATCH, strategies=["left-to-right"])
    assert network_kernels(merged, 1) == merged.kernels
    assert network_kernels(merged, 4) == ROW_KERNELS + (merged.kernels - ROW_KERNELS) / 4
    assert network_kernels(chain, 4) == chain.kernels  # nothing merged apart from the rows
    speed = DeviceSpeed("cpu", gemm_macs_per_s=1e11, copy_bytes_per_s=3e10, kernel_seconds=2e-5,
                        dense_call_seconds=5e-5)
    alone, dense = layer_step_seconds(lay, 4096, speed)
    shared, same_dense = layer_step_seconds(lay, 4096, speed, sharing=8)
    assert shared < alone and same_dense == dense


def test_report_counts_the_layers_that_share_a_layout(monkeypatch):
    model, _ = _compiled()
    rows = {r.name: r for r in model.report().rows}
    hidden, head = rows["layers.0"], rows["head"]
    monkeypatch.setattr(tuning, "GROUP_FACTORS", False)
    alone = {r.name: r for r in model.report().rows}
    assert hidden.time_now < alone["layers.0"].time_now  # four layers share its merging kernels
    assert head.time_now == alone["head"].time_now       # the head has no peer


@pytest.mark.parametrize("whole", [False, True])
def test_truncation_keeps_batching_and_trains_as_per_layer(whole, monkeypatch, packing):
    """RankController.truncate cuts each hidden layer to its own ranks (their gates'
    tails zeroed, a different number per layer): the layers keep merging in one padded
    batch, and training before and after the cut matches per-layer merges -- also as
    whole matrices (decided by a GPU's figures)."""
    seen = []
    real = BatchedFactors.apply

    def recording(batch, made_whole, *rest):
        seen.append((batch, made_whole))
        return real(batch, made_whole, *rest)
    monkeypatch.setattr(BatchedFactors, "apply", recording)
    if whole:
        monkeypatch.setattr(tuning, "DEVICE_SPEED", GPU_LIKE)

    def train(group):
        monkeypatch.setattr(tuning, "GROUP_FACTORS", group)
        torch.manual_seed(0)
        x, y = torch.randn(64, 96, dtype=f64), torch.randn(64, 48, dtype=f64)
        model = tncompile.compile(_Stack().to(f64), target_ratio=0.3, example_inputs=(x,), init="random")
        opt = torch.optim.AdamW(tncompile.param_groups(model, lr=2e-3, gate_lr=5e-2))
        ctl = tncompile.RankController(model, opt, target_ratio=0.2, truncate_every=0)
        step = tncompile.TrainStep(model, opt, lambda out, t: (out - t).square().mean(), controller=ctl)
        losses = [float(step(x, y)) for _ in range(3)]
        with torch.no_grad():
            for k, layer in enumerate(_tt_layers(model)):
                for g in layer.gates:
                    g[max(1, g.numel() - 1 - k):] = 0.0   # layer k loses k + 1 ranks per bond
        ctl.start_late_stage()
        assert ctl.truncate().truncated
        losses += [float(step(x, y)) for _ in range(3)]
        return losses, [m.layout.ranks for m in _tt_layers(model)]
    (grouped, ranks), (plain, plain_ranks) = train(True), train(False)
    assert ranks == plain_ranks and len(set(ranks[:4])) == 4
    assert any(not b.params.equal and b.n == 4 for b, _ in seen), "no padded batch of the four hidden layers"
    assert {made for _, made in seen} == {whole}
    torch.testing.assert_close(torch.tensor(grouped), torch.tensor(plain))


def test_mixed_dtype_networks_batch_at_equal_ranks_only():
    """Cores and gates of two dtypes cannot share one padded buffer: such a family
    batches only its equal-rank members, still matching the per-network merges."""
    from tncompile.runtime.layers.factor_groups import _batches  # noqa: PLC0415
    layers = _mixed((2, 3), (3, 2), [(2, 3, 2), (2, 3, 2), (3, 1, 2)])
    for layer in layers:
        for g in layer.gates:
            g.data = g.data.float()
    assert _batches(layers) == [layers[:2]]
    out = BatchedFactors.apply(FactorBatch.of(layers[:2]), False, *_flat(layers[:2]))
    for m, layer in enumerate(layers[:2]):
        torch.testing.assert_close(out[m], tt_factors(layer.scaled_cores(), 2)[0])


def test_layers_of_different_ranks_batch_in_a_compiled_model_and_report(monkeypatch, batches):
    """rank_pattern gives one hidden layer rank 4 and the rest 6: all four still merge in
    one batch, train as without batching, and the report counts them as sharing."""
    torch.manual_seed(0)
    x = torch.randn(300, 96, dtype=f64)
    model = tncompile.compile(_Stack().to(f64), target_ratio=0.6, example_inputs=(x,), mode="graph", init="random",
                              rank_pattern={"layers.1": 4, "re:.*": 6})
    ranks = [m.layout.ranks for m in _tt_layers(model)]
    assert ranks[1] != ranks[0] == ranks[2] == ranks[3]
    grouped = _step(model, x, True, monkeypatch)
    assert batches == [4]
    _assert_same(grouped, _step(model, x, False, monkeypatch))
    # layers.0 shares its merging kernels four ways, as when all four have one rank
    uniform, _ = _compiled()
    assert model.report().rows[0].name == "layers.0"
    assert model.report().rows[0].time_now == uniform.report().rows[0].time_now


def test_padded_batches_capture_safely_and_keep_no_fake_tensors(monkeypatch, batches):
    """A padded batch's ops pass the capture dry run (fake CUDA copies), and a batch run
    under FakeTensorMode keeps no fake index or template for the real calls after it."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    _dry_run_padded_stack()
    assert batches and set(batches) == {4}  # the dry run batched them (padded) in its fake copies

    from tncompile.runtime.kernels import factor_batch  # noqa: PLC0415
    monkeypatch.setattr(factor_batch, "_by_index", lambda device: True)  # the accelerators' way: cached indexes
    layers = _mixed((2, 3), (3, 2), [(2, 3, 2), (3, 1, 2), (1, 3, 3)])
    batch = FactorBatch.of(layers)
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t.detach()).requires_grad_() for t in _flat(layers)]
    with mode:
        out = BatchedFactors.apply(batch, False, *fake)
        sum(o.sum() for o in out).backward()
    assert not batch.params._cache
    out = BatchedFactors.apply(batch, False, *_flat(layers))
    sum(o.sum() for o in out).backward()
    for layer in layers:
        a, b = tt_factors(layer.scaled_cores(), 2)
        torch.testing.assert_close(out[layers.index(layer)], a)
    index = batch.params._cache[("index", torch.device("cpu"))]
    assert not type(index).__name__.startswith("Fake") and "templates" in batch.params._cache


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_merges_per_layer_and_matches(reentrant, monkeypatch, batches):
    from torch.utils.checkpoint import checkpoint  # noqa: PLC0415
    model, x = _compiled()
    x = x.requires_grad_()
    plain = _step(model, x, True, monkeypatch)
    assert batches == [4]
    model.zero_grad(set_to_none=True)
    y = checkpoint(model, x, use_reentrant=reentrant)
    y.square().mean().backward()
    # non-reentrant: the checkpointed forward and its recomputation record per-layer merges;
    # reentrant: the first forward runs without autograd (batched), the recomputation per layer
    assert batches == [4] * (2 if reentrant else 1)
    torch.testing.assert_close(y.detach(), plain[0])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[1][name], msg=name)


@pytest.mark.parametrize("whole", [False, True])
def test_bf16_autocast_batches_in_the_dtypes_each_layer_would(whole, monkeypatch, batches):
    model, x = _compiled(dtype=torch.float32)
    made: list[bool] = []
    monkeypatch.setattr(BatchedFactors, "apply", _recording_whole(BatchedFactors.apply, made))
    if whole:  # decided at each forward: a GPU's figures make the batch whole matrices
        monkeypatch.setattr(tuning, "DEVICE_SPEED", GPU_LIKE)

    def step(group):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _step(model, x, group, monkeypatch)
    grouped = step(True)
    assert batches == [4] and made == [whole]
    plain = step(False)
    exact = _step(model, x, False, monkeypatch)  # float32 throughout

    def close(got, want, truth, name):
        def err(t):   # relative error in norm (a max over elements is one rounding's luck)
            return ((t.float() - truth).norm() / truth.norm()).item()
        # the batch merges its cores in fp32 and casts the factors once (issue 55), then bf16
        # products of another association (x (A B), (x A) B, against the per-layer plan):
        # as far from float32 as the layers' own bf16 products, give or take one bf16 rounding
        # (2**-8 relative: a 6-entry gate gradient's error is a few roundings' luck)
        assert err(got) <= 1.5 * err(want) + 2 ** -8, f"{name}: {err(got):.3g} from float32 against {err(want):.3g}"
    close(grouped[0], plain[0], exact[0], "output")
    for name in plain[1]:
        assert grouped[1][name].dtype == torch.float32
        close(grouped[1][name], plain[1][name], exact[1][name], name)


@pytest.mark.parametrize("ratio", [0.15, 0.2, 0.25, 0.3])
def test_layers_of_one_shape_get_one_rank(ratio):
    """The allocator grows ranks class by class, so same-shaped layers keep one layout
    (one batch at run time) while the ratio stays within 10% below the target."""
    torch.manual_seed(0)
    model = _Stack()
    compiled = tncompile.compile(model, target_ratio=ratio, example_inputs=(torch.randn(300, 96),), init="random")
    hidden = {m.layout for m in _tt_layers(compiled) if m.in_features == m.out_features == 96}
    assert len(hidden) == 1
    assert 0.9 * ratio <= compiled.ratio <= ratio


def test_peers_refer_to_layers_weakly_and_drop_dead_ones():
    """Linking adds no reference from the layers back to themselves: a layer the model
    drops is freed, and the rest still batch."""
    import gc  # noqa: PLC0415
    layers = _networks(3, (2, 3), (3, 2), (2, 3, 2))
    holder = nn.ModuleList(layers)
    peers = link_factor_groups(holder)
    x = torch.randn(5, 6, dtype=f64)
    thin = [m.merged_factors() for m in layers]  # one batch of three
    del holder[2], layers[2], thin
    gc.collect()
    assert len(peers.layers) == 2
    for layer in layers:
        a, b = layer.merged_factors()
        want_a, want_b = tt_factors(layer.scaled_cores(), 2)
        torch.testing.assert_close(a, want_a)
        torch.testing.assert_close(x @ a @ b, x @ want_a @ want_b)


# ---------------------------------------------------------------- whole matrices

#: a GPU's figures as the speed model sees them: GEMMs fast, every kernel dear (the
#: fixed costs an H200 showed through an eager host; bench_device_speed --device cuda)
GPU_LIKE = DeviceSpeed(device="gpu-like (test)", gemm_macs_per_s=25e12, copy_bytes_per_s=2e12,
                       kernel_seconds=84e-6, dense_call_seconds=229e-6)


@pytest.mark.parametrize("in_modes,out_modes,rank_sets", [(i, o, [r, r]) for i, o, r in LAYOUTS] + MIXED)
def test_whole_matrices_are_the_products_of_the_batched_factors(in_modes, out_modes, rank_sets, packing):
    """``whole``: each network's ``A B`` (padded sizes), made in one batched product;
    its gradients reach every core and gate as autograd's through ``A @ B`` does, and a
    matrix not used gives its network none."""
    layers = _mixed(in_modes, out_modes, rank_sets)
    batch = FactorBatch.of(layers)
    out = BatchedFactors.apply(batch, True, *_flat(layers))
    plain = [tt_factors(layer.scaled_cores(), len(in_modes)) for layer in layers]
    assert len(out) == len(layers)
    for w, (a, b) in zip(out, plain):
        torch.testing.assert_close(w, a @ b)
    weights = [torch.randn(w.shape, dtype=f64) for w in out]
    sum((w * c).sum() for w, c in zip(out[1:], weights[1:])).backward()  # the first network's unused
    got = [t.grad for t in _flat(layers)]
    for t in _flat(layers):
        t.grad = None
    sum(((a @ b) * c).sum() for (a, b), c in zip(plain[1:], weights[1:])).backward()
    for g, t in zip(got, _flat(layers)):
        if t.grad is None:
            assert g is None
        else:
            torch.testing.assert_close(g, t.grad)
    assert all(t.grad is None for t in _flat(layers[:1]))


@pytest.mark.parametrize("in_modes,out_modes,rank_sets", [(i, o, [r, r]) for i, o, r in LAYOUTS[:3]] + MIXED[:2])
def test_whole_matrices_gradcheck(in_modes, out_modes, rank_sets):
    layers = _mixed(in_modes, out_modes, rank_sets)
    batch = FactorBatch.of(layers)
    tensors = [t.detach().clone().requires_grad_() for t in _flat(layers)]
    assert torch.autograd.gradcheck(lambda *ts: BatchedFactors.apply(batch, True, *ts), tensors)


def test_whole_matrix_pays_where_kernels_cost_more_than_the_arithmetic(monkeypatch):
    """The speed model's choice: small layers on a GPU-like device run through their whole
    matrix (three GEMMs a step, as dense), not two thin products (six); on the reference
    CPU the thin products' fewer multiply-adds win; a layer merging alone saves nothing."""
    from tncompile.planning.speed_model import whole_matrix_saving  # noqa: PLC0415
    small = TTLayout(in_modes=(4, 4, 8), out_modes=(4, 4, 8), ranks=(4, 16, 29, 29, 8))
    assert whole_matrix_saving(small, 2048, GPU_LIKE, sharing=9) > 0
    assert whole_matrix_saving(small, 2048, REFERENCE, sharing=9) < 0
    assert whole_matrix_saving(small, 2048, GPU_LIKE, sharing=1) == 0
    wide = TTLayout(in_modes=(8, 12, 8), out_modes=(8, 12, 8), ranks=(8, 20, 20, 20, 8))  # 768 -> 768
    assert whole_matrix_saving(wide, 128, GPU_LIKE, sharing=24) > 0      # batch 1 of the six-encoder
    assert whole_matrix_saving(wide, 4096 * 4, GPU_LIKE, sharing=24) < 0  # many rows: the arithmetic counts
    network, _ = layer_step_seconds(small, 2048, GPU_LIKE, sharing=9)
    monkeypatch.setattr(tuning, "GROUP_FACTORS", False)
    alone, _ = layer_step_seconds(small, 2048, GPU_LIKE, sharing=9)
    assert network < alone  # the estimate counts the path the layers run


@pytest.mark.parametrize("mode", ["graph", "swap"])
def test_layers_run_through_whole_matrices_where_the_device_speed_says_so(mode, monkeypatch):
    """With a GPU's figures the four hidden layers of one layout multiply by whole matrices
    made in one batched product -- outputs and gradients as their two thin products give --
    and run fewer GEMMs; with the CPU's they keep the thin products."""
    monkeypatch.setattr(tuning, "FUSE_MIN_ROWS", 1 << 40)  # graph mode: no fused feed-forward
    model, x = _compiled(mode=mode)
    made: list[bool] = []
    monkeypatch.setattr(BatchedFactors, "apply", _recording_whole(BatchedFactors.apply, made))

    def step(speed):
        monkeypatch.setattr(tuning, "DEVICE_SPEED", speed)
        made.clear()
        got = _step(model, x, True, monkeypatch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)
        return got, list(made), sum(e.name in ("aten::mm", "aten::addmm") for e in prof.events())
    thin, thin_made, thin_gemms = step(REFERENCE)
    whole, whole_made, whole_gemms = step(GPU_LIKE)
    assert thin_made == [False, False] and whole_made == [True, True]  # a batch per forward
    _assert_same(whole, thin)
    assert whole_gemms < thin_gemms


def _recording_whole(real, made):
    """``BatchedFactors.apply`` recording its ``whole`` argument in ``made``."""
    def apply(batch, whole, *tensors):
        made.append(whole)
        return real(batch, whole, *tensors)
    return apply


def test_whole_matrices_pass_the_capture_dry_run(monkeypatch, batches):
    """Whole matrices in a padded batch under the capture dry run (fake CUDA copies)."""
    monkeypatch.setattr(tuning, "DEVICE_SPEED", GPU_LIKE)
    monkeypatch.setattr(tuning, "FUSE_MIN_ROWS", 1 << 40)
    made: list[bool] = []
    monkeypatch.setattr(BatchedFactors, "apply", _recording_whole(BatchedFactors.apply, made))
    _dry_run_padded_stack()
    assert batches and set(batches) == {4} and set(made) == {True}


def _dry_run_padded_stack():
    """The capture dry run of a compiled :class:`_Stack` whose second layer has lower ranks
    (its four hidden layers: one padded batch); asserts it passes."""
    torch.manual_seed(0)
    x = torch.randn(300, 96)
    model = tncompile.compile(_Stack(), target_ratio=0.6, example_inputs=(x,), mode="graph", init="random",
                              rank_pattern={"layers.1": 4, "re:.*": 6})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = tncompile.dry_run(model, opt, lambda y, t: (y - t).square().mean(), x, torch.zeros(300, 48))
    assert report.ok, str(report)


def test_no_whole_matrices_while_a_cuda_graph_is_captured(monkeypatch):
    """The choice's fixed costs are an eager step's: a CUDA graph's capture keeps thin
    products (here the capture is simulated: CPU-only PyTorch has none)."""
    monkeypatch.setattr(tuning, "DEVICE_SPEED", GPU_LIKE)
    model, x = _compiled()
    layer = _tt_layers(model)[0]
    plan, cuda = layer.plan_for(x.shape[0]), torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert _runs_whole(layer, plan, cuda)
    capturing[0] = True
    assert not _runs_whole(layer, plan, cuda)
    capturing[0] = False
    monkeypatch.setattr(tuning, "WHOLE_MATRICES", False)
    assert not _runs_whole(layer, plan, cuda)
