"""Language-model quality from scratch, measured as the low-rank pretraining literature does.

    python benchmarks/bench_lm_quality.py [--steps 250] [--seeds 0,1] [--batch 16] [--seq 64]
                                          [--variants dense,tt0.25,tt0.1,lowrank0.25,lowrank0.1,galore]
                                          [--rerun]   (only those variants and seeds, replaced in the file)

GaLore, SLTrain and CoLA pretrain LLaMA models from scratch and compare validation
perplexity at equal tokens. This does the same at CPU scale: a Llama-style model (hidden
384, 4 layers, FFN 1024, 6 heads; about 16M parameters with its vocabulary) trained from
scratch on real English text -- the SST-2 training sentences, de-duplicated, tokenized
with the BERT vocabulary (restricted to the word pieces the text uses), joined by
``[SEP]`` -- and evaluated on the SST-2 dev sentences (held out; next-token loss over all
of them, perplexity = exp). Variants, each over the same batches:

* ``dense``: AdamW;
* ``tt0.25``, ``tt0.1``: ``tncompile.compile(..., target_ratio=1.5 r, init="random")`` with a
  ``RankController`` whose rank adaptation ends at or below ``r`` (CoMERA: ranks only shrink);
* ``lowrank0.25``, ``lowrank0.1``: every linear and embedding as ``W = A B`` at the rank
  giving that share of its parameters (the literature's baseline);
* ``galore``: the dense model with GaLore's AdamW (``galore-torch``; rank = hidden / 4 on
  the decoder layers' matrices, as GaLore's LLaMA runs).

Each at ``--seeds`` (model init and batch order), the same tokens for all; the validation
loss every ``--eval-every`` steps with the wall time spent training. Reported: the final
validation perplexity (equal tokens), and each variant's at the wall time the fastest one
needed for all its steps (equal wall time, from the curve). Writes
``benchmarks/results/lm_quality.json`` (with the host's copy bandwidth and GEMM throughput)
and ``lm_quality.png`` (validation loss against tokens and against wall time).
"""
from __future__ import annotations

import csv
import json
import math
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common import RESULTS, galore_optimizer, machine, parser, write_json

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
WIDTH, LAYERS, FFN, HEADS = 384, 4, 1024, 6


def corpus(data: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(train ids, validation ids, vocabulary size)``: SST-2 train sentences (each once)
    and dev sentences, BERT word pieces renumbered densely, ``[SEP]`` between sentences."""
    from tokenizers import BertWordPieceTokenizer
    tok = BertWordPieceTokenizer(str(data / "bert-base-uncased" / "vocab.txt"), lowercase=True)

    def sentences(split: str) -> list[str]:
        with open(data / "sst2" / f"{split}.tsv", newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
        return list(dict.fromkeys(r[0].strip() for r in rows))

    sep = tok.token_to_id("[SEP]")
    streams = []
    for split in ("train", "dev"):
        ids = []
        for enc in tok.encode_batch(sentences(split), add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(sep)
        streams.append(ids)
    used = sorted(set(streams[0]) | set(streams[1]))
    renumber = {old: new for new, old in enumerate(used)}
    train, val = (torch.tensor([renumber[i] for i in s]) for s in streams)
    return train, val, len(used)


def llama(vocab: int, seq: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, vocab_size=vocab, max_position_embeddings=seq,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


class LowRankLinear(nn.Module):
    """``W = B A``: ``in -> rank -> out``, both factors trained (PyTorch's default inits)."""

    def __init__(self, fin: int, fout: int, rank: int, bias: bool):
        super().__init__()
        self.a, self.b = nn.Linear(fin, rank, bias=False), nn.Linear(rank, fout, bias=bias)

    def forward(self, x):
        return self.b(self.a(x))


class LowRankEmbedding(nn.Module):
    """``E = A B``: ``(V, rank) @ (rank, D)``."""

    def __init__(self, vocab: int, dim: int, rank: int):
        super().__init__()
        self.a, self.b = nn.Embedding(vocab, rank), nn.Linear(rank, dim, bias=False)

    def forward(self, ids):
        return self.b(self.a(ids))


def low_rank(model: nn.Module, ratio: float) -> nn.Module:
    """Every linear and embedding as two factors at the rank that keeps ``ratio`` of its
    parameters (``r (m + n) = ratio m n``)."""
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                rank = max(1, round(ratio * child.in_features * child.out_features
                                    / (child.in_features + child.out_features)))
                setattr(mod, child_name, LowRankLinear(child.in_features, child.out_features, rank,
                                                       child.bias is not None))
            elif isinstance(child, nn.Embedding):
                rank = max(1, round(ratio * child.num_embeddings * child.embedding_dim
                                    / (child.num_embeddings + child.embedding_dim)))
                setattr(mod, child_name, LowRankEmbedding(child.num_embeddings, child.embedding_dim, rank))
    return model


def build(variant: str, vocab: int, seq: int, steps: int, lr: float):
    """``(model, optimizer, controller or None)`` of a variant."""
    import tncompile
    model = llama(vocab, seq)
    if variant.startswith("tt"):
        ratio = float(variant[2:])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tncompile.compile(model, target_ratio=min(1.0, 1.5 * ratio), init="random",
                                      example_inputs={"input_ids": torch.zeros(1, seq, dtype=torch.long)})
        opt = torch.optim.AdamW(tncompile.param_groups(model, lr=lr, gate_lr=10 * lr))
        ctl = tncompile.RankController(model, opt, target_ratio=ratio, early_steps=steps // 3,
                                       late_steps=steps // 3, truncate_every=max(10, steps // 15))
        return model, opt, ctl
    if variant.startswith("lowrank"):
        model = low_rank(model, float(variant[7:]))
    if variant == "galore":
        opt = galore_optimizer(model, lr=lr, rank=WIDTH // 4,
                               select=lambda n, p: p.dim() == 2 and ".layers." in n)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt, None


@torch.no_grad()
def validation_loss(model: nn.Module, val: torch.Tensor, seq: int) -> float:
    was = model.training
    model.eval()
    n = (val.numel() - 1) // seq
    windows = val[: n * seq + 1]
    total = 0.0
    for start in range(0, n, 32):
        idx = torch.arange(start, min(n, start + 32))
        x = torch.stack([windows[i * seq: i * seq + seq] for i in idx])
        y = torch.stack([windows[i * seq + 1: i * seq + seq + 1] for i in idx])
        logits = model(input_ids=x).logits
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
    model.train(was)
    return total / (n * seq)


def run(variant: str, seed: int, data, args) -> dict:
    train, val, vocab = data
    torch.manual_seed(seed)
    model, opt, ctl = build(variant, vocab, args.seq, args.steps, args.lr)
    params = sum(p.numel() for p in model.parameters())
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    g = torch.Generator().manual_seed(1000 + seed)       # the batches: the same for every variant of a seed
    curve = [{"step": 0, "tokens": 0, "train_s": 0.0, "val_loss": validation_loss(model, val, args.seq)}]
    spent = 0.0
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, train.numel() - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([train[s: s + args.seq] for s in starts])
        y = torch.stack([train[s + 1: s + args.seq + 1] for s in starts])
        begin = time.perf_counter()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        total = loss + ctl.penalty(loss) if ctl is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        sched.step()
        if ctl is not None:
            ctl.step()
        spent += time.perf_counter() - begin
        if step % args.eval_every == 0 or step == args.steps:
            curve.append({"step": step, "tokens": step * args.batch * args.seq, "train_s": spent,
                          "train_loss": loss.item(), "val_loss": validation_loss(model, val, args.seq)})
    final_params = sum(p.numel() for p in model.parameters())
    return {"variant": variant, "seed": seed, "params": params, "final_params": final_params, "curve": curve}


def loss_at(curve: list[dict], seconds: float) -> float:
    """The validation loss reached by ``seconds`` of training (linear between evaluations)."""
    for before, after in zip(curve, curve[1:]):
        if after["train_s"] >= seconds:
            share = (seconds - before["train_s"]) / max(after["train_s"] - before["train_s"], 1e-9)
            return before["val_loss"] + share * (after["val_loss"] - before["val_loss"])
    return curve[-1]["val_loss"]


def summarize(runs: list[dict]) -> tuple[list[dict], str]:
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    wall = min(statistics.mean(r["curve"][-1]["train_s"] for r in runs if r["variant"] == v) for v in variants)
    rows = []
    for v in variants:
        mine = [r for r in runs if r["variant"] == v]
        final = [math.exp(r["curve"][-1]["val_loss"]) for r in mine]
        timed = [math.exp(loss_at(r["curve"], wall)) for r in mine]
        rows.append({"variant": v, "params": statistics.mean(r["final_params"] for r in mine),
                     "ppl": statistics.mean(final), "ppl_spread": (max(final) - min(final)) / 2,
                     "ppl_at_equal_wall": statistics.mean(timed), "train_s": statistics.mean(
                         r["curve"][-1]["train_s"] for r in mine)})
    lines = [f"validation perplexity on SST-2 dev ({len(runs) // len(variants)} seeds; equal wall time = {wall:.0f} s)",
             f"{'variant':<12} {'params':>9} {'ppl (equal tokens)':>22} {'ppl (equal wall)':>17} {'train s':>8}"]
    for row in rows:
        lines.append(f"{row['variant']:<12} {row['params'] / 1e6:>8.2f}M {row['ppl']:>14.1f} ± {row['ppl_spread']:<5.1f}"
                     f" {row['ppl_at_equal_wall']:>17.1f} {row['train_s']:>8.0f}")
    return rows, "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {}
    for r in runs:
        color = colors.setdefault(r["variant"], f"C{len(colors)}")
        xs = [c["tokens"] / 1e6 for c in r["curve"]]
        ts = [c["train_s"] for c in r["curve"]]
        ys = [c["val_loss"] for c in r["curve"]]
        label = r["variant"] if r["seed"] == runs[0]["seed"] else None
        axes[0].plot(xs, ys, color=color, label=label, alpha=0.8)
        axes[1].plot(ts, ys, color=color, label=label, alpha=0.8)
    axes[0].set_xlabel("training tokens (millions)")
    axes[1].set_xlabel("training wall time (s, 2-core CPU)")
    for ax in axes:
        ax.set_ylabel("validation loss (SST-2 dev)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Llama-style model from scratch on SST-2 sentences: dense, TT, low-rank, GaLore")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--variants", default="dense,tt0.25,tt0.1,lowrank0.25,lowrank0.1,galore")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--rerun", action="store_true",
                   help="run only --variants x --seeds again and replace those runs in lm_quality.json (a run "
                        "another process disturbed); the summary and plot are made afresh")
    args = p.parse_args()
    from tqdm import tqdm
    data = corpus(Path(args.data))
    print(f"corpus: {data[0].numel():,} training tokens, {data[1].numel():,} validation tokens, "
          f"vocabulary {data[2]:,}", flush=True)
    jobs = [(v, int(s)) for s in args.seeds.split(",") for v in args.variants.split(",")]
    runs = []
    for variant, seed in tqdm(jobs, desc="lm quality runs"):
        runs.append(run(variant, seed, data, args))
        write_json("lm_quality.partial.json", {"args": vars(args), "runs": runs})   # survives a later failure
        last = runs[-1]["curve"][-1]
        print(f"{variant} seed {seed}: val ppl {math.exp(last['val_loss']):.1f} after {last['train_s']:.0f} s, "
              f"{runs[-1]['final_params'] / 1e6:.2f}M params", flush=True)
    if args.rerun:   # keep the other runs of the committed file, in their order
        kept = json.loads((RESULTS / "lm_quality.json").read_text())["runs"]
        fresh = {(r["variant"], r["seed"]): r for r in runs}
        runs = [fresh.pop((r["variant"], r["seed"]), r) for r in kept] + list(fresh.values())
        args.variants = ",".join(dict.fromkeys(r["variant"] for r in runs))
        args.seeds = ",".join(str(s) for s in dict.fromkeys(r["seed"] for r in runs))
    rows, table = summarize(runs)
    print(table)
    plot(runs, RESULTS / "lm_quality.png")
    path = write_json("lm_quality.json", {"machine": machine(), "args": vars(args), "corpus": {
        "train_tokens": data[0].numel(), "val_tokens": data[1].numel(), "vocab": data[2]},
        "model": {"hidden": WIDTH, "layers": LAYERS, "ffn": FFN, "heads": HEADS},
        "summary": rows, "table": table, "runs": runs})
    (RESULTS / "lm_quality.partial.json").unlink(missing_ok=True)
    print("wrote", path, "and", RESULTS / "lm_quality.png")


if __name__ == "__main__":
    main()
