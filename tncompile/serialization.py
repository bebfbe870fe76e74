"""``tncompile.save`` / ``tncompile.load``: a compiled model in one file."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .compiled import CompiledModel
from .ir.graph_codec import decode_graph_module, encode_graph_module
from .ir.program import Program

__all__ = ["save", "load", "resume", "FORMAT", "VERSION"]

FORMAT = "tncompile"
VERSION = 1


def save(compiled: CompiledModel, path: str | os.PathLike, *, optimizer: torch.optim.Optimizer | None = None,
         controller=None, extra: dict[str, Any] | None = None, rng: bool = True) -> None:
    """Write ``compiled`` (graph, layouts, current ranks, weights, gates, IR
    history) to ``path``, optionally with what resuming training needs.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer, optional
        Its state is saved keyed by parameter name (restored by :func:`resume`).
    controller : RankController, optional
        Its schedule, targets and loss average.
    extra : dict, optional
        Anything picklable (``tncompile.fit`` stores its history here).
    rng : bool
        Save the CPU (and initialized CUDA) random generators' states, so a
        resumed run draws the same dropout masks.

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
        "notes": prog.notes, "history": prog.history, "compiled_ratio": prog.compiled_ratio,
        "training": _training_state(compiled, optimizer, controller, extra, rng),
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


def _param_names(compiled: CompiledModel, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Per param group, the names of its parameters in the compiled model."""
    names = {id(p): n for n, p in compiled.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"the optimizer holds parameters that are not the compiled model's "
                             f"(shapes {missing[:3]}); build it from the model being saved")
        out.append([names[id(p)] for p in group["params"]])
    return out


def _training_state(compiled, optimizer, controller, extra, rng) -> dict[str, Any] | None:
    if optimizer is None and controller is None and extra is None and not rng:
        return None
    state: dict[str, Any] = {"extra": extra}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        state["optimizer_names"] = _param_names(compiled, optimizer)
        state["optimizer_class"] = type(optimizer).__name__
    if controller is not None:
        state["controller"] = controller.state_dict()
    if rng:
        state["rng"] = {"cpu": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}
    return state


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
    program.compiled_ratio = payload.get("compiled_ratio", payload["history"][-1].ratio if payload["history"] else None)
    compiled = CompiledModel(program)
    compiled.training_state = payload.get("training")
    return compiled


def resume(compiled: CompiledModel, optimizer: torch.optim.Optimizer | None = None, controller=None, *,
           restore_rng: bool = True) -> dict[str, Any]:
    """Restore the training state a checkpoint carried into a loaded model's
    new optimizer and controller; returns the checkpoint's ``extra`` dict.

    Build ``optimizer`` from the loaded model exactly as in the first run
    (same parameter groups, e.g. ``param_groups(compiled, ...)``); the saved
    state is matched by parameter name and a mismatch is an error.

    Example
    -------
    >>> compiled = tncompile.load("ckpt.pt")
    >>> opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3))
    >>> ctl = tncompile.RankController(compiled, opt, target_ratio=0.01)
    >>> extra = tncompile.resume(compiled, opt, ctl)
    """
    state = getattr(compiled, "training_state", None)
    if state is None:
        raise ValueError("this model carries no training state: load it with tncompile.load from a file "
                         "written by tncompile.save(..., optimizer=..., controller=...)")
    if optimizer is not None:
        if "optimizer" not in state:
            raise ValueError("the checkpoint has no optimizer state (save with optimizer=...)")
        if state["optimizer_class"] != type(optimizer).__name__:
            raise ValueError(f"the checkpoint's optimizer is {state['optimizer_class']}, "
                             f"got {type(optimizer).__name__}")
        names = _param_names(compiled, optimizer)
        if names != state["optimizer_names"]:
            raise ValueError("the optimizer's parameter groups differ from the saved one's; build it "
                             "the same way (same groups, same order) from the loaded model")
        optimizer.load_state_dict(state["optimizer"])
    if controller is not None:
        if "controller" not in state:
            raise ValueError("the checkpoint has no controller state (save with controller=...)")
        controller.load_state_dict(state["controller"])
    if restore_rng and state.get("rng") is not None:
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    compiled.training_state = None
    return dict(state.get("extra") or {})
