"""Issue 54 (first op): how a TT linear runs is a value -- ``linear_ways.choose(layer, x)``
says it for any input and context, the layer runs and records exactly that, and the
report prints it."""
from __future__ import annotations

import pytest
import torch

import tncompile
from tncompile import tuning
from tncompile.runtime import TTLinear
from tncompile.runtime.ways import linear as linear_ways
from tncompile.runtime.ways.linear import LinearWay, choose
from tncompile.runtime.triton import runs_triton
from tncompile.testing import mlp


def _compiled():
    """Each linear running on its own (a fused block's choice: test_measured_blocks.py)."""
    torch.manual_seed(0)
    return tncompile.compile(mlp((64, 128, 64, 10)), target_ratio=0.4, prefer="size",
                             passes=tncompile.default_pipeline().remove("fuse_feed_forward"))


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
@pytest.mark.parametrize("context", ["train", "prior", "no-grad", "no-groups", "triton"])
def test_the_way_chosen_is_the_way_run(rows, context):
    compiled = _compiled()
    x = torch.randn(rows, 64)
    settings = {"GROUP_FACTORS": False, "MEASURE_WAYS": False} if context == "no-groups" else \
        {"TRITON_KERNELS": True} if context == "triton" else {"MEASURE_WAYS": False} if context == "prior" else {}
    with tuning.override(**settings), torch.set_grad_enabled(context != "no-grad"):
        inputs = _inputs_of(compiled, x)
        predicted = {m: choose(m, h) for m, h in inputs.items()}
        compiled(x)
    assert inputs and all(m.ran_as is predicted[m] for m in inputs), {m.ran_as: predicted[m] for m in inputs}
    ways = set(predicted.values())
    if context == "no-groups":  # the prior merges factors only with a layer's peers
        assert not ways & {LinearWay.WHOLE_MATRIX, LinearWay.THIN_PAIR}
    if context == "triton":
        assert ways == ({LinearWay.TRITON_PAIR} if runs_triton(x) else ways - {LinearWay.TRITON_PAIR})
    if context == "no-grad":
        assert LinearWay.NATIVE_CHAIN not in ways or rows <= tuning.CHAIN_ROWS


def test_torch_export_is_its_own_way(monkeypatch):
    compiled = _compiled().eval()
    chosen = []
    real = linear_ways.decide_call

    def spy(layer, x):
        chosen.append(real(layer, x)[0])
        return real(layer, x)
    monkeypatch.setattr("tncompile.runtime.ways.linear.decide_call", spy)
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


# ----------------------------------------------------------------- TTM lookups
def _embedding(row_modes: int = 2):
    from tncompile.formats import TTMLayout
    from tncompile.runtime import TTMEmbedding
    torch.manual_seed(0)
    return TTMEmbedding(TTMLayout.for_shape(300, 24, row_modes, ranks=4))


@pytest.mark.parametrize("cores,triton", [(1, False), (2, False), (2, True)])
def test_the_lookup_chosen_is_the_lookup_run(cores, triton):
    from tncompile.runtime.ways import lookup as lookup_ways
    from tncompile.runtime.ways.lookup import LookupWay
    emb = _embedding(cores)
    ids = torch.randint(0, 300, (4, 7))
    with tuning.override(TRITON_KERNELS=triton):
        predicted = lookup_ways.choose(emb, ids)
        emb(ids).sum().backward()
    assert emb.ran_as is predicted
    if cores == 1:
        assert predicted is LookupWay.ONE_TABLE
    elif triton and runs_triton(emb.cores[0]):
        assert predicted is LookupWay.TRITON_LOOKUP
    else:   # 28 ids of a 300-row table: the two ways of such few ids, timed against each other
        assert predicted in (LookupWay.GATHERED_PRODUCT, LookupWay.HALF_ROWS)


def test_an_exported_lookup_is_its_own_way(monkeypatch):
    from tncompile.runtime.ways import lookup as lookup_ways
    from tncompile.runtime.ways.lookup import LookupWay
    emb = _embedding(2).eval()
    seen = []
    real = lookup_ways._exported

    def spy(layer, ids):
        seen.append(lookup_ways.choose(layer, ids))
        return real(layer, ids)
    monkeypatch.setattr(lookup_ways, "_exported", spy)
    torch.export.export(emb, (torch.randint(0, 300, (2, 5)),))
    assert seen == [LookupWay.EXPORTED]
