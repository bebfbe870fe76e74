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


def corpus_key(train_files: Sequence[str | os.PathLike], vocab_size: int, special_tokens: Sequence[str] = ()) -> str:
    """A digest of the train files' bytes (in order), ``vocab_size``, the special tokens and
    the ``tokenizers`` version: a cache entry serves exactly the tokenizer these would train."""
    import tokenizers
    specials = "|".join(f"{len(t)}:{t}" for t in special_tokens)
    digest = hashlib.sha256(f"bpe|{vocab_size}|{tokenizers.__version__}".encode() + (f"|{specials}".encode()
                                                                                      if special_tokens else b""))
    for path in train_files:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def train_bpe(train_files: Sequence[str | os.PathLike], vocab_size: int,
              special_tokens: Sequence[str] = ()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a byte-level BPE trained on ``train_files`` alone; the special
    tokens (e.g. a masked LM's ``<pad>`` and ``<mask>``) take ids ``0, 1, ...``, which no text
    encodes to."""
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    tok.train([str(p) for p in train_files], vocab_size=vocab_size, min_frequency=2, show_progress=False,
              special_tokens=list(special_tokens))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _checked(vocab: object, merges: object, vocab_size: int,
             special_tokens: Sequence[str] = ()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The entry's vocabulary and merges, or ``ValueError`` naming what is wrong."""
    if not isinstance(vocab, dict) or not 0 < len(vocab) <= vocab_size:
        raise ValueError(f"the vocabulary is not an object of 1 to {vocab_size} entries")
    if any(vocab.get(t) != i for i, t in enumerate(special_tokens)):
        raise ValueError(f"the special tokens {list(special_tokens)} are not at ids 0, 1, ...")
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


def _read_entry(folder: Path, key: str, vocab_size: int, special_tokens: Sequence[str] = ()):
    from tncompile.files import read_bounded
    vocab = json.loads(read_bounded(folder / f"bpe-{key}.vocab.json", MAX_CACHE_BYTES).decode("utf-8"))
    merges = read_bounded(folder / f"bpe-{key}.merges.txt", MAX_CACHE_BYTES).decode("utf-8").split("\n")
    return _checked(vocab, [m for m in merges if m], vocab_size, special_tokens)


def corpus_tokenizer(train_files: Sequence[str | os.PathLike], vocab_size: int = 8192,
                     cache_dir: str | os.PathLike | None = None, special_tokens: Sequence[str] = ()):
    """The byte-level BPE tokenizer of ``train_files`` (``tokenizers.ByteLevelBPETokenizer``),
    from the cache when an entry for these files, ``vocab_size`` and ``special_tokens`` is
    there and sound, else trained (seconds) and cached."""
    from tokenizers import ByteLevelBPETokenizer
    from tncompile.files import private_folder, write_replacing
    folder = private_folder(cache_dir if cache_dir is not None else default_cache_dir())
    key = corpus_key(train_files, vocab_size, special_tokens)
    vocab = merges = None
    if (folder / f"bpe-{key}.vocab.json").exists() or (folder / f"bpe-{key}.vocab.json").is_symlink():
        try:
            vocab, merges = _read_entry(folder, key, vocab_size, special_tokens)
        except (OSError, ValueError, UnicodeDecodeError) as e:   # json.JSONDecodeError is a ValueError
            warnings.warn(f"pretrain_corpus: the cached tokenizer {key} in {folder} is refused ({e}); "
                          "training it again", UserWarning, stacklevel=2)
    if vocab is None:
        vocab, merges = train_bpe(train_files, vocab_size, special_tokens)
        write_replacing(folder / f"bpe-{key}.merges.txt", "".join(f"{a} {b}\n" for a, b in merges))
        write_replacing(folder / f"bpe-{key}.vocab.json", json.dumps(vocab, ensure_ascii=False))
    return ByteLevelBPETokenizer(vocab, merges)


#: a cached encoded split holds at most this many tokens (uint16 each)
MAX_CACHED_TOKENS = 64 << 20
#: source files in the corpus's shards start with this line
FILE_MARK = "# <<< file: "


def _pieces(text: str) -> list[str]:
    """``text`` cut before each file-mark line: each source file of a shard, encoded apart."""
    parts = text.split("\n" + FILE_MARK)
    return [p for p in [parts[0] + "\n" * (len(parts) > 1)]
            + [FILE_MARK + p + "\n" for p in parts[1:-1]] + [FILE_MARK + p for p in parts[1:][-1:]] if p]


def encoded_split(tokenizer, path: str | os.PathLike, tokenizer_key: str, vocab_size: int,
                  cache_dir: str | os.PathLike | None = None):
    """The token ids of the text file ``path`` (an ``int64`` tensor ``(tokens,)``), encoded with
    ``tokenizer`` in parallel (``encode_batch`` over the file's pieces) and cached.

    The cache entry is data: little-endian ``uint16`` ids, named by a digest of the file's
    bytes and ``tokenizer_key`` (the tokenizer's own cache key). It is read bounded and
    every id is checked to be below ``vocab_size``; an entry that fails is dropped with a
    warning and encoded again."""
    import numpy as np
    import torch
    from tncompile.files import private_folder, read_bounded, write_replacing
    if vocab_size > 1 << 16:
        raise ValueError(f"encoded_split stores uint16 ids: vocab_size {vocab_size} is above 65536")
    folder = private_folder(cache_dir if cache_dir is not None else default_cache_dir())
    digest = hashlib.sha256(tokenizer_key.encode() + b"\0")
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    entry = folder / f"ids-{digest.hexdigest()[:32]}.u16"
    if entry.exists() or entry.is_symlink():
        try:
            raw = read_bounded(entry, 2 * MAX_CACHED_TOKENS)
            if len(raw) % 2:
                raise ValueError("its length is not a whole number of uint16 ids")
            ids = torch.from_numpy(np.frombuffer(raw, dtype="<u2").astype(np.int64))
            if ids.numel() == 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"it is empty or holds an id at or above the vocabulary size {vocab_size}")
            return ids
        except (OSError, ValueError) as e:
            warnings.warn(f"pretrain_corpus: the cached encoding {entry.name} in {folder} is refused ({e}); "
                          "encoding again", UserWarning, stacklevel=2)
    with open(path, encoding="utf-8") as f:
        pieces = _pieces(f.read())
    ids = np.fromiter((i for enc in tokenizer.encode_batch(pieces) for i in enc.ids), dtype=np.int64)
    if ids.size > MAX_CACHED_TOKENS:
        raise ValueError(f"{path}: {ids.size:,} tokens, more than a cached split holds ({MAX_CACHED_TOKENS:,})")
    write_replacing(entry, ids.astype("<u2").tobytes())
    return torch.from_numpy(ids)

