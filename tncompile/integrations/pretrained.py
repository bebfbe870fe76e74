"""``tncompile.compress_pretrained``: a smaller model that still does what the original did."""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..api import compile as compile_model
from ..train.distill import Distill, block_names
from ..train.fit import fit
from ..train.gates import freeze_gates
from ..train.history import History
from ..errors import check_int

__all__ = ["compress_pretrained"]


def compress_pretrained(model: nn.Module, target_ratio: float, data: Iterable, *, steps: int = 300,
                        calibration_batches: int = 8, distill: Distill | None = None, lr: float = 1e-4,
                        example_inputs: Any = None, mode: str = "swap", history: History | None = None,
                        progress: bool = True, **compile_kwargs: Any) -> nn.Module:
    """Compress a pretrained model to ``target_ratio`` of its size and recover
    what it knew, in one call:

    1. ``compile(model, target_ratio, calibration=<first calibration_batches of data>)``:
       networks fit to the layers' outputs, ranks allocated by sensitivity;
    2. rank gates frozen, then ``steps`` steps of distillation from ``model``
       (:func:`tncompile.fit` with ``teacher=model``; AdamW at ``lr``, decaying
       linearly to a tenth) on ``data``, which needs no labels.

    Parameters
    ----------
    model : nn.Module
        The teacher; never modified.
    target_ratio : float in (0, 1]
        ``params(result) / params(model)``.
    data : re-iterable of model inputs
        A list or DataLoader of input batches (a Tensor, tuple of args or dict
        of kwargs each), cycled for distillation; the first
        ``calibration_batches`` calibrate.
    steps : int
        Distillation steps (0: calibration only).
    distill : Distill, optional
        What to match (default: KL on logits when the output has them, else
        relative MSE on the main output, e.g. ``last_hidden_state``; in swap
        mode also the output of every block, ``Distill(hidden_blocks=True)``,
        when the model has a stack of them).
    example_inputs : optional
        To trace with (default: the first batch).
    mode : {"swap", "graph"}
        ``"swap"`` (default) returns the user's own model class with its layers
        swapped; ``"graph"`` a :class:`~tncompile.CompiledModel`.
    history : History, optional
        Filled with the distillation's per-step losses.
    **compile_kwargs
        More :func:`tncompile.compile` arguments (``target_modules``, ``prefer``, ...).

    Returns
    -------
    nn.Module
        The compressed model, in the training mode ``model`` had.
    """
    if isinstance(data, (Iterator, torch.Tensor, Mapping, str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(f"data must be a re-iterable collection of input batches (a list or a DataLoader), got "
                        f"{type(data).__name__}: it is read once to calibrate and again to distill")
    for name, value in (("steps", steps), ("calibration_batches", calibration_batches)):
        check_int(value, f"compress_pretrained: {name}", 0)
    if calibration_batches == 0:
        raise ValueError("compress_pretrained: calibration_batches must be >= 1 (8 batches of 32 is a good start)")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"compress_pretrained: lr must be > 0, got {lr!r}")
    for clash in ("calibration", "inplace"):
        if clash in compile_kwargs:
            raise TypeError(f"compress_pretrained sets {clash} itself (the original stays the teacher)")
    calibration = list(itertools.islice(iter(data), calibration_batches))
    if not calibration:
        raise ValueError("compress_pretrained: data yielded no batches")
    student = compile_model(model, target_ratio, example_inputs=example_inputs if example_inputs is not None
                            else calibration[0], calibration=calibration, mode=mode, **compile_kwargs)
    if steps:
        if distill is None:
            distill = Distill(hidden_blocks=mode == "swap" and bool(block_names(model)))
        freeze_gates(student)
        params = [p for p in student.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 - 0.9 * min(i, steps) / steps)
        fit(student, data, None, optimizer, steps=steps, teacher=model, distill=distill, scheduler=schedule,
            history=history, progress=progress)
    student.train(model.training)
    return student
