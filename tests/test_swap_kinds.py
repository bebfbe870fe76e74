"""Issue 54: each kind of swapped layer puts and restores itself (``tncompile.swap.kinds``):
an ordered list, first match wins; ``to_dense`` is one loop over it, a tied head restored
after the embedding it reads."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tncompile
from tncompile.runtime import TTLinear, TTMTiedLinear
from tncompile.swap import KINDS, attach
from tncompile.swap.kinds import kind_for_put, kind_for_restore, restore_all, swapped_paths


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 32)
        self.hidden = nn.Linear(32, 32)
        self.head = nn.Linear(32, 512, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.hidden(self.embed(ids))))


class _Scaled(nn.Linear):
    """A layer subclass with a forward of its own."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_the_kinds_are_ordered_and_named():
    assert [k.name for k in KINDS] == ["experts", "layer subclass", "layer", "tied head"]
    assert kind_for_put("experts", nn.Linear(2, 2)).name == "experts"
    assert kind_for_put("linear", _Scaled(2, 2)).name == "layer subclass"
    assert kind_for_put("linear", nn.Linear(2, 2)).name == "layer"
    assert kind_for_restore("linear", nn.Linear(2, 2)) is None      # nothing swapped there


def test_to_dense_restores_every_kind_in_one_loop_and_ties_the_head():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.lm = _TiedLM()
    model.extra = _Scaled(512, 64)
    ids = torch.randint(0, 512, (3, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = tncompile.compile(model, target_ratio=0.4, mode="swap", embedding_cores=2,
                                    example_inputs=(ids,))
    kinds = {path: kind_for_restore(kind, swapped.get_submodule(path)).name
             for path, kind in swapped_paths(swapped).items()
             if kind_for_restore(kind, swapped.get_submodule(path)) is not None}
    assert "tied head" in kinds.values() and "layer" in kinds.values()
    dense = swapped.to_dense()
    assert type(dense) is nn.Sequential and dense.lm.head.weight is dense.lm.embed.weight
    assert not any(isinstance(m, (TTLinear, TTMTiedLinear)) for m in dense.modules())
    torch.testing.assert_close(dense.lm(ids), swapped.lm(ids), rtol=1e-4, atol=1e-4)


def test_attach_is_swap_modes_one_entry():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = tncompile.compile(model, target_ratio=0.4, mode="swap")
    assert isinstance(swapped, nn.Sequential) and swapped.program.listeners
    with pytest.raises(TypeError, match="already compressed"):
        tncompile.compile(swapped, target_ratio=0.3)
    dense = swapped.to_dense()
    x = torch.randn(4, 64)
    torch.testing.assert_close(dense(x), swapped(x), rtol=1e-4, atol=1e-5)
    restore_all(dense, {})  # nothing to restore: a no-op
    assert attach.__module__ == "tncompile.swap.swapped"
