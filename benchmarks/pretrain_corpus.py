"""The pretraining study's tokenizer (issue 66): byte-level BPE trained on the code corpus's
train shards only, and cached.

    from pretrain_corpus import corpus_tokenizer
    tok = corpus_tokenizer(["../shared/data/python-code/train-00.txt", ...], vocab_size=8192)

The cache holds data only: the vocabulary (a JSON object of token -> id) and the merges
(one ``a b`` pair a line), in a private folder (``tncompile.files.private_folder``),
written atomically, named by a digest of the train files' bytes, the vocabulary size and
the ``tokenizers`` version. What the tokenizer *is* (byte-level pre-tokenizer, decoder)
comes from this code. A cache entry is read bounded and checked -- ids unique and within
the vocabulary, at most ``vocab_size`` merges of two tokens the vocabulary holds -- and an
entry that fails is dropped with a warning and trained again, never half-used.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Sequence

MAX_CACHE_BYTES = 16 << 20
CACHE_ENV = "TNCOMPILE_PRETRAIN_CACHE"


def default_cache_dir() -> Path:
    """``$TNCOMPILE_PRETRAIN_CACHE``, else ``~/.cache/tncompile/pretrain``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tncompile" / "pretrain")


def corpus_key(train_files: Sequence[str | os.PathLike], vocab_size: int) -> str:
    """A digest of the train files' bytes (in order), ``vocab_size`` and the ``tokenizers``
    version: a cache entry serves exactly the tokenizer these would train."""
    import tokenizers
    digest = hashlib.sha256(f"bpe|{vocab_size}|{tokenizers.__version__}".encode())
    for path in train_files:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def train_bpe(train_files: Sequence[str | os.PathLike], vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a byte-level BPE trained on ``train_files`` alone."""
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    tok.train([str(p) for p in train_files], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _checked(vocab: object, merges: object, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The entry's vocabulary and merges, or ``ValueError`` naming what is wrong."""
    if not isinstance(vocab, dict) or not 0 < len(vocab) <= vocab_size:
        raise ValueError(f"the vocabulary is not an object of 1 to {vocab_size} entries")
    ids = set()
    for token, i in vocab.items():
        if not isinstance(token, str) or type(i) is not int or not 0 <= i < vocab_size or i in ids:
            raise ValueError("a vocabulary entry is not a token with a unique id below the vocabulary size")
        ids.add(i)
    if not isinstance(merges, list) or len(merges) > vocab_size:
        raise ValueError(f"the merges are not a list of at most {vocab_size}")
    pairs = []
    for line in merges:
        parts = line.split(" ") if isinstance(line, str) else None
        if parts is None or len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise ValueError("a merge is not two tokens of the vocabulary")
        pairs.append((parts[0], parts[1]))
    return vocab, pairs


def _read_entry(folder: Path, key: str, vocab_size: int):
    from tncompile.files import read_bounded
    vocab = json.loads(read_bounded(folder / f"bpe-{key}.vocab.json", MAX_CACHE_BYTES).decode("utf-8"))
    merges = read_bounded(folder / f"bpe-{key}.merges.txt", MAX_CACHE_BYTES).decode("utf-8").split("\n")
    return _checked(vocab, [m for m in merges if m], vocab_size)


def corpus_tokenizer(train_files: Sequence[str | os.PathLike], vocab_size: int = 8192,
                     cache_dir: str | os.PathLike | None = None):
    """The byte-level BPE tokenizer of ``train_files`` (``tokenizers.ByteLevelBPETokenizer``),
    from the cache when an entry for these files and ``vocab_size`` is there and sound,
    else trained (seconds) and cached."""
    from tokenizers import ByteLevelBPETokenizer
    from tncompile.files import private_folder, write_replacing
    folder = private_folder(cache_dir if cache_dir is not None else default_cache_dir())
    key = corpus_key(train_files, vocab_size)
    vocab = merges = None
    if (folder / f"bpe-{key}.vocab.json").exists() or (folder / f"bpe-{key}.vocab.json").is_symlink():
        try:
            vocab, merges = _read_entry(folder, key, vocab_size)
        except (OSError, ValueError, UnicodeDecodeError) as e:   # json.JSONDecodeError is a ValueError
            warnings.warn(f"pretrain_corpus: the cached tokenizer {key} in {folder} is refused ({e}); "
                          "training it again", UserWarning, stacklevel=2)
    if vocab is None:
        vocab, merges = train_bpe(train_files, vocab_size)
        write_replacing(folder / f"bpe-{key}.merges.txt", "".join(f"{a} {b}\n" for a, b in merges))
        write_replacing(folder / f"bpe-{key}.vocab.json", json.dumps(vocab, ensure_ascii=False))
    return ByteLevelBPETokenizer(vocab, merges)
