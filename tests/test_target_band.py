"""Issue 52 item 1: ``compile`` never hands back a model far smaller than ``target_ratio``
without a word. The default (``prefer="speed"``) may cap ranks where larger networks are
estimated slower; the result then lands in the band ``[0.9 target, target]`` or a
``BelowTargetWarning`` says why and how to get the target."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tncompile
from tncompile import BelowTargetWarning
from tncompile.testing import mlp, small_encoder

MODELS = {
    "wide-ff": lambda: nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)),
    "mlp": lambda: mlp((256, 512, 512, 10)),
    "encoder": lambda: small_encoder(),
}


def _compile(name: str, ratio: float, **kwargs):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = tncompile.compile(MODELS[name](), target_ratio=ratio, **kwargs)
    below = [w for w in caught if issubclass(w.category, BelowTargetWarning)]
    return compiled, below


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.3])
def test_the_default_lands_in_the_band_or_says_why(name, ratio):
    compiled, below = _compile(name, ratio)
    assert compiled.ratio <= ratio
    if compiled.ratio < 0.9 * ratio:
        assert below, f"{name} at {ratio}: ratio {compiled.ratio:.4g} without a warning"
        assert "prefer='size'" in str(below[0].message) or "rank bounds" in str(below[0].message)
    else:
        assert not below


def test_speed_capped_ranks_are_said_with_the_fix(monkeypatch):
    """A host where larger ranks are estimated slower than dense above rank 20 (the budget gives 33).
    Forcing the speed model there, the issue's model comes back far below 0.1 -- with a
    warning naming the capped layers and prefer='size', and a note per layer in the report."""
    from tncompile.passes.assign_ranks import AssignRanks
    monkeypatch.setattr(AssignRanks, "_speed_cap", staticmethod(lambda lay, rows, speed, sharing=1: 20))
    compiled, below = _compile("wide-ff", 0.1)
    assert compiled.ratio < 0.09
    assert below, "capped far below the target without a word"
    message = str(below[0].message)
    assert "prefer='size'" in message and "capped the ranks" in message
    assert "capped at" in str(compiled.report()) or "slower than dense" in str(compiled.report())
    sized, below = _compile("wide-ff", 0.1, prefer="size")
    assert 0.09 <= sized.ratio <= 0.1 and not below
