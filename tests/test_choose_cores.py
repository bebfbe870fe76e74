"""``compile(linear_cores="measured")``: each linear's network is the fastest of its 2-, 4-
and 6-core layouts within the parameters its rank gave it, by timing on the device (with
calibration data: the best held-out fit among the nearly fastest); the report shows every
candidate; a saved model loads its layouts back without measuring again."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tncompile
from tncompile.passes import choose_cores
from tncompile.runtime.layers import TTLinear


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 512)
        self.down = nn.Linear(512, 256)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def compiled_with(monkeypatch, fastest_cores=None, **kw):
    """Compile with the measurement replaced by a clock where ``fastest_cores`` wins."""
    monkeypatch.setattr(choose_cores, "_MEASURED", {})
    if fastest_cores is not None:
        monkeypatch.setattr(choose_cores, "step_ms", lambda layout, *a, **k: 1.0 + abs(
            len(layout.core_shapes()) - fastest_cores))
    torch.manual_seed(0)
    return tncompile.compile(MLP(), target_ratio=0.3, linear_cores="measured", example_inputs=(torch.randn(4, 256),),
                             **kw)


def layers(compiled) -> dict[str, TTLinear]:
    return {n.rpartition(".")[2]: m for n, m in compiled.named_modules() if isinstance(m, TTLinear)}


@pytest.mark.parametrize("cores", [2, 4, 6])
def test_each_layer_gets_the_fastest_layout_within_its_share(monkeypatch, cores):
    compiled = compiled_with(monkeypatch, cores)
    choices = compiled.program.core_choices
    assert {k.rpartition(".")[2] for k in choices} == {"up", "down"}
    for name, layer in layers(compiled).items():
        assert len(layer.layout.core_shapes()) == cores
        choice = next(c for k, c in choices.items() if k.endswith(name))
        assert {c["cores"] for c in choice["candidates"]} == {2, 4, 6} and choice["chosen"] == cores
        budget = max(c["params"] for c in choice["candidates"] if c["cores"] == 6)
        assert all(c["params"] <= budget for c in choice["candidates"])   # the 6-core layout's own share
    assert compiled.ratio <= 0.3
    report = str(compiled.report())
    assert f"*{cores} cores" in report and "cores by fwd+bwd" in report


def test_the_chosen_layout_is_the_fastest_measured_on_this_device(monkeypatch):
    monkeypatch.setattr(choose_cores, "_MEASURED", {})
    torch.manual_seed(0)
    compiled = tncompile.compile(MLP(), target_ratio=0.3, linear_cores="measured", example_inputs=(torch.randn(4, 256),))
    timed = dict(choose_cores._MEASURED)
    monkeypatch.setattr(choose_cores, "step_ms", lambda *a, **k: pytest.fail("a shape measured twice"))
    again = tncompile.compile(MLP(), target_ratio=0.3, linear_cores="measured", example_inputs=(torch.randn(4, 256),))
    assert choose_cores._MEASURED == timed
    assert [m.layout for m in layers(again).values()] == [m.layout for m in layers(compiled).values()]
    for name, choice in compiled.program.core_choices.items():
        times = {c["cores"]: c["ms"] for c in choice["candidates"]}
        assert all(t > 0 for t in times.values())
        assert choice["chosen"] == min(times, key=times.get)
        layer = layers(compiled)[name.rpartition(".")[2]]
        assert len(layer.layout.core_shapes()) == choice["chosen"]


def test_the_measured_networks_train_and_match_their_dense_matrix(monkeypatch):
    compiled = compiled_with(monkeypatch, 2)
    x = torch.randn(8, 256)
    up = layers(compiled)["up"]
    assert torch.allclose(up(x[:, :256]), x @ up.weight().t() + up.bias, atol=1e-5)
    compiled(x).sum().backward()
    assert all(p.grad is not None for p in compiled.parameters() if p.requires_grad)


def test_with_calibration_the_best_held_out_fit_among_the_nearly_fastest_wins(monkeypatch):
    monkeypatch.setattr(choose_cores, "_MEASURED", {})
    monkeypatch.setattr(choose_cores, "step_ms", lambda layout, *a, **k: 1.0)   # every layout as fast
    torch.manual_seed(0)
    calibration = [torch.randn(64, 256) for _ in range(4)]
    compiled = tncompile.compile(MLP(), target_ratio=0.3, linear_cores="measured", calibration=calibration)
    for choice in compiled.program.core_choices.values():
        errors = {c["cores"]: c["held_out_error"] for c in choice["candidates"]}
        assert all(e is not None and e >= 0 for e in errors.values())
        assert choice["chosen"] == min(errors, key=errors.get)


def test_a_saved_measured_model_loads_without_measuring(monkeypatch, tmp_path):
    compiled = compiled_with(monkeypatch, 2)
    tncompile.save(compiled, tmp_path / "m.tnc")
    monkeypatch.setattr(choose_cores, "step_ms", lambda *a, **k: pytest.fail("measured again on load"))
    loaded = tncompile.load(tmp_path / "m.tnc", model=MLP())
    assert {n: m.layout for n, m in layers(loaded).items()} == {n: m.layout for n, m in layers(compiled).items()}
    x = torch.randn(3, 256)
    assert torch.allclose(loaded(x), compiled(x), atol=1e-6)


def test_bad_values_and_pipelines_without_assign_ranks_are_named():
    with pytest.raises(ValueError, match="linear_cores.*'measured'"):
        tncompile.compile(MLP(), target_ratio=0.3, linear_cores="fast")
    with pytest.raises(ValueError, match="after assign_ranks"):
        tncompile.compile(MLP(), target_ratio=0.3, linear_cores="measured", passes=["canonicalize", "tensorize"])


def test_candidates_hold_the_largest_uniform_rank_within_the_budget():
    from tncompile.formats.layout import TTLayout
    assigned = TTLayout.for_shape(256, 512, 3).with_ranks(12)
    budget = assigned.num_params()
    for layout in choose_cores.candidate_layouts(assigned, budget):
        assert layout.num_params() <= budget
        if layout is not assigned:
            r = max(layout.ranks)
            assert layout.with_ranks(r + 1).num_params() > budget or r + 1 > max(layout.rank_bounds())
