"""Issue 54 (first op): how a TT linear runs is a value -- ``linear_ways.choose(layer, x)``
says it for any input and context, the layer runs and records exactly that, and the
report prints it."""
from __future__ import annotations

import pytest
import torch

import tncompile
from tncompile import tuning
from tncompile.runtime import TTLinear
from tncompile.runtime.layers import linear_ways
from tncompile.runtime.layers.linear_ways import LinearWay, choose
from tncompile.runtime.triton import runs_triton
from tncompile.zoo import mlp


def _compiled():
    torch.manual_seed(0)
    return tncompile.compile(mlp((64, 128, 64, 10)), target_ratio=0.4, prefer="size")


def _inputs_of(model, x):
    """Each TT linear's input in a call of ``model`` on ``x``."""
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.setdefault(m, args[0]))
             for m in model.modules() if isinstance(m, TTLinear)]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("rows", [1, 4, 512])
@pytest.mark.parametrize("context", ["train", "no-grad", "no-groups", "triton"])
def test_the_way_chosen_is_the_way_run(rows, context):
    compiled = _compiled()
    x = torch.randn(rows, 64)
    settings = {"GROUP_FACTORS": False} if context == "no-groups" else \
        {"TRITON_KERNELS": True} if context == "triton" else {}
    with tuning.override(**settings), torch.set_grad_enabled(context != "no-grad"):
        inputs = _inputs_of(compiled, x)
        predicted = {m: choose(m, h) for m, h in inputs.items()}
        compiled(x)
    assert inputs and all(m.ran_as is predicted[m] for m in inputs), {m.ran_as: predicted[m] for m in inputs}
    ways = set(predicted.values())
    if context == "no-groups":
        assert not ways & {LinearWay.WHOLE_MATRIX, LinearWay.THIN_PAIR}
    if context == "triton":
        assert ways == ({LinearWay.TRITON_PAIR} if runs_triton(x) else ways - {LinearWay.TRITON_PAIR})
    if context == "no-grad":
        assert LinearWay.NATIVE_CHAIN not in ways or rows <= tuning.CHAIN_ROWS


def test_torch_export_is_its_own_way(monkeypatch):
    compiled = _compiled().eval()
    chosen = []
    real = linear_ways.choose

    def spy(layer, x):
        chosen.append(real(layer, x))
        return chosen[-1]
    monkeypatch.setattr("tncompile.runtime.layers.tt_layers.choose", spy)
    torch.export.export(compiled, (torch.randn(4, 64),))
    assert chosen and set(chosen) == {LinearWay.EXPORTED}


def test_the_report_says_how_each_layer_ran():
    compiled = _compiled()
    assert "ran as" not in str(compiled.report())  # nothing ran yet
    compiled(torch.randn(8, 64))
    text = str(compiled.report())
    assert "ran as" in text
    for name, layer in compiled.tensorized_modules().items():
        assert layer.ran_as.value in text
