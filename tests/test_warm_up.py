"""Issue 64 item 5: the first steps of a compressed model cost little more than settled ones.

Measuring each layer's ways (a race: about two runs a candidate, a tie ends it) and the
first calls' one-time costs together stay within three settled steps, in a plain PyTorch
loop on the pretraining study's Llama (256 wide, 4 layers, 8k vocabulary, 16 x 256 tokens)."""
from __future__ import annotations

import statistics
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import tncompile
from tncompile.runtime.ways import measured

transformers = pytest.importorskip("transformers")


def _step_times(steps: int = 10) -> list[float]:
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=8000, max_position_embeddings=256)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tncompile.compile(transformers.LlamaForCausalLM(cfg), target_ratio=0.25, init="random",
                                  example_inputs={"input_ids": torch.zeros(2, 256, dtype=torch.long)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        x = torch.randint(0, 8000, (16, 257), generator=g)
        start = time.perf_counter()
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, 8000), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def test_warm_up_costs_at_most_three_settled_steps():
    """Three tries: a host busy for a moment must not fail it, a warm-up that is always
    too slow does."""
    extras = []
    for _ in range(3):
        measured.forget()
        times = _step_times()
        settled = statistics.median(times[5:])
        extra = sum(t - settled for t in times[:5])
        extras.append(extra / settled)
        if extras[-1] <= 3.0:
            break
    assert min(extras) <= 3.0, f"warm-up cost {[round(e, 1) for e in extras]} settled steps"
    assert measured.stats()["measured"] >= 1            # the ways were measured, not skipped
