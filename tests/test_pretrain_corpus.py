"""Issue 66: the pretraining study's BPE tokenizer is trained on the train files alone and
cached as data (vocabulary and merges); a cache entry that is not sound is refused whole."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("tokenizers")
import pretrain_corpus  # noqa: E402

TEXT = "".join(f"def function_{i % 7}(x, y):\n    return x * {i} + y  # note {i % 3}\n" for i in range(400))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(TEXT)
    return [path]


def test_trained_once_then_served_from_the_cache(tmp_path, corpus, monkeypatch):
    cache = tmp_path / "cache"
    first = pretrain_corpus.corpus_tokenizer(corpus, vocab_size=300, cache_dir=cache)
    assert sorted(p.name.split(".", 1)[1] for p in cache.iterdir()) == ["merges.txt", "vocab.json"]
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    monkeypatch.setattr(pretrain_corpus, "train_bpe", lambda *a: pytest.fail("retrained a cached tokenizer"))
    again = pretrain_corpus.corpus_tokenizer(corpus, vocab_size=300, cache_dir=cache)
    sample = "def function_3(x, y):\n    return x * 17 + y\n"
    assert again.encode(sample).ids == first.encode(sample).ids
    assert again.decode(again.encode(sample).ids) == sample
    assert len(first.encode(sample).ids) < len(sample.encode()) / 2      # merges learned


def test_other_files_or_sizes_get_their_own_entry(tmp_path, corpus):
    cache = tmp_path / "cache"
    pretrain_corpus.corpus_tokenizer(corpus, vocab_size=300, cache_dir=cache)
    pretrain_corpus.corpus_tokenizer(corpus, vocab_size=280, cache_dir=cache)
    corpus[0].write_text(TEXT + "class Extra:\n    pass\n")
    pretrain_corpus.corpus_tokenizer(corpus, vocab_size=300, cache_dir=cache)
    assert len(list(cache.glob("*.vocab.json"))) == 3


@pytest.mark.parametrize("damage", ["duplicate id", "id too large", "not json", "foreign merge", "link"])
def test_an_unsound_cache_entry_is_refused_and_trained_again(tmp_path, corpus, damage):
    cache = tmp_path / "cache"
    good = pretrain_corpus.corpus_tokenizer(corpus, vocab_size=300, cache_dir=cache)
    vocab_file = next(cache.glob("*.vocab.json"))
    merges_file = next(cache.glob("*.merges.txt"))
    vocab = json.loads(vocab_file.read_text())
    if damage == "duplicate id":
        vocab["zzz-new"] = 0
        vocab_file.write_text(json.dumps(vocab))
    elif damage == "id too large":
        vocab[next(iter(vocab))] = 10 ** 9
        vocab_file.write_text(json.dumps(vocab))
    elif damage == "not json":
        vocab_file.write_text("{")
    elif damage == "foreign merge":
        merges_file.write_text(merges_file.read_text() + "qqq www\n")
    else:
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps(vocab))
        vocab_file.unlink()
        os.symlink(target, vocab_file)
    with pytest.warns(UserWarning, match="refused"):
        again = pretrain_corpus.corpus_tokenizer(corpus, vocab_size=300, cache_dir=cache)
    sample = "def function_5(x, y):\n"
    assert again.encode(sample).ids == good.encode(sample).ids
    assert not vocab_file.is_symlink()                                   # replaced, not written through


def test_a_split_is_encoded_file_by_file_once_then_read_from_the_cache(tmp_path, corpus, monkeypatch):
    cache = tmp_path / "cache"
    text = "".join(f"# <<< file: Lib/m{i}.py >>>\n" + "\n".join(TEXT.splitlines()[: 10 + i]) + "\n" for i in range(5))
    split = tmp_path / "valid.txt"
    split.write_text(text)
    assert "".join(pretrain_corpus._pieces(text)) == text and len(pretrain_corpus._pieces(text)) == 5
    tok = pretrain_corpus.corpus_tokenizer(corpus, vocab_size=300, cache_dir=cache)
    key = pretrain_corpus.corpus_key(corpus, 300)
    ids = pretrain_corpus.encoded_split(tok, split, key, 300, cache_dir=cache)
    assert ids.dtype == torch.int64 and tok.decode(ids.tolist()) == text
    monkeypatch.setattr(type(tok), "encode_batch", lambda *a, **k: pytest.fail("encoded a cached split again"))
    assert torch.equal(pretrain_corpus.encoded_split(tok, split, key, 300, cache_dir=cache), ids)
    assert len(list(cache.glob("ids-*.u16"))) == 1
    split.write_text(text + "x = 1\n")                                   # other bytes: their own entry
    monkeypatch.undo()
    pretrain_corpus.encoded_split(tok, split, key, 300, cache_dir=cache)
    assert len(list(cache.glob("ids-*.u16"))) == 2


@pytest.mark.parametrize("damage", ["odd length", "id too large", "empty", "link"])
def test_an_unsound_cached_split_is_refused_and_encoded_again(tmp_path, corpus, damage):
    cache = tmp_path / "cache"
    split = tmp_path / "test.txt"
    split.write_text(TEXT[:2000])
    tok = pretrain_corpus.corpus_tokenizer(corpus, vocab_size=300, cache_dir=cache)
    key = pretrain_corpus.corpus_key(corpus, 300)
    good = pretrain_corpus.encoded_split(tok, split, key, 300, cache_dir=cache)
    entry = next(cache.glob("ids-*.u16"))
    if damage == "odd length":
        entry.write_bytes(entry.read_bytes() + b"\0")
    elif damage == "id too large":
        entry.write_bytes(entry.read_bytes()[:-2] + (299 + 1).to_bytes(2, "little"))
    elif damage == "empty":
        entry.write_bytes(b"")
    else:
        target = tmp_path / "elsewhere.u16"
        target.write_bytes(entry.read_bytes())
        entry.unlink()
        os.symlink(target, entry)
    with pytest.warns(UserWarning, match="refused"):
        again = pretrain_corpus.encoded_split(tok, split, key, 300, cache_dir=cache)
    assert torch.equal(again, good)
    assert not entry.is_symlink()
