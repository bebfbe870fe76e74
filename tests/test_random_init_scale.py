"""``init="random"`` starts each network where its dense layer started: the product of the
drawn cores has exactly the mean square of the weight the model's own init gave the layer
(a HuggingFace model's ``initializer_range``, a custom init), not PyTorch's default.

Issue 66 found a tied 0.02-std embedding compiled to a table of std 1: the compressed Llama
started at loss 246 where the dense one starts at 9.1."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tncompile
from tncompile.formats.factorization import matched_variance, mean_square, random_cores, tt_to_dense, ttm_to_dense
from tncompile.formats.layout import TTLayout, TTMLayout
from tncompile.runtime.layers import TTLinear, TTMEmbedding


@pytest.mark.parametrize("layout", [TTLayout.for_shape(256, 512, 3, ranks=8), TTLayout.for_shape(64, 64, 1, ranks=5),
                                    TTMLayout.for_shape(1024, 64, 3, ranks=8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_draw_has_exactly_the_asked_mean_square(layout, seed):
    variance = 4e-4
    cores = random_cores(layout, variance, torch.Generator().manual_seed(seed))
    to_dense = tt_to_dense if isinstance(layout, TTLayout) else ttm_to_dense
    dense = to_dense(cores, layout)
    assert dense.numel() == (layout.in_features * layout.out_features if isinstance(layout, TTLayout)
                             else layout.num_embeddings * layout.embedding_dim)   # no padding: exact
    assert dense.pow(2).mean().item() == pytest.approx(variance, rel=1e-9)
    assert mean_square(cores) == pytest.approx(dense.pow(2).mean().item(), rel=1e-12)


def test_the_matched_variance_is_the_weights_own_unless_it_has_none():
    assert matched_variance(torch.full((4, 4), 0.5), 9.0) == pytest.approx(0.25)
    assert matched_variance(torch.zeros(4, 4), 9.0) == 9.0                       # zero-initialized layer
    assert matched_variance(torch.empty(4, 4, device="meta"), 9.0) == 9.0
    assert matched_variance(torch.tensor([[float("inf")]]), 9.0) == 9.0


class Tiny(nn.Module):
    def __init__(self, std: float | None):
        super().__init__()
        self.embed = nn.Embedding(1024, 64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)
        if std is not None:   # an HF-style init: every matrix N(0, std^2)
            for m in (self.embed, self.up, self.down):
                nn.init.normal_(m.weight, std=std)

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.embed(ids))))


@pytest.mark.parametrize("std", [0.02, 0.5])
def test_compiled_networks_start_at_the_dense_layers_scale(std):
    model = Tiny(std)
    compiled = tncompile.compile(model, target_ratio=0.3, init="random", seed=3,
                                 example_inputs=(torch.zeros(2, 8, dtype=torch.long),))
    layers = {n.rpartition(".")[2]: m for n, m in compiled.named_modules() if isinstance(m, (TTLinear, TTMEmbedding))}
    assert set(layers) == {"embed", "up", "down"}
    for name, layer in layers.items():
        dense = getattr(model, name).weight
        with torch.no_grad():
            matrix = layer.weight() if callable(layer.weight) else layer.weight
        assert matrix.pow(2).mean().item() == pytest.approx(dense.pow(2).mean().item(), rel=1e-4), name


def test_a_default_initialized_model_keeps_pytorchs_scales():
    model = Tiny(None)
    with torch.no_grad():
        model.up.weight.zero_()        # zero-initialized: the network gets nn.Linear's default variance
    compiled = tncompile.compile(model, target_ratio=0.3, init="random", seed=0,
                                 example_inputs=(torch.zeros(2, 8, dtype=torch.long),))
    up = dict(compiled.named_modules())["model.up"]
    with torch.no_grad():
        ms = up.weight().pow(2).mean().item()
    assert ms == pytest.approx(1 / (3 * 64), rel=1e-4)
    embed = dict(compiled.named_modules())["model.embed"]
    with torch.no_grad():
        assert embed.weight().pow(2).mean().item() == pytest.approx(model.embed.weight.pow(2).mean().item(), rel=1e-4)


def test_different_seeds_draw_different_cores_and_the_same_seed_the_same():
    model = Tiny(0.02)

    def cores(seed):
        compiled = tncompile.compile(model, target_ratio=0.3, init="random", seed=seed,
                                     example_inputs=(torch.zeros(2, 8, dtype=torch.long),))
        return [p.detach().clone() for n, p in compiled.named_parameters() if ".cores." in n]
    a, b, c = cores(0), cores(0), cores(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not any(torch.equal(x, z) for x, z in zip(a, c))
