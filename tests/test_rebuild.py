"""Rebuilding a compressed model from the user's dense model and the decisions a compile made
(what ``tncompile.load`` does): the same structure, so the saved tensors load strictly and the
outputs are bit for bit the original's -- graph and swap mode, after cuts, with collapsed layers
and tied heads; a model that does not fit the decisions is a ``ModelMismatchError``."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tncompile
from tncompile.api import rebuild
from tncompile.errors import ModelFileError, ModelMismatchError
from tncompile.passes import CollapseLayers, Pipeline, Replan, TruncateRanks
from tncompile.runtime import CollapsedLayer
from tncompile.serialization.layer_table import decisions_of
from tncompile.testing import mlp, small_encoder

transformers = pytest.importorskip("transformers")


def _rebuilt(compiled, fresh, mode, example=None):
    program = compiled.program
    model = rebuild(fresh, decisions_of(program), program.options, Pipeline(program.pipeline), mode, example)
    model.load_state_dict(compiled.state_dict(), strict=True)
    return model


def _same_outputs(a, b, *inputs, **kwargs):
    a.eval(), b.eval()
    with torch.no_grad():
        out_a, out_b = a(*inputs, **kwargs), b(*inputs, **kwargs)
    out_a = getattr(out_a, "logits", out_a)
    out_b = getattr(out_b, "logits", out_b)
    assert torch.equal(out_a, out_b)


def test_graph_mode_rebuilds_the_same_model_after_cuts_and_collapses():
    torch.manual_seed(0)
    dense = small_encoder(max_len=16)
    fresh = copy.deepcopy(dense)
    compiled = tncompile.compile(dense, target_ratio=0.3)
    before = compiled.tensorized_modules()["layers.0.ff1"].layout.ranks
    keep = [torch.arange(0, r, 2) for r in before]  # every other rank of every bond
    Pipeline([TruncateRanks({"layers.0.ff1": keep}), Replan(),
              CollapseLayers({"layers.1.ff2": "test"})]).run(compiled.program, progress=False)
    assert compiled.tensorized_modules()["layers.0.ff1"].layout.ranks == tuple((r + 1) // 2 for r in before)
    model = _rebuilt(compiled, fresh, "graph")
    assert isinstance(model.model.get_submodule("layers.1.ff2"), CollapsedLayer)
    ranks = {n: m.layout.ranks for n, m in compiled.tensorized_modules().items()}
    assert ranks == {n: m.layout.ranks for n, m in model.tensorized_modules().items()}
    _same_outputs(compiled, model, torch.randint(0, 1000, (2, 16)))


def test_swap_mode_rebuilds_a_tied_decoder():
    cfg = transformers.GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    dense = transformers.GPT2LMHeadModel(cfg).eval()
    fresh = copy.deepcopy(dense)
    ids = torch.randint(0, 500, (2, 8))
    compiled = tncompile.compile(dense, target_ratio=0.4, example_inputs={"input_ids": ids}, mode="swap")
    model = _rebuilt(compiled, fresh, "swap", {"input_ids": ids})
    assert model is fresh and type(model.lm_head).__name__ == "TTMTiedLinear"
    assert model.lm_head.embedding is model.transformer.wte
    _same_outputs(compiled, model, input_ids=ids)


def test_a_model_that_does_not_fit_is_a_mismatch_naming_the_layer():
    torch.manual_seed(0)
    compiled = tncompile.compile(mlp((64, 256, 256, 10)), target_ratio=0.3)
    decisions, program = decisions_of(compiled.program), compiled.program
    for other, where in ((mlp((64, 256, 128, 10)), "shape"), (nn.Sequential(nn.ReLU(), nn.Linear(64, 10)), "no compressible")):
        with pytest.raises(ModelMismatchError, match=where) as caught:
            rebuild(other, decisions, program.options, Pipeline(program.pipeline), "graph", None)
        assert isinstance(caught.value, ModelFileError)
