"""``tncompile.save`` / ``tncompile.load``: a compiled model in one file."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from .compiled import CompiledModel
from .ir.graph_codec import decode_graph_module, encode_graph_module
from .ir.program import Program

__all__ = ["save", "load", "FORMAT", "VERSION"]

FORMAT = "tncompile"
VERSION = 1


def save(compiled: CompiledModel, path: str | os.PathLike) -> None:
    """Write ``compiled`` (graph, layouts, ranks, weights, IR history) to ``path``.

    The write is atomic: a temporary file in the same directory is renamed
    over ``path`` only once complete, so a crash leaves any previous file intact.
    """
    if not isinstance(compiled, CompiledModel):
        raise TypeError(f"tncompile.save expects a CompiledModel, got {type(compiled).__name__}")
    prog = compiled.program
    payload = {
        "format": FORMAT, "version": VERSION, "torch": torch.__version__,
        "graph": encode_graph_module(compiled.model), "inputs": prog.inputs,
        "original_params": prog.original_params, "options": prog.options,
        "notes": prog.notes, "history": prog.history,
    }
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike, map_location=None) -> CompiledModel:
    """Rebuild a :class:`CompiledModel` saved by :func:`save`.

    Uses pickle (``weights_only=False``): load only files you trust.
    """
    payload = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a tncompile file (save it with tncompile.save)")
    if payload["version"] > VERSION:
        raise ValueError(f"{path} was written by a newer tncompile (format {payload['version']})")
    program = Program(decode_graph_module(payload["graph"]), payload["inputs"], payload["original_params"],
                      payload["options"])
    program.notes = dict(payload["notes"])
    program.history = list(payload["history"])
    return CompiledModel(program)
