"""Issue 64 item 5: the first steps of a compressed model cost little more than settled ones.

Measuring each layer's ways (a race: about two runs a candidate, a tie ends it) and the
first calls' one-time costs together stay within three settled steps, in a plain PyTorch
loop on the pretraining study's Llama (256 wide, 4 layers, 8k vocabulary, 16 x 256 tokens)."""
from __future__ import annotations

import statistics

import pytest

from tncompile.runtime.ways import measured
from tncompile.testing.warm_up import study_llama_step_times

pytest.importorskip("transformers")


def test_warm_up_costs_at_most_three_settled_steps():
    """Three tries: a host busy for a moment must not fail it, a warm-up that is always
    too slow does."""
    extras = []
    for _ in range(3):
        measured.forget()
        times = study_llama_step_times(10)
        settled = statistics.median(times[5:])
        extra = sum(t - settled for t in times[:5])
        extras.append(extra / settled)
        if extras[-1] <= 3.0:
            break
    assert min(extras) <= 3.0, f"warm-up cost {[round(e, 1) for e in extras]} settled steps"
    assert measured.stats()["measured"] >= 1            # the ways were measured, not skipped
