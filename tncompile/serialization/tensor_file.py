"""Reading a safetensors file that may be hostile: bounded before it costs anything.

:func:`open_tensor_file` opens the path once (a FIFO, a device or anything but a regular
file is refused without blocking) and reads the 8-byte length -- at most
:data:`MAX_HEADER_BYTES` of header. The header is then parsed by the ``safetensors``
library itself, the reference parser, on the same open file (``/proc/self/fd``): a file it
refuses (a byte-order mark, UTF-16, a ``__metadata__`` that is no map, numbers past its
integers, invalid Unicode) tncompile refuses too, and its count of entries is bounded
(:data:`MAX_TENSORS`) before Python parses anything. tncompile's own reading of the same
bytes must then agree with it entry for entry (names, dtypes, shapes; a name given twice
is refused outright), and every entry is checked as safetensors does (a known dtype, a
shape whose bytes are its data's, the data back to back and covering the file exactly). No tensor is read
then: :class:`TensorFile` hands out each tensor's :class:`TensorSpec` (dtype, shape,
bytes), so everything a file claims can be checked against the manifest and the user's
model first, and :meth:`TensorFile.read` reads one tensor's bytes, on demand, from the
same open handle (a reader racing an atomic re-save sees the old file or the new one).
Each tensor is read from the file once and kept: the checksum (:meth:`TensorFile.digest`)
hashes exactly those buffers, and every later :meth:`TensorFile.read` hands them out, so
the bytes a load uses are the bytes that were verified -- a tensor changed in the file
between the two is never seen. The price is the file's tensors in memory once verified.
Everything that is wrong, an ``OSError`` included, is a ``ModelFileError`` naming the file.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelFileError
from .container import SAFETENSORS_DTYPES, digest_entry, raw_bytes

__all__ = ["TensorSpec", "TensorFile", "open_tensor_file", "MAX_HEADER_BYTES", "MAX_TENSORS", "MAX_DIMS"]

MAX_HEADER_BYTES = 16 << 20  # a 1B-parameter model's header is well under 1 MiB
MAX_TENSORS = 100_000
MAX_DIMS = 16


@dataclass(frozen=True)
class TensorSpec:
    """What the header says of one tensor: ``dtype``, ``shape`` and where its bytes are."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def numel(self) -> int:
        return math.prod(self.shape)


class TensorFile:
    """An open safetensors file whose header was checked (see the module doc)."""

    def __init__(self, path: Path, fd: int, metadata: dict[str, str], specs: dict[str, TensorSpec]):
        self.path, self._fd, self.metadata, self.specs = path, fd, metadata, specs
        self._held: dict[str, torch.Tensor] = {}   # each tensor as read, once: what is hashed and used

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``: read from the file the first time, the same buffer after."""
        held = self._held.get(name)
        if held is None:
            held = self._held[name] = self._read_once(name)
        return held

    def _read_once(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        out = torch.empty(spec.shape, dtype=spec.dtype, device="cpu")  # whatever default device is set
        view, done = raw_bytes(out), 0
        try:
            while done < spec.nbytes:
                got = os.preadv(self._fd, [view[done:]], spec.offset + done)
                if got <= 0:
                    raise ModelFileError(f"{self.path}: ends inside the tensor {name!r} (truncated while read)")
                done += got
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot be read ({e})") from e
        return out

    def digest(self, manifest: str | None) -> str:
        """:func:`~.container.digest` of the file's tensors: each read once (:meth:`read`)
        and its held buffer hashed -- the bytes later reads hand out."""
        h = hashlib.sha256()
        if manifest is not None:
            h.update(manifest.encode() + b"\0")
        for name in sorted(self.specs):
            spec = self.specs[name]
            h.update(digest_entry(name, spec.dtype, spec.shape))
            h.update(raw_bytes(self.read(name)))
        return h.hexdigest()

    def close(self) -> None:
        self._held = {}
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def open_tensor_file(path: Path, refuse: Callable[[bytes], str | None] | None = None) -> TensorFile:
    """Open ``path`` and check its header (see the module doc); ``refuse(head)``, given the
    file's first 9 bytes, may say why it is not one (a pickle) before its header is parsed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be opened ({e.strerror or e})") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ModelFileError(f"{path} is not a regular file (a FIFO, a device or a socket): give the file "
                                 "tncompile.save or save_pretrained wrote")
        head = os.pread(fd, 9, 0)
        why = refuse(head) if refuse is not None else None
        if why:
            raise ModelFileError(f"{path} {why}")
        size = info.st_size
        length = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
        if len(head) < 9 or not 2 <= length <= MAX_HEADER_BYTES or size < 8 + length:
            raise ModelFileError(_bad_length(path, size, length))
        raw = os.pread(fd, length, 8)
        if len(raw) != length:
            raise ModelFileError(f"{path}: shorter than its own header (truncated while read)")
        try:
            reference = _reference_entries(path, fd)   # the safetensors library's reading, bounded in count
        except _LibraryRefused:
            if length <= _EXPLAINED_BYTES:   # tncompile's own checks say what is wrong, where they see it too
                _parse_header(path, raw, 8 + length, size)
            raise
        metadata, specs = _parse_header(path, raw, 8 + length, size)
        _agree(path, specs, reference)
        return TensorFile(path, fd, metadata, specs)
    except ModelFileError:
        os.close(fd)
        raise
    except OSError as e:
        os.close(fd)
        raise ModelFileError(f"{path}: cannot be read ({e.strerror or e})") from e


class _LibraryRefused(ModelFileError):
    """The safetensors library does not read the file (its count of entries aside)."""


#: a header the library refuses is also read by tncompile's own checks, for a message that
#: names the fix (a truncated copy, a gap), where it is at most this long
_EXPLAINED_BYTES = 1 << 20


def _reference_entries(path: Path, fd: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``name -> (dtype code, shape)`` as the ``safetensors`` library parses the open file
    (through ``/proc/self/fd``: the very file checked, not whatever the path names now); a
    file it refuses is a ``ModelFileError``, and so is one of more than :data:`MAX_TENSORS`
    entries (counted here, before Python parses the header)."""
    same_file = f"/proc/self/fd/{fd}"
    try:
        with safe_open(same_file if os.path.exists(same_file) else str(path), framework="pt") as f:
            names = list(f.keys())
            if len(names) > MAX_TENSORS:
                raise ModelFileError(f"{path}: more than {MAX_TENSORS:,} tensors")
            out = {}
            for name in names:
                view = f.get_slice(name)
                out[name] = (view.get_dtype(), tuple(view.get_shape()))
            return out
    except ModelFileError:
        raise
    except (SafetensorError, OSError, ValueError) as e:
        raise _LibraryRefused(f"{path}: not a safetensors file the safetensors library reads ({str(e)[:200]})") from e


def _agree(path: Path, specs: dict[str, "TensorSpec"], reference: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """tncompile's reading of the header is the library's, entry for entry."""
    codes = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
    ours = {name: (codes[spec.dtype], spec.shape) for name, spec in specs.items()}
    if ours != reference:
        differ = sorted(set(ours) ^ set(reference)) or sorted(n for n in ours if ours[n] != reference[n])
        raise ModelFileError(f"{path}: its header reads differently to the safetensors library and to tncompile "
                             f"(first at {differ[0]!r:.80}): a crafted file")


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"the name {next(k for k in keys if keys.count(k) > 1)!r:.80} is given twice")
    return dict(pairs)


def _bad_length(path: Path, size: int, length: int) -> str:
    if length > MAX_HEADER_BYTES:
        return (f"{path} is not a tncompile file (a header of {length:,} bytes, at most {MAX_HEADER_BYTES:,}: "
                "another format, or a crafted file)")
    if length >= 2 and size < 8 + length:
        return (f"{path} is a truncated tncompile file ({size:,} bytes, shorter than its own header): an "
                "interrupted copy or save; copy or save it again")
    return f"{path} is not a tncompile file (save it with tncompile.save)"


def _parse_header(path: Path, raw: bytes, data_start: int, size: int) -> tuple[dict[str, str], dict[str, TensorSpec]]:
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: its header is not JSON ({type(e).__name__}: {str(e)[:120]})") from e
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: its header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ModelFileError(f"{path}: its metadata must map names to strings")
    specs, spans = {}, []
    for name, entry in header.items():
        if not (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}
                and entry["dtype"] in SAFETENSORS_DTYPES and isinstance(entry["shape"], list)
                and len(entry["shape"]) <= MAX_DIMS and isinstance(entry["data_offsets"], list)
                and len(entry["data_offsets"]) == 2
                and all(type(v) is int and v >= 0 for v in (*entry["shape"], *entry["data_offsets"]))):
            raise ModelFileError(f"{path}: the header entry {name!r:.80} is not a tensor's dtype, shape and offsets")
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise ModelFileError(f"{path}: the tensor {name!r:.80} of shape {shape} has {end - begin:,} bytes of data, "
                                 f"its shape needs {nbytes:,}")
        specs[name] = TensorSpec(dtype, shape, data_start + begin, nbytes)
        spans.append((begin, end))
    at = 0
    for begin, end in sorted(spans):
        if begin != at:
            raise ModelFileError(f"{path}: its tensors' data overlap or leave a gap (offset {begin:,}, expected {at:,})")
        at = end
    if data_start + at > size:
        raise ModelFileError(f"{path} is not a readable tncompile file (truncated by an interrupted copy or save: "
                             f"its tensors' data end at byte {data_start + at:,}, the file at {size:,}): copy or "
                             "save it again")
    if data_start + at < size:
        raise ModelFileError(f"{path} is not a readable tncompile file ({size - data_start - at:,} bytes after its "
                             "tensors' data): copy or save it again")
    return metadata, specs
