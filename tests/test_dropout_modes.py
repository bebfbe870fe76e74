"""Dropout a trace baked in follows ``train()`` / ``eval()`` (tncompile.frontend.dropout_modes).

A trace runs the model's Python once: ``F.dropout(x, p, training=self.training)``
and HF attention's ``dropout_p=p if self.training else 0.0`` would become constants,
so a model compiled in train mode kept dropping out after ``eval()`` and one
compiled in eval mode trained without attention dropout.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.runtime.fused.attention import AttentionDropoutRate

transformers = pytest.importorskip("transformers")


def attention_only_bert(attn="sdpa", p=0.5):
    """A 1-layer BERT whose only dropout is on the attention probabilities."""
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=p,
                                  attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.BertModel(cfg)


IDS = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))


def hidden(model):
    return model(input_ids=IDS)[0]


def rate_modules(compiled):
    return {n: m.p for n, m in compiled.program.graph_module.named_modules() if isinstance(m, AttentionDropoutRate)}


@pytest.mark.parametrize("traced_training", [True, False])
def test_attention_dropout_follows_the_mode_whatever_mode_it_was_traced_in(traced_training):
    model = attention_only_bert().train(traced_training)
    compiled = tncompile.compile(model, 0.5, example_inputs={"input_ids": IDS}, mode="graph")
    assert rate_modules(compiled) == {"encoder.layer.0.attention.self.attention_dropout": 0.5}
    compiled.eval()
    assert torch.equal(hidden(compiled), hidden(compiled))           # no dropout left in eval
    dense = compiled.to_dense().eval()
    model.eval()
    torch.testing.assert_close(hidden(dense), hidden(compiled), rtol=1e-4, atol=1e-5)
    compiled.train()
    torch.manual_seed(0)
    a = hidden(compiled)
    torch.manual_seed(1)
    assert not torch.allclose(a, hidden(compiled))                   # attention dropout is the only randomness


def test_attention_dropout_rate_survives_save_and_load(tmp_path):
    compiled = tncompile.compile(attention_only_bert().train(), 0.5, example_inputs={"input_ids": IDS}, mode="graph")
    tncompile.save(compiled, tmp_path / "m")
    loaded = tncompile.load(tmp_path / "m", model=attention_only_bert())
    assert rate_modules(loaded) == rate_modules(compiled)
    loaded.eval()
    compiled.eval()
    torch.testing.assert_close(hidden(loaded), hidden(compiled))


class FunctionalDropout(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.p = p
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return F.dropout(self.fc(x), self.p, training=self.training)


@pytest.mark.parametrize("traced_training", [True, False])
def test_functional_dropout_becomes_a_module_that_follows_the_mode(traced_training):
    torch.manual_seed(0)
    model = FunctionalDropout().train(traced_training)
    compiled = tncompile.compile(model, 0.5)
    drops = {n: m.p for n, m in compiled.program.graph_module.named_modules() if isinstance(m, nn.Dropout)}
    assert drops == {"dropout_fn": 0.5}
    x = torch.randn(256, 64)
    compiled.eval()
    assert torch.equal(compiled(x), compiled(x))
    compiled.train()
    dropped = float((compiled(x) == 0).double().mean())
    assert 0.4 < dropped < 0.6


def test_an_eval_trace_that_loses_functional_dropout_says_how_to_keep_it():
    model = attention_only_bert(attn="eager", p=0.1).eval()         # eager attention: F.dropout(p if training else 0)
    with pytest.warns(UserWarning, match=r"encoder\.layer\.0\.attention\.self\.dropout \(p=0\.1\).*model\.train\(\)"):
        tncompile.compile(model, 0.5, example_inputs={"input_ids": IDS}, mode="graph")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = tncompile.compile(model.train(), 0.5, example_inputs={"input_ids": IDS}, mode="graph")
    assert not [w for w in caught if "traced in eval mode" in str(w.message)]
    drops = {n: m.p for n, m in compiled.program.graph_module.named_modules() if type(m).__name__ in
             ("Dropout", "FastDropout") and "attention.self" in n}
    # the attention's dropout, made a module, then absorbed by the fused attention (which keeps it)
    assert drops == {"encoder.layer.0.attention.self.fused_attention.dropout": 0.1}
