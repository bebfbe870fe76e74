"""The recommender case (issue 67): a DLRM as a recommender user writes it in plain PyTorch,
and the Criteo rows it reads.

* :class:`DLRM`: a bottom MLP over the dense features, one ``nn.EmbeddingBag`` per
  categorical field (looked up with ``offsets``, optionally with per-sample weights), DLRM's
  dot interactions (every pair of the bottom output and the tables' vectors), a top MLP to
  one logit.
* :func:`read_criteo`: Criteo's raw rows (label, 13 integer and 26 hashed categorical
  fields, tab separated) as tensors: the integers ``log(1 + max(x, 0))`` (DLRM's transform;
  missing as 0), each categorical value hashed into its field's ``buckets`` (DLRM's
  ``max-ind-range``; missing as its own value), so a table's size is a choice, not the
  data's.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DENSE_FIELDS, SPARSE_FIELDS = 13, 26


@dataclass(frozen=True)
class CriteoRows:
    """``dense`` ``(n, 13)`` float, ``sparse`` ``(n, 26)`` int64 bucket ids, ``labels`` ``(n,)`` float."""
    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.numel()

    def take(self, index: torch.Tensor) -> "CriteoRows":
        return CriteoRows(self.dense[index], self.sparse[index], self.labels[index])


def bucket(value: str, field: int, buckets: int) -> int:
    """The bucket of a categorical ``value`` of ``field``: a stable hash (blake2b of the
    field and value) modulo ``buckets``; the empty value hashes like any other."""
    digest = hashlib.blake2b(f"{field}:{value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % buckets


def read_criteo(path: str | Path, buckets: int, limit: int | None = None, distinct: bool = False) -> CriteoRows:
    """The rows of a Criteo ``train.txt``-format file (see the module's docstring); a row
    without 40 tab-separated fields, a label other than 0/1, or a non-integer count is a
    ``ValueError`` naming its line. ``distinct``: a line that repeats an earlier one is
    left out (``../shared/data/criteo/train_head10800.txt`` is its first 900 lines twelve
    times over: split as it is, every test row would be a training row)."""
    dense, sparse, labels = [], [], []
    seen: set[str] = set()
    with open(path, encoding="ascii") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and number > limit:
                break
            if distinct:
                if line in seen:
                    continue
                seen.add(line)
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 1 + DENSE_FIELDS + SPARSE_FIELDS or fields[0] not in ("0", "1"):
                raise ValueError(f"{path}:{number}: not a Criteo row (label 0/1, 13 integers, 26 categories)")
            try:
                counts = [int(x) if x else 0 for x in fields[1: 1 + DENSE_FIELDS]]
            except ValueError as e:
                raise ValueError(f"{path}:{number}: an integer field is not an integer ({e})") from e
            labels.append(float(fields[0]))
            dense.append([math.log1p(max(c, 0)) for c in counts])
            sparse.append([bucket(v, k, buckets) for k, v in enumerate(fields[1 + DENSE_FIELDS:])])
    return CriteoRows(torch.tensor(dense), torch.tensor(sparse, dtype=torch.int64), torch.tensor(labels))


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019): ``bottom`` MLP sizes from the dense features to ``dim``,
    ``len(table_rows)`` bag tables of ``dim`` columns (``mode`` sum, ``sparse`` gradients as
    asked, drawn as the reference implementation draws them), dot interactions, ``top`` MLP
    sizes after the interactions, to one logit.

    ``forward(dense (n, d), indices, offsets, per_sample_weights=None)``, the reference
    implementation's interface: ``indices[k]`` and ``offsets[k]`` are table ``k``'s flat ids
    and its ``n`` bag starts (``nn.EmbeddingBag``'s input and offsets), ``per_sample_weights[k]``
    its weights."""

    def __init__(self, dense_features: int, table_rows: list[int], dim: int = 16,
                 bottom: tuple[int, ...] = (64, 32), top: tuple[int, ...] = (64, 32), sparse: bool = False):
        super().__init__()
        self.bottom = mlp([dense_features, *bottom, dim])
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse) for rows in table_rows)
        for table in self.tables:   # the reference implementation's init: U(-1/sqrt(rows), 1/sqrt(rows))
            bound = 1 / math.sqrt(table.num_embeddings)
            nn.init.uniform_(table.weight, -bound, bound)
        vectors = 1 + len(table_rows)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        self.top = mlp([dim + vectors * (vectors - 1) // 2, *top, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor],
                per_sample_weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = [x]
        for k, table in enumerate(self.tables):
            weights = per_sample_weights[k] if per_sample_weights is not None else None
            vectors.append(table(indices[k], offsets[k], per_sample_weights=weights))
        stacked = torch.stack(vectors, dim=1)                              # (n, 1 + tables, dim)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def batch_inputs(rows: CriteoRows, weights: bool = False) -> tuple:
    """``(dense, indices, offsets[, per_sample_weights])`` for :meth:`DLRM.forward`: each
    sample's value of a field as a one-value bag of that field's table."""
    n = len(rows)
    starts = torch.arange(n)
    indices = [rows.sparse[:, k].contiguous() for k in range(rows.sparse.shape[1])]
    out = (rows.dense, indices, [starts] * len(indices))
    return out + ([torch.ones(n) for _ in indices],) if weights else out
