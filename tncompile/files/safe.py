"""Files tncompile reads and writes beside the user's own: caches, configs, folders it saves.

Whatever is on disk may have been put there by someone else, so every such file goes
through here:

* :func:`read_bounded` opens without following a final link and without blocking (a FIFO
  or a device never stalls the process), reads regular files only, and at most ``limit``
  bytes;
* :func:`write_replacing` writes a new file beside the target (``O_EXCL``, mode 0600,
  never an existing path), syncs it and renames it over the target: a link planted at the
  target is replaced, never written through, and a crash leaves the old file whole;
* :func:`write_figure`: a matplotlib figure's PNG, written the same way;
* :func:`private_folder` makes a cache folder 0700 and refuses one another user owns or
  that others may write to (where anyone could plant or swap what tncompile reads back).

Model files have their own reader and writer (:mod:`tncompile.serialization`), built on
the same rules.
"""
from __future__ import annotations

import contextlib
import io
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["UnsafeFolderError", "read_bounded", "write_replacing", "write_figure", "private_folder", "open_lock_file"]


class UnsafeFolderError(OSError):
    """A cache folder that is not this user's alone (another owner, or writable by others)."""


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def read_bounded(path: str | os.PathLike, limit: int, *, follow_links: bool = False) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them (a final link
    followed only with ``follow_links``: a Hugging Face cache links its files to blobs).

    Raises
    ------
    OSError
        Missing, a link (``ELOOP``), unreadable, not a regular file, or over ``limit``
        bytes -- the message says which.
    """
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else _NOFOLLOW) | _CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise OSError(f"{path} is larger than {limit:,} bytes")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:   # grew while being read
            raise OSError(f"{path} is larger than {limit:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_replacing(path: str | os.PathLike, data: bytes | str, mode: int | None = 0o600) -> None:
    """Write ``data`` to ``path`` by a temporary file in the same folder renamed over it.

    The temporary file is created new (``O_EXCL``: never an existing path or link), filled,
    synced, given ``mode`` (``None``: what a new file gets under the umask, for files the
    user shares, such as a model folder's), then renamed over ``path``: whatever ``path``
    was -- a file or a link -- is replaced, not written through."""
    path = Path(path)
    if mode is None:
        mask = os.umask(0)
        os.umask(mask)
        mode = 0o666 & ~mask
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.fchmod(fd, mode)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        tmp = None
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)



def write_figure(fig, path: str | os.PathLike, dpi: int = 110, **savefig: Any) -> None:
    """A matplotlib figure as a PNG at ``path``, whole (:func:`write_replacing`, user file
    mode); ``savefig`` goes to ``fig.savefig`` (e.g. ``bbox_inches="tight"``). The figure
    stays open: closing it is the caller's."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi, **savefig)
    write_replacing(path, png.getvalue(), mode=None)

def private_folder(path: str | os.PathLike) -> Path:
    """``path`` as a folder only this user can write: made (with its parents) mode 0700 if
    missing; an existing one must be a folder this user owns that neither group nor others
    may write (else :class:`UnsafeFolderError` naming what is wrong and the fix)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolderError(f"{path} is not a folder")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise UnsafeFolderError(f"the cache folder {path} belongs to another user (uid {info.st_uid}); point "
                                "TNCOMPILE_CACHE_DIR (or tuning.WAY_CACHE_DIR) at a folder of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFolderError(f"the cache folder {path} may be written by others (mode "
                                f"{stat.S_IMODE(info.st_mode):o}); chmod 700 it, or point TNCOMPILE_CACHE_DIR "
                                "(or tuning.WAY_CACHE_DIR) at a folder of your own")
    return path


def open_lock_file(path: str | os.PathLike) -> int:
    """A descriptor on the lock file ``path`` (created 0600), opened without following a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
