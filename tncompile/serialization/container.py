"""The bytes of a model file: a safetensors container, written atomically (reading one,
bounded against a hostile file, is :mod:`.tensor_file`).

Writing (:func:`write_atomically`): the file is streamed into a temporary in
the same directory, fsynced, given the mode of the file it replaces (or the
umask's), renamed over the target and the directory entry synced. Each
temporary (``.tnc-<random>.tmp``, a short name whatever the target's) is locked
(``flock``) by its writer for as long as it writes; a later save into the
directory removes only temporaries whose lock it can take (their writer is
gone: the kernel drops a dead process's locks) and that have not been written
to for :data:`STALE_SECONDS`. Failures are ``OSError``\\ s naming the path,
and leave the previous file as it was.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Callable

import torch

__all__ = ["write_atomically", "raw_bytes", "encode_container", "digest", "digest_entry", "STALE_SECONDS", "TEMPORARY",
           "SAFETENSORS_DTYPES"]

#: the dtypes a file may hold, by their safetensors codes
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}

STALE_SECONDS = 60.0             # a temporary nobody holds and nobody wrote to for this long is an orphan
_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
#: a temporary's name: short, so a target at the file system's name limit still has one
TEMPORARY = re.compile(r"^\.tnc-[0-9a-f]{16}\.tmp$")


# ----------------------------------------------------------------- checksum
def digest_entry(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """What the checksum hashes of a tensor before its bytes (its name, dtype and shape)."""
    return f"{name}:{dtype}:{shape};".encode()


def digest(tensors: dict[str, torch.Tensor], manifest: str | None = None) -> str:
    """SHA-256 over the manifest (when given), then every tensor's name, dtype, shape and
    bytes, in name order: what proves a file undamaged (not benign: anyone can reseal)."""
    h = hashlib.sha256()
    if manifest is not None:
        h.update(manifest.encode() + b"\0")
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(digest_entry(key, t.dtype, tuple(t.shape)))
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the bytes, not copied
    return h.hexdigest()


# ----------------------------------------------------------------- writing
def raw_bytes(t: torch.Tensor) -> memoryview:
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B") if nbytes else memoryview(b"")


def encode_container(tensors: dict[str, torch.Tensor], metadata: dict[str, str]
                     ) -> tuple[bytes, list[torch.Tensor]]:
    """The header bytes (length prefix included) and the tensors in file order
    (widest dtype first, so every tensor stays aligned to its element size)."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    entries, offset, body = {}, 0, []
    for key in order:
        t = tensors[key].detach().to("cpu").contiguous()
        if t.dtype not in _CODES:
            raise TypeError(f"cannot save tensor {key} of dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        entries[key] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        body.append(t)
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header, body


def remove_orphaned_temporaries(directory: Path) -> list[Path]:
    """Delete temporaries of earlier saves into ``directory`` whose writer is provably gone:
    their lock can be taken, and nobody wrote to them for :data:`STALE_SECONDS`."""
    removed = []
    try:
        candidates = [p for p in directory.iterdir() if TEMPORARY.match(p.name)]
    except OSError:
        return removed
    for tmp in candidates:
        try:
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live writer: leave it
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and time.time() - info.st_mtime > STALE_SECONDS:
                os.unlink(tmp)
                removed.append(tmp)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _os_error(e: OSError, path: Path) -> OSError:
    err = OSError(e.errno, f"tncompile.save: cannot write {path}: {e.strerror or e}", str(path))
    err.__cause__ = e
    return err


def _mode_for(path: Path) -> int:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)  # a re-save keeps the file's mode
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def write_atomically(path: Path, header: bytes, body: list[torch.Tensor],
                     on_written: Callable[[], None] | None = None) -> None:
    """Write ``header`` then each tensor's bytes to ``path`` atomically (see the module docstring)."""
    directory = path.parent if str(path.parent) else Path(".")
    remove_orphaned_temporaries(directory)
    mode = _mode_for(path)
    tmp = None
    fd = -1
    try:
        for _ in range(100):
            tmp = directory / f".tnc-{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(errno.EEXIST, "no free temporary name", str(directory))
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours while we write: nobody else removes it
        with os.fdopen(os.dup(fd), "wb", buffering=1 << 20) as f:
            f.write(header)
            for t in body:
                f.write(raw_bytes(t))
            f.flush()
            os.fsync(f.fileno())
        os.fchmod(fd, mode)
        if on_written is not None:
            on_written()
        os.replace(tmp, path)
        tmp = None
        _sync_directory(directory)
    except OSError as e:
        raise _os_error(e, path) from e
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. not supported on this platform
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
