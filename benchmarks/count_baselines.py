"""Count n-gram baselines for the pretraining study (issue 66): what a neural LM must beat.

``CountBaselines.fit(train_ids, vocab_size)`` counts unigrams, bigrams and trigrams of the
train tokens; ``perplexities(valid, test)`` gives each model's perplexity, the unigram and
bigram with add-one smoothing and an interpolated trigram

    p(c | a, b) = l3 C(abc)/C(ab) + l2 C(bc)/C(b) + l1 C(c)/N + l0 / V

whose weights are fit on ``valid`` alone by EM (Jelinek-Mercer), then applied to ``test``.
Counts are kept as sorted unique keys with their counts (``torch.unique``), looked up by
``searchsorted``: no ``V^2`` or ``V^3`` table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def _key(*columns: torch.Tensor, vocab_size: int) -> torch.Tensor:
    key = torch.zeros_like(columns[0], dtype=torch.int64)
    for c in columns:
        key = key * vocab_size + c.to(torch.int64)
    return key


@dataclass
class _Counts:
    keys: torch.Tensor      # sorted unique int64 keys
    counts: torch.Tensor    # their counts (float64)

    @classmethod
    def of(cls, keys: torch.Tensor) -> "_Counts":
        unique, counts = torch.unique(keys, sorted=True, return_counts=True)
        return cls(unique, counts.to(torch.float64))

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Count of each key (0 where unseen)."""
        if self.keys.numel() == 0:
            return torch.zeros(keys.shape, dtype=torch.float64)
        at = torch.searchsorted(self.keys, keys).clamp_max(self.keys.numel() - 1)
        return torch.where(self.keys[at] == keys, self.counts[at], torch.zeros((), dtype=torch.float64))


@dataclass
class CountBaselines:
    """Unigram, bigram and trigram counts of a token stream.

    Attributes
    ----------
    vocab_size : int
    weights : tuple of float
        ``(l3, l2, l1, l0)`` of the interpolated trigram, after :meth:`tune` (EM on valid).
    """

    vocab_size: int
    unigrams: torch.Tensor = field(repr=False)
    bigrams: _Counts = field(repr=False)
    trigrams: _Counts = field(repr=False)
    weights: tuple[float, float, float, float] = (0.4, 0.3, 0.2, 0.1)

    @classmethod
    def fit(cls, ids: torch.Tensor, vocab_size: int) -> "CountBaselines":
        """Counts of the 1-D token stream ``ids`` (train split only)."""
        ids = ids.reshape(-1).to(torch.int64)
        if ids.numel() < 3 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"ids: need at least 3 tokens, each in [0, {vocab_size})")
        uni = torch.bincount(ids, minlength=vocab_size).to(torch.float64)
        bi = _Counts.of(_key(ids[:-1], ids[1:], vocab_size=vocab_size))
        tri = _Counts.of(_key(ids[:-2], ids[1:-1], ids[2:], vocab_size=vocab_size))
        return cls(vocab_size, uni, bi, tri)

    def _parts(self, ids: torch.Tensor) -> torch.Tensor:
        """``(T - 2, 4)``: each order's probability of tokens ``ids[2:]`` given the two before
        (trigram, bigram, unigram maximum-likelihood estimates, 0 where the context is
        unseen, and the uniform ``1/V``)."""
        ids = ids.reshape(-1).to(torch.int64)
        a, b, c = ids[:-2], ids[1:-1], ids[2:]
        v = self.vocab_size
        ab = self.bigrams.lookup(_key(a, b, vocab_size=v))
        abc = self.trigrams.lookup(_key(a, b, c, vocab_size=v))
        bc = self.bigrams.lookup(_key(b, c, vocab_size=v))
        cb = self.unigrams[b]
        tri = torch.where(ab > 0, abc / ab.clamp_min(1), torch.zeros((), dtype=torch.float64))
        bi = torch.where(cb > 0, bc / cb.clamp_min(1), torch.zeros((), dtype=torch.float64))
        uni = self.unigrams[c] / self.unigrams.sum()
        return torch.stack([tri, bi, uni, torch.full_like(uni, 1.0 / v)], dim=1)

    def tune(self, valid_ids: torch.Tensor, iterations: int = 50) -> tuple[float, ...]:
        """Fit the interpolation weights on ``valid_ids`` by EM (each step cannot lower the
        valid likelihood); kept in :attr:`weights`."""
        parts = self._parts(valid_ids)
        w = torch.tensor(self.weights, dtype=torch.float64)
        for _ in range(iterations):
            joint = parts * w
            w = (joint / joint.sum(1, keepdim=True)).mean(0)
        self.weights = tuple(float(x) for x in w)
        return self.weights

    def perplexity(self, ids: torch.Tensor, model: str = "trigram") -> float:
        """Perplexity of ``ids[2:]`` (the first two tokens are context) under ``"trigram"``
        (interpolated, :attr:`weights`), ``"bigram"`` or ``"unigram"`` (add-one)."""
        ids = ids.reshape(-1).to(torch.int64)
        v = self.vocab_size
        if model == "trigram":
            p = (self._parts(ids) * torch.tensor(self.weights, dtype=torch.float64)).sum(1)
        elif model == "bigram":
            b, c = ids[1:-1], ids[2:]
            p = (self.bigrams.lookup(_key(b, c, vocab_size=v)) + 1) / (self.unigrams[b] + v)
        elif model == "unigram":
            p = (self.unigrams[ids[2:]] + 1) / (self.unigrams.sum() + v)
        else:
            raise ValueError(f"model={model!r}: one of 'trigram', 'bigram', 'unigram'")
        return math.exp(-float(p.log().mean()))
