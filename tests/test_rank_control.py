"""RankController: penalties, the late-stage switch, truncation, optimizer state, errors."""
import copy
import math

import pytest
import torch
from torch import nn

import tncompile
from tncompile.runtime import CollapsedLayer, TTLinear, TTMTiedLinear
from tncompile.passes import Replan, TruncateRanks
from tncompile.result.model_api import LATER_DUMP_DIR
from tncompile.testing import mlp, small_encoder

f64 = torch.float64


def _mlp_compiled(dtype=f64):
    model = mlp((64, 128, 64)).to(dtype)
    # prefer="size": the tests below need the model at its target, not capped further for speed
    return tncompile.compile(model, target_ratio=0.5, init="random", prefer="size")


def _zero_gate_entries(ctl, fraction=0.5):
    """Zero the last ``fraction`` of every gate; return kept index lists per layer."""
    kept = {}
    with torch.no_grad():
        for name, mod in ctl.layers.items():
            kept[name] = []
            for g in mod.gates:
                cut = max(1, int(g.numel() * (1 - fraction)))
                g[cut:] = 0.0
                kept[name].append(torch.arange(cut))
    return kept


def test_early_penalty_hand_computed():
    compiled = _mlp_compiled()
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.1, rank_weight=0.01, core_weight=1e-3)
    n_core = n_gate = 0
    with torch.no_grad():
        for mod in ctl.layers.values():
            for c in mod.cores:
                c.fill_(2.0)
                n_core += c.numel()
            for g in mod.gates:
                g.fill_(-0.5)  # |g| counts, not g
                n_gate += g.numel()
    pen = ctl.penalty(torch.tensor(3.0, dtype=f64))
    assert pen.item() == pytest.approx(0.01 * 0.5 + 1e-3 * 4.0 * n_core, rel=1e-12)
    assert ctl.stage == "early"


def test_hard_size_equals_size_after_truncation():
    compiled = _mlp_compiled()
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.05, truncate_every=0)
    _zero_gate_entries(ctl, 0.5)
    predicted = ctl.active_ratio()
    assert predicted < compiled.ratio
    ctl.truncate()
    assert compiled.ratio == pytest.approx(predicted, rel=1e-12)
    assert compiled.report().ratio == pytest.approx(predicted, rel=1e-12)


def _late_controller(target_ratio, target_loss):
    compiled = _mlp_compiled()
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=target_ratio, core_weight=0.0,
                                   target_loss=target_loss, schedule="comera")  # CoMERA's rule under test
    ctl.start_late_stage()
    return compiled, ctl


def test_late_stage_picks_the_objective_further_from_its_target():
    # size far from target (ratio ~0.5 vs 0.01: d_size = 49), task close (d_loss = 0.5): size term
    compiled, ctl = _late_controller(0.01, target_loss=1.0)
    task = torch.tensor(1.5, dtype=f64, requires_grad=True)
    layers = list(ctl.layers.values())
    widths = [[g.abs().sum() for g in m.gates] for m in layers]
    soft = sum(sum(a * n * b for a, n, b in zip([1, *w], m.layout.site_sizes, [*w, 1])) + sum(w)
               for m, w in zip(layers, widths))
    other = compiled.program.num_params() - sum(m.layout.num_params() for m in layers)
    expected_size = (soft + other) / compiled.program.original_params / 0.01
    total = task + ctl.penalty(task)
    assert total.detach().item() == pytest.approx(float(expected_size.detach()), rel=1e-12)
    assert not bool(ctl.last_choice)
    total.backward()
    assert task.grad.item() == 0.0  # no task gradient on a size step
    # task far from target (d_loss = 149), size close (ratio ~0.5 vs target 0.45): task loss
    compiled, ctl = _late_controller(0.45, target_loss=0.01)
    task = torch.tensor(1.5, dtype=f64, requires_grad=True)
    total = task + ctl.penalty(task)
    assert total.detach().item() == pytest.approx(1.5) and bool(ctl.last_choice)
    total.backward()
    assert task.grad.item() == 1.0
    # both under target (d_loss = -0.9 < d_size < 0): CoMERA's rule still pushes the size,
    # stop_at_target=True trains the task loss instead
    compiled, ctl = _late_controller(0.45, target_loss=15.0)
    _zero_gate_entries(ctl, 0.5)
    assert -0.9 < (ctl.active_ratio() - 0.45) / 0.45 < 0
    task = torch.tensor(1.5, dtype=f64, requires_grad=True)
    ctl.penalty(task)
    assert not bool(ctl.last_choice)
    ctl.stop_at_target = True
    total = task + ctl.penalty(task)
    assert bool(ctl.last_choice) and total.detach().item() == pytest.approx(1.5)


def test_stage_switch_and_default_target_is_smoothed_early_loss():
    compiled = _mlp_compiled()
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.1, early_steps=5, truncate_every=0)
    events = []
    for _ in range(6):
        ctl.penalty(torch.tensor(2.0, dtype=f64))
        events.append(ctl.step())
    assert [e.stage_changed for e in events] == [False] * 4 + [True, False]
    assert ctl.stage == "late" and events[4].changed and not events[4].shapes_changed
    assert ctl.target_loss.item() == pytest.approx(2.0, rel=1e-6)  # bias-corrected average


def test_penalty_never_syncs_with_the_host(monkeypatch):
    compiled = _mlp_compiled(torch.float32)
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.1)
    x = torch.randn(4, 64)

    def forbidden(*a, **k):
        raise AssertionError("host sync in penalty()")

    for stage in ("early", "late"):
        if stage == "late":
            ctl.start_late_stage()
        task = compiled(x).pow(2).mean()
        with monkeypatch.context() as m:
            for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
                m.setattr(torch.Tensor, name, forbidden)
            loss = task + ctl.penalty(task)
        loss.backward()


def test_truncation_keeps_the_function_exactly():
    compiled = _mlp_compiled()
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.05, truncate_every=3)
    x = torch.randn(7, 64, dtype=f64)
    _zero_gate_entries(ctl, 0.5)
    before_ranks = ctl.ranks()
    ref = compiled(x)
    assert not ctl.step().shapes_changed and not ctl.step()
    event = ctl.step()
    assert event.shapes_changed and set(event.truncated) == set(ctl.layers)
    for name, (old, new) in event.truncated.items():
        assert old == before_ranks[name]
        assert all(n == max(1, int(o * 0.5)) for o, n in zip(old, new))
    assert torch.allclose(compiled(x), ref, atol=1e-13, rtol=0)
    # nothing switched off: a second truncation changes nothing
    assert not ctl.truncate().shapes_changed


@pytest.mark.parametrize("make_opt", [
    lambda groups: torch.optim.Adam(groups, lr=1e-2),
    lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, amsgrad=True),
    lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9),
], ids=["adam", "adamw-amsgrad", "sgd-momentum"])
def test_optimizer_state_is_sliced_consistently(make_opt):
    """A step after truncation moves every kept entry exactly as the same step
    on the untruncated model (whose cut ranks contribute nothing)."""
    compiled = _mlp_compiled()
    opt = make_opt(tncompile.param_groups(compiled, lr=1e-2))
    x, y = torch.randn(16, 64, dtype=f64), torch.randn(16, 64, dtype=f64)

    def train_step(model, optimizer):
        optimizer.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        optimizer.step()

    for _ in range(3):
        train_step(compiled, opt)
    ctl_probe = tncompile.RankController(compiled, opt, target_ratio=0.05)
    kept = _zero_gate_entries(ctl_probe, 0.5)
    full, full_opt = compiled, opt
    cut, cut_opt = copy.deepcopy((compiled, opt))
    ctl = tncompile.RankController(cut, cut_opt, target_ratio=0.05, truncate_every=0)
    assert ctl.truncate().shapes_changed
    assert torch.allclose(cut(x), full(x), atol=1e-13, rtol=0)
    train_step(full, full_opt)
    train_step(cut, cut_opt)
    cut_layers = ctl.layers
    for name, mod in ctl_probe.layers.items():
        keep = kept[name]
        small = cut_layers[name]
        for k, (big_core, small_core) in enumerate(zip(mod.cores, small.cores)):
            sliced = big_core.detach()
            if k > 0:
                sliced = sliced.index_select(0, keep[k - 1])
            if k < len(keep):
                sliced = sliced.index_select(sliced.dim() - 1, keep[k])
            assert torch.allclose(sliced, small_core.detach(), atol=1e-14, rtol=0), (name, k)
        for k, (big_gate, small_gate) in enumerate(zip(mod.gates, small.gates)):
            assert torch.allclose(big_gate.detach()[keep[k]], small_gate.detach(), atol=1e-14, rtol=0)
    held = {id(p) for g in cut_opt.param_groups for p in g["params"]}
    assert all(id(p) in held for p in cut.parameters())
    assert len(held) == len(list(cut.parameters()))


def test_bond_keeps_rank_one_unless_layer_removal_allowed():
    compiled = _mlp_compiled()
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.05, truncate_every=0)
    name, mod = next(iter(ctl.layers.items()))
    with torch.no_grad():
        mod.gates[1].zero_()
    predicted = ctl.active_ratio()
    ctl.truncate()
    assert ctl.ranks()[name][1] == 1 and isinstance(compiled.model.get_submodule(name), TTLinear)
    assert compiled.ratio == pytest.approx(predicted, rel=1e-12)  # the kept rank is counted


def test_collapsed_layer_becomes_its_bias():
    compiled = _mlp_compiled()
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.05, truncate_every=0,
                                   allow_layer_removal=True)
    name, mod = next(iter(ctl.layers.items()))
    bias = mod.bias
    with torch.no_grad():
        mod.gates[1].zero_()
    x = torch.randn(3, 64, dtype=f64)
    ref = compiled(x)
    before = compiled.ratio
    event = ctl.truncate()
    assert event.removed == [name] and event.shapes_changed
    collapsed = compiled.model.get_submodule(name)
    assert isinstance(collapsed, CollapsedLayer) and collapsed.bias is bias
    assert torch.allclose(compiled(x), ref, atol=1e-13, rtol=0)
    assert compiled.ratio == pytest.approx(before - mod.layout.num_params() / compiled.program.original_params)
    row = next(r for r in compiled.report().rows if r.name == name)
    assert row.format == "removed" and "rank adaptation" in row.note and row.params == 0
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(p) in held for p in mod.cores) and id(bias) in held
    assert name not in ctl.layers
    compiled(x).sum().backward()
    opt.step()
    dense = compiled.to_dense()  # a collapsed layer stays its bias in the dense rebuild too
    assert torch.allclose(dense(x), compiled(x), atol=1e-12)


def test_rank_edits_run_as_passes_recorded_and_dumped(tmp_path):
    """A cut's edits (truncate_ranks, collapse_layers, replan) go through the pipeline:
    linted, in the program's history with their counts, and dumped where compile dumped."""
    model = mlp((64, 128, 128, 64)).to(f64)
    compiled = tncompile.compile(model, target_ratio=0.5, init="random", dump_dir=tmp_path, batch_sizes=[4, 64])
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.05, truncate_every=0, allow_layer_removal=True)
    (first, removed), (second, cut) = list(ctl.layers.items())[:2]
    with torch.no_grad():
        removed.gates[1].zero_()
        cut.gates[2][3:] = 0.0
    stale = {b: p.order() for b, p in cut.plans.items()}
    assert stale
    compiled_passes = len(compiled.program.history)
    event = ctl.truncate()
    assert event.removed == [first] and second in event.truncated
    history = compiled.program.history[compiled_passes:]
    assert [r.name for r in history] == ["truncate_ranks", "collapse_layers", "replan"]
    assert history[0].matches == {"layer-truncated": 1}
    assert history[1].matches == {"layer-collapsed": 1}
    assert history[2].matches["bucket-replanned"] >= len(stale)
    assert history[2].ratio == pytest.approx(compiled.ratio)
    n = compiled_passes
    assert f"ranks={','.join(map(str, cut.layout.ranks))}" in (tmp_path / f"{n + 1:02d}-truncate_ranks.txt").read_text()
    assert "removed by rank adaptation" in (tmp_path / f"{n + 2:02d}-collapse_layers.txt").read_text()
    assert (tmp_path / f"{n + 3:02d}-replan.json").exists()
    from tncompile.passes.replan import plan_fits
    assert set(cut.plans) == set(stale) and all(plan_fits(cut, p) for p in cut.plans.values())
    x = torch.randn(4, 64, dtype=f64)
    assert compiled(x).shape == (4, 64)


def test_collapsed_layer_survives_save_and_load(tmp_path):
    compiled = _mlp_compiled()
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.05, truncate_every=0,
                                   allow_layer_removal=True)
    name, mod = next(iter(ctl.layers.items()))
    with torch.no_grad():
        mod.gates[0].zero_()
    ctl.truncate()
    tncompile.save(compiled, tmp_path / "c.tnc")
    loaded = tncompile.load(tmp_path / "c.tnc", model=mlp((64, 128, 64)).to(f64))
    x = torch.randn(3, 64, dtype=f64)
    assert isinstance(loaded.model.get_submodule(name), CollapsedLayer)
    assert torch.equal(loaded(x), compiled(x)) and loaded.ratio == compiled.ratio
    assert "removed" in str(loaded.report())


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(3000, 64)
        self.mix = nn.Linear(64, 64)
        self.head = nn.Linear(64, 3000, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def test_tied_head_follows_its_truncated_embedding():
    compiled = tncompile.compile(_TiedLM().double(), target_ratio=0.2, init="random", batch_sizes=[1, 64])
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.01, truncate_every=0)
    head = compiled.model.get_submodule("head")
    assert isinstance(head, TTMTiedLinear) and "head" not in ctl.layers
    _zero_gate_entries(ctl, 0.5)
    ids = torch.randint(0, 3000, (2, 32))
    ref = compiled(ids)
    ctl.truncate()
    assert torch.allclose(compiled(ids), ref, atol=1e-12, rtol=0)
    emb = compiled.model.get_submodule("emb")
    assert head.layout.ranks == emb.layout.ranks
    # the head's cached plans were rebuilt for the new ranks (same flops as planning afresh)
    assert head.plans
    for bucket, plan in list(head.plans.items()):
        fresh = head.plan_bucket(bucket)
        assert (plan.fwd_flops, plan.bwd_flops) == (fresh.fwd_flops, fresh.bwd_flops)
    x = torch.randn(5, 64, dtype=f64)
    assert torch.allclose(head(x), x @ emb.weight().t(), atol=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    ({"threshold": 0}, "threshold"),
    ({"threshold": -1e-2}, "threshold"),
    ({"target_ratio": 0.9}, "target_ratio"),
    ({"rank_weight": -1.0}, "rank_weight"),
    ({"loss_smoothing": 1.0}, "loss_smoothing"),
    ({"truncate_every": -1}, "truncate_every"),
    ({"target_loss": 0.0}, "target_loss"),
    ({"optimizer_state": "keep"}, "optimizer_state"),
])
def test_bad_settings_are_clear_errors(kwargs, match):
    compiled = _mlp_compiled()
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    settings = {"target_ratio": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        tncompile.RankController(compiled, opt, **settings)


def test_unsupported_optimizer_and_missing_gates():
    compiled = _mlp_compiled()
    lbfgs = torch.optim.LBFGS(compiled.parameters())
    with pytest.raises(TypeError, match="LBFGS.*optimizer_state='reset'"):
        tncompile.RankController(compiled, lbfgs, target_ratio=0.1)
    tncompile.RankController(compiled, lbfgs, target_ratio=0.1, optimizer_state="reset")
    cores_only = torch.optim.Adam([p for g in tncompile.param_groups(compiled, lr=1e-3)
                                   if g["name"] != "gates" for p in g["params"]])
    with pytest.raises(ValueError, match="rank gates.*param_groups"):
        tncompile.RankController(compiled, cores_only, target_ratio=0.1)
    with pytest.raises(TypeError, match="CompiledModel"):
        tncompile.RankController(nn.Linear(3, 3), None, target_ratio=0.1)


def test_param_groups_partition_the_parameters():
    compiled = tncompile.compile(small_encoder(), target_ratio=0.2, init="random")
    groups = tncompile.param_groups(compiled, lr=1e-3, gate_lr=1e-2, weight_decay=0.01)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"cores", "gates", "other"}
    assert by_name["gates"]["lr"] == 1e-2 and by_name["gates"]["weight_decay"] == 0.0
    assert by_name["cores"]["lr"] == 1e-3 and by_name["cores"]["weight_decay"] == 0.01
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(compiled.parameters()))
    assert math.isclose(sum(p.numel() for g in groups for p in g["params"]),
                        compiled.ratio * compiled.program.original_params)


def test_nonfinite_loss_stays_out_of_the_average_and_raises_or_is_skipped():
    compiled = _mlp_compiled(torch.float32)
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.1, nonfinite="skip")
    ctl.penalty(torch.tensor(2.0))
    ctl.step()
    before = ctl.smoothed_loss().clone()
    for bad in (math.nan, math.inf):
        ctl.penalty(torch.tensor(bad))
        ctl.step()
    assert torch.equal(ctl.smoothed_loss(), before)  # never folded into the late stage's target
    ctl.start_late_stage()
    assert torch.isfinite(ctl.target_loss)

    strict = tncompile.RankController(compiled, opt, target_ratio=0.1)  # nonfinite="raise" by default
    strict.penalty(torch.tensor(math.nan))
    with pytest.raises(FloatingPointError, match="1 non-finite task loss"):
        strict.step()


def test_nonfinite_gates_are_never_cut_from():
    compiled = _mlp_compiled(torch.float32)
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    names = list(tncompile.RankController(compiled, opt, target_ratio=0.1).layers)
    before = {n: m.layout.ranks for n, m in compiled.tensorized_modules().items()}
    with torch.no_grad():
        compiled.tensorized_modules()[names[0]].gates[0][0] = math.nan
        for n in names[1:]:
            compiled.tensorized_modules()[n].gates[0][1:] = 0.0  # switched off: cut
    with pytest.raises(FloatingPointError, match="not finite"):
        tncompile.RankController(compiled, opt, target_ratio=0.1).truncate()
    assert {n: m.layout.ranks for n, m in compiled.tensorized_modules().items()} == before  # nothing half-cut
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.1, nonfinite="skip")
    with pytest.warns(RuntimeWarning, match="not cutting"):
        event = ctl.truncate()
    assert names[0] not in event.truncated and compiled.tensorized_modules()[names[0]].layout.ranks == before[names[0]]
    assert all(compiled.tensorized_modules()[n].layout.ranks[0] == 1 for n in names[1:])


def test_nonfinite_setting_is_checked():
    compiled = _mlp_compiled(torch.float32)
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        tncompile.RankController(compiled, None, target_ratio=0.1, nonfinite="ignore")


def test_training_goes_on_after_every_layer_is_removed():
    """Rank adaptation may collapse every TT layer: it says so once, the penalty
    becomes zero, and fit keeps training the rest (no internal error)."""
    torch.manual_seed(0)
    compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.1, allow_layer_removal=True, early_steps=0)
    with torch.no_grad():
        for mod in ctl.layers.values():
            for g in mod.gates:
                g.zero_()
    with pytest.warns(RuntimeWarning, match="removed every TT/TTM layer"):
        event = ctl.truncate()
    assert event.removed == ["0"] and not ctl.layers
    assert isinstance(compiled.model.get_submodule("0"), CollapsedLayer)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    task = nn.functional.cross_entropy(compiled(x), y)
    assert float(ctl.penalty(task)) == 0.0
    ctl.start_late_stage()
    assert ctl.late_objective(task) is task
    history = tncompile.fit(compiled, [(x, y)], nn.functional.cross_entropy, opt, ctl, early_steps=0,
                            late_steps=30, progress=False)
    assert history.loss[-1] < history.loss[0]


def test_lbfgs_with_reset_trains_cut_cores():
    """LBFGS keeps its own reference to the parameter list and one flat history over
    all parameters: after a cut it must train the new cores (not silently skip them)."""
    torch.manual_seed(0)
    compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3)
    opt = torch.optim.LBFGS(compiled.parameters(), lr=0.1)
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.16, optimizer_state="reset", early_steps=0)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    _zero_gate_entries(ctl, fraction=0.3)
    assert ctl.truncate().truncated
    before = {n: p.detach().clone() for n, p in compiled.named_parameters()}
    opt.step(closure)
    unchanged = [n for n, p in compiled.named_parameters() if torch.equal(before[n], p)]
    assert not unchanged, f"LBFGS stopped training {unchanged}"


@pytest.mark.parametrize("mode", ["graph", "swap"])
def test_load_state_dict_of_a_cut_model_adopts_its_ranks(mode):
    """A state saved after cuts loads into a model at the compiled ranks (what a plain
    Trainer's resume does): the layers are cut to the state's ranks first; a state of larger
    ranks grows them; ranks beyond the layout's bounds are refused, naming the layer."""
    from tncompile.passes import Pipeline, Replan, TruncateRanks
    torch.manual_seed(0)
    dense = mlp((64, 128, 64, 10))
    kwargs = {"mode": mode, "example_inputs": torch.randn(4, 64)} if mode == "swap" else {}
    cut = tncompile.compile(dense, target_ratio=0.4, prefer="size", **kwargs)
    fresh = copy.deepcopy(cut)
    name, layer = next(iter(cut.tensorized_modules().items()))
    keep = [torch.arange(max(1, r - 3)) for r in layer.layout.ranks]
    Pipeline([TruncateRanks({name: keep}), Replan()]).run(cut.program, progress=False)
    with torch.no_grad():
        for p in cut.parameters():
            p.add_(0.01 * torch.randn_like(p))
    fresh.load_state_dict(cut.state_dict())
    assert fresh.tensorized_modules()[name].layout.ranks == cut.tensorized_modules()[name].layout.ranks
    assert fresh.ratio == pytest.approx(cut.ratio)
    x = torch.randn(5, 64)
    cut.eval(), fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), cut(x), rtol=0, atol=0)
    # issue 52: the best checkpoint predates the cut -- a state of larger ranks grows the layer to them
    best = tncompile.compile(dense, target_ratio=0.4, prefer="size", **kwargs)
    with torch.no_grad():
        for p in best.parameters():
            p.add_(0.01 * torch.randn_like(p))
    grown = copy.deepcopy(fresh)
    grown.load_state_dict(best.state_dict())
    assert grown.tensorized_modules()[name].layout.ranks == best.tensorized_modules()[name].layout.ranks
    best.eval(), grown.eval()
    with torch.no_grad():
        torch.testing.assert_close(grown(x), best(x), rtol=0, atol=0)
    opt = torch.optim.AdamW(grown.parameters(), lr=1e-3)  # trains at the grown ranks
    grown.train()
    grown(x).sum().backward()
    opt.step()
    state = best.state_dict()
    gate = next(k for k in state if k.endswith("gates.0"))
    state[gate] = torch.ones(10**4)
    with pytest.raises(ValueError, match="outside what its layout allows"):
        copy.deepcopy(fresh).load_state_dict(state)


def test_param_groups_step_tensors_together_with_the_plain_loops_results():
    """A compressed model has several times the tensors of its dense model: param_groups asks
    for the foreach step (bit for bit the one-at-a-time loop's) or, on request, the fused one
    (within rounding)."""
    torch.manual_seed(0)
    a = tncompile.compile(mlp((64, 128, 64, 10)), target_ratio=0.4, prefer="size")
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    groups = tncompile.param_groups(a, lr=1e-2, gate_lr=1e-1)
    assert all(g["foreach"] is True and "fused" not in g for g in groups)
    assert all("fused" not in g and "foreach" not in g
               for g in tncompile.param_groups(a, lr=1e-2, implementation=None))
    with pytest.raises(ValueError, match="implementation"):
        tncompile.param_groups(a, lr=1e-2, implementation="fast")
    opts = [torch.optim.AdamW(groups),
            torch.optim.AdamW(tncompile.param_groups(b, lr=1e-2, gate_lr=1e-1, implementation=None)),
            torch.optim.AdamW(tncompile.param_groups(c, lr=1e-2, gate_lr=1e-1, implementation="fused"))]
    assert all(g["fused"] is True for g in opts[2].param_groups)
    x = torch.randn(8, 64)
    for model, opt in zip((a, b, c), opts):
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        torch.testing.assert_close(r, q, rtol=1e-5, atol=1e-6, msg=name)


def test_the_controller_takes_what_accelerate_and_torch_compile_hand_the_user():
    """Issue 52: accelerate's AcceleratedOptimizer and torch.compile's OptimizedModule are
    unwrapped: a cut slices the optimizer inside."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    compiled = tncompile.compile(mlp((64, 128, 64, 10)), target_ratio=0.4, prefer="size")
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(compiled, torch.optim.AdamW(compiled.parameters(), lr=1e-3))
    ctl = tncompile.RankController(torch.compile(model), opt, target_ratio=0.2)
    assert ctl.optimizer is opt.optimizer and ctl.compiled is compiled


@pytest.mark.parametrize("mode", ["graph", "swap"])
def test_dump_dir_travels_in_the_context_and_later_passes_dump_there(tmp_path, mode):
    """compile(dump_dir=) reaches the pipeline through its CompileContext (the program keeps
    no compile input), and the compiled model hands it to the passes a resizing
    load_state_dict runs later; a model compiled without it dumps nothing later."""
    model = mlp((64, 128, 64)).to(f64)
    compiled = tncompile.compile(model, target_ratio=0.5, init="random", dump_dir=tmp_path / "d", mode=mode)
    assert not hasattr(compiled.program, "dump_dir") and not hasattr(compiled.program, "context")
    state = {k: v.clone() for k, v in compiled.state_dict().items()}
    name, layer = next(iter(compiled.tensorized_modules().items()))
    smaller = [max(1, r - 1) for r in layer.layout.ranks]
    tncompile.compile(copy.deepcopy(model), target_ratio=0.5, init="random", mode=mode)  # unrelated compile
    before = sorted(p.name for p in (tmp_path / "d").iterdir())
    shrunk = copy.deepcopy(compiled)
    shrunk.__dict__.pop(LATER_DUMP_DIR)  # a copy keeps the dump dir; this one's passes write nothing
    shrunk._run_passes([TruncateRanks({name: [torch.arange(r) for r in smaller]}), Replan()])
    compiled.load_state_dict(shrunk.state_dict())
    after = sorted(p.name for p in (tmp_path / "d").iterdir())
    n = len(compiled.program.history)
    new = set(after) - set(before)
    assert {f"{n - 1:02d}-truncate_ranks.txt", f"{n:02d}-replan.txt"} <= new, new
    assert list(compiled.tensorized_modules()[name].layout.ranks) == smaller
    plain = tncompile.compile(copy.deepcopy(model), target_ratio=0.5, init="random", mode=mode)
    plain.load_state_dict(shrunk.state_dict())
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == after
