"""The first training steps of the pretraining study's Llama, timed: what
``tests/test_warm_up.py`` holds to three settled steps and ``benchmarks/bench_warm_up.py``
reports (issue 64 item 5)."""
from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

__all__ = ["study_llama_step_times"]


def study_llama_step_times(steps: int = 10, ratio: float = 0.25) -> list[float]:
    """Seconds of each of ``steps`` AdamW training steps (forward, loss, backward, step) in a
    plain loop: the study's Llama (hidden 256, 4 layers, 8k vocabulary) compiled at ``ratio``
    from seeded random weights, 16 x 256 random tokens a step. Needs ``transformers``."""
    import tncompile
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=8000, max_position_embeddings=256)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tncompile.compile(LlamaForCausalLM(cfg), target_ratio=ratio, init="random",
                                  example_inputs={"input_ids": torch.zeros(2, 256, dtype=torch.long)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (16, 257), generator=g)
        start = time.perf_counter()
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times
