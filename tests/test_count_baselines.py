"""Issue 66: the count baselines a pretrained LM must beat -- add-one unigram and bigram, an
interpolated trigram with its weights fit on valid by EM."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from count_baselines import CountBaselines  # noqa: E402


def test_unigram_and_bigram_are_their_add_one_formulas():
    ids = torch.tensor([0, 1, 2, 1, 2, 1, 0, 2])
    m = CountBaselines.fit(ids, vocab_size=4)
    held = torch.tensor([1, 2, 1, 3])
    uni = [(m.unigrams[t] + 1) / (8 + 4) for t in (1, 3)]                    # tokens held[2:]
    assert m.perplexity(held, "unigram") == pytest.approx(math.exp(-sum(math.log(p) for p in uni) / 2))
    # bigram p(c | b) = (C(bc) + 1) / (C(b) + V): (2,1): C=2, C(2)=3; (1,3): C=0, C(1)=3
    bi = [(2 + 1) / (3 + 4), (0 + 1) / (3 + 4)]
    assert m.perplexity(held, "bigram") == pytest.approx(math.exp(-sum(math.log(p) for p in bi) / 2))


def test_a_deterministic_sequence_is_learned_and_em_only_raises_the_valid_likelihood():
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, 50, (30,), generator=g)
    train, valid = pattern.repeat(200), pattern.repeat(20)
    m = CountBaselines.fit(train, vocab_size=64)
    before = m.perplexity(valid)
    weights = m.tune(valid)
    assert sum(weights) == pytest.approx(1.0) and all(w >= 0 for w in weights)
    assert m.perplexity(valid) <= before and m.perplexity(valid) < 1.1           # the trigram knows the pattern
    assert m.perplexity(valid, "trigram") < m.perplexity(valid, "bigram") < m.perplexity(valid, "unigram")


def test_unseen_contexts_and_bad_input():
    m = CountBaselines.fit(torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), vocab_size=8)
    assert math.isfinite(m.perplexity(torch.tensor([7, 6, 5, 4])))               # the uniform share covers them
    with pytest.raises(ValueError, match="each in"):
        CountBaselines.fit(torch.tensor([0, 1, 9]), vocab_size=8)
    with pytest.raises(ValueError, match="one of"):
        m.perplexity(torch.tensor([0, 1, 2]), "fourgram")
