"""``tncompile.fit``: a complete rank-adaptive training loop (early stage, late stage)."""
from __future__ import annotations

import itertools
import os
import sys
from time import perf_counter
from collections import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import check_int, check_materialized, is_int
from ..runtime.layers import TNModule
from .controller import RankController
from .distill import Distill, Teacher, distill_loss
from .ddp import DistributedModel, rank, save_on_rank0, unwrap
from .sharding import is_sharded
from .history import History
from .train_step import TrainStep

__all__ = ["fit", "FitSettings"]


def _batches(loader: Iterable, skip: int):
    """Cycle through ``loader`` forever, dropping the first ``skip`` batches."""
    def forever():
        while True:
            empty = True
            for batch in loader:
                empty = False
                yield batch
            if empty:
                raise ValueError("fit: train_loader yielded no batches")
    return itertools.islice(forever(), skip, None)


def _unpack(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError("fit: each batch must be a pair (inputs, targets); inputs may be a tensor, "
                     f"a tuple or a dict. Got {type(batch).__name__}"
                     + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))


def fit(compiled: nn.Module, train_loader: Iterable, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None, controller: RankController | None = None,
        early_steps: int = 0, late_steps: int = 0,
        eval_fn: Callable[[nn.Module], float | dict[str, float]] | None = None, *,
        steps: int | None = None, teacher: nn.Module | None = None, distill: Distill | None = None,
        eval_every: int | None = None, log_every: int = 10, grad_clip: float | None = None,
        checkpoint_path: str | os.PathLike | None = None, checkpoint_every: int | None = None,
        history: History | dict | None = None, scheduler: Any = None, cuda_graph: bool | str = "auto",
        progress: bool = True, ddp: dict[str, Any] | None = None) -> History:
    """Train ``compiled``: with a ``controller``, ``early_steps`` early-stage then
    ``late_steps`` late-stage steps of CoMERA's rank-adaptive schedule; without
    one, ``steps`` steps at fixed ranks (fine-tuning, distillation; freeze the
    rank gates with :func:`tncompile.freeze_gates` to train cores only).

    Each step: ``task = loss_fn(compiled(inputs), targets)`` (plus the
    distillation terms with a ``teacher``), backward on
    ``task + controller.penalty(task)``, optional gradient clipping,
    ``optimizer.step()``, ``controller.step()`` (which may cut ranks).

    Parameters
    ----------
    train_loader : iterable
        Cycled as often as needed. Batches are pairs ``(inputs, targets)``; with
        ``loss_fn=None`` (distillation alone) each batch is the inputs alone
        (unlabeled). Inputs are passed as ``compiled(x)``, ``compiled(*x)``
        (tuple) or ``compiled(**x)`` (dict).
    loss_fn : callable, optional
        ``loss_fn(outputs, targets) -> scalar``; ``None`` needs a ``teacher``.
    controller : RankController, optional
        Rank adaptation; ``None`` trains at fixed ranks for ``steps`` steps.
    early_steps, late_steps : int
        Stage lengths with a controller; it switches stage after ``early_steps``
        steps (counted from the start of the run, across resumes).
    steps : int, optional
        Steps without a controller (counted across resumes).
    teacher : nn.Module, optional
        The original model to distill from (:mod:`tncompile.train.distill`): run
        on every batch in eval mode without autograd, never modified, sharing no
        parameter with the student. Steps run eagerly (not captured).
    distill : Distill, optional
        Which outputs to match and how much (default ``Distill()``: KL on logits
        when the teacher's output has them, else relative MSE on its main output).
    eval_fn : callable, optional
        ``eval_fn(compiled) -> float or {metric: value}``, called in eval mode
        under ``torch.no_grad()`` every ``eval_every`` steps (default: at the
        stage switch) and at the end.
    log_every : int
        Steps between logging switched-on ranks into the history.
    checkpoint_path, checkpoint_every : optional
        Save model, optimizer, controller, RNG and history every this many
        steps (atomically). To resume, load the file in any process, build the
        optimizer and controller as before, call :func:`tncompile.resume`, and
        call ``fit`` again with the same arguments and ``history=extra["history"]``
        (and ``scheduler.load_state_dict(extra["scheduler"])`` if you use one):
        it continues at the controller's step, skipping the batches already
        seen (exact when the loader yields the same order each epoch).
    scheduler : optional
        A learning-rate scheduler stepped after every optimizer step.
    cuda_graph : {"auto", True, False}
        Each step runs through :class:`~tncompile.train.TrainStep`: captured
        as CUDA graphs on a GPU (``"auto"``), eagerly elsewhere.
    progress : bool
        A progress bar on stderr: redrawn in a terminal; when stderr is not a
        terminal (a log file, CI), a line every 30 s. Only rank 0 shows it
        when distributed.
    ddp : dict, optional
        Train under ``DistributedDataParallel`` with these keyword arguments
        (``{}`` for the defaults; ``torch.distributed`` must be initialized):
        the model is wrapped in a :class:`~tncompile.distributed.DistributedModel`,
        rebuilt after every cut. ``compiled`` may also be such a wrapper already.
        Checkpoints are written by rank 0.

    Returns
    -------
    History
        Losses, ratio, step times, ranks, stage switches, truncations, evals.
        With a ``teacher``, ``task_loss`` is the whole distillation objective
        (its terms plus the weighted task loss); without a controller every
        step's ``stage`` is ``"fixed"``.
    """
    settings = FitSettings(early_steps=early_steps, late_steps=late_steps, steps=steps, eval_every=eval_every,
                           log_every=log_every, grad_clip=grad_clip, checkpoint_path=checkpoint_path,
                           checkpoint_every=checkpoint_every, cuda_graph=cuda_graph, progress=progress)
    check_materialized(unwrap(compiled), "tncompile.fit")
    _check_run(settings, train_loader, loss_fn, optimizer, controller, teacher, distill)
    wrapper = _distributed_wrapper(compiled, ddp)
    compiled = unwrap(compiled)
    _check_controller(controller, compiled, optimizer)
    history = (History() if history is None else History.from_dict(history) if isinstance(history, dict)
               else history)
    run = _Run(compiled, optimizer, controller, settings, history, scheduler, eval_fn,
               *_span(settings, controller, compiled, history))
    step_loss, guide, graphs = loss_fn, None, settings.cuda_graph
    if teacher is not None:
        guide = Teacher(teacher, compiled, distill)
        step_loss = distill_loss(guide, loss_fn)
        graphs = False  # the teacher's pass and the hooks run eagerly each step
    try:
        train_step = TrainStep(wrapper or compiled, optimizer, step_loss, controller=controller,
                               cuda_graph=graphs, grad_clip=settings.grad_clip)
    except BaseException:
        if guide is not None:
            guide.close()
        raise
    was_training = compiled.training
    compiled.train()
    bar = _progress_bar(run)
    try:
        _train(run, train_step, train_loader, loss_fn is not None, guide, bar)
    finally:
        bar.close()
        compiled.train(was_training)
        if guide is not None:
            guide.close()
    return history


@dataclass
class FitSettings:
    """How long and how :func:`fit` trains (each field as ``fit`` documents it):
    ``early_steps``/``late_steps`` (with a controller) or ``steps`` (without),
    ``eval_every``, ``log_every``, ``grad_clip``, ``checkpoint_path`` with
    ``checkpoint_every``, ``cuda_graph``, ``progress``. The counts and the checkpoint pair
    are checked when made; ``steps`` against the controller by ``fit``, ``grad_clip`` and
    ``cuda_graph`` by :class:`~tncompile.train.TrainStep`, which takes them."""

    early_steps: int = 0
    late_steps: int = 0
    steps: int | None = None
    eval_every: int | None = None
    log_every: int = 10
    grad_clip: float | None = None
    checkpoint_path: str | os.PathLike | None = None
    checkpoint_every: int | None = None
    cuda_graph: bool | str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        check_int(self.early_steps, "fit: early_steps", 0)
        check_int(self.late_steps, "fit: late_steps", 0)
        check_int(self.log_every, "fit: log_every", 1)
        check_int(self.eval_every, "fit: eval_every", 1, none_ok=True)
        check_int(self.checkpoint_every, "fit: checkpoint_every", 1, none_ok=True)
        if (self.checkpoint_path is None) != (self.checkpoint_every is None):
            raise ValueError("fit: give checkpoint_path and checkpoint_every together")


@dataclass
class _Run:
    """What the loop reads and updates: the model and its trainers, the settings, the
    history, and where the run is (``total`` steps, from ``start``, at ``ratio``)."""

    compiled: nn.Module
    optimizer: torch.optim.Optimizer
    controller: RankController | None
    settings: FitSettings
    history: History
    scheduler: Any
    eval_fn: Callable | None
    total: int
    start: int
    ratio: float
    eval_every: int | None = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.eval_every = s.eval_every or (s.early_steps if s.early_steps else None)


def _check_run(settings: FitSettings, train_loader, loss_fn, optimizer, controller, teacher, distill) -> None:
    """The arguments' types, and the settings that depend on whether a controller runs."""
    if controller is not None and not isinstance(controller, RankController):
        raise TypeError(f"fit: controller must be a RankController or None, got {type(controller).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fit: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if controller is None:
        if settings.early_steps or settings.late_steps:
            raise ValueError("fit: early_steps / late_steps are the rank controller's stages; without a controller "
                             "give steps=N (fixed ranks), or pass a RankController")
        if not is_int(settings.steps) or settings.steps < 0:
            raise ValueError(f"fit: without a controller give steps=<int >= 0> (fixed-rank training), "
                             f"got {settings.steps!r}")
    elif settings.steps is not None:
        raise ValueError("fit: with a controller the run is early_steps + late_steps long; leave out steps=")
    if not isinstance(train_loader, abc.Iterable) or isinstance(train_loader, (str, bytes, torch.Tensor)):
        raise TypeError(f"fit: train_loader must be an iterable of (inputs, targets) batches (a DataLoader, "
                        f"a list), got {type(train_loader).__name__}")
    if loss_fn is None and teacher is None:
        raise ValueError("fit: give loss_fn(outputs, targets), or a teacher to distill from (or both)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"fit: loss_fn must be callable as loss_fn(outputs, targets), got {type(loss_fn).__name__}")
    if distill is not None and teacher is None:
        raise ValueError("fit: distill= says what to learn from a teacher; pass teacher=<the original model>")


def _check_controller(controller: RankController | None, compiled: nn.Module, optimizer) -> None:
    if controller is None:
        return
    if controller.compiled is not compiled:
        raise ValueError("fit: the controller was built for a different model")
    if controller.optimizer is not optimizer:
        raise ValueError("fit: the controller was built with a different optimizer")
    frozen = [name for name, m in compiled.named_modules() if isinstance(m, TNModule)
              and any(not g.requires_grad for g in m.gates)]
    if frozen:
        raise ValueError(f"fit: the rank gates of {frozen[:3]} are frozen but a RankController trains them; "
                         "tncompile.freeze_gates(model, False) first, or train without a controller")


def _span(settings: FitSettings, controller, compiled: nn.Module, history: History) -> tuple[int, int, float]:
    """``(total, start, ratio)``: the run's last step, the step it resumes after, the ratio now."""
    if controller is None:
        return settings.steps, (history.step[-1] if history.step else 0), float(getattr(compiled, "ratio", 1.0))
    if controller.stage == "early":
        controller.early_steps = settings.early_steps
    controller.late_steps = settings.late_steps  # the budget schedule's time scale
    start = controller.steps_done
    if start == 0 and not history.ranks:
        history.ranks.append((0, {k: list(v) for k, v in controller.active_ranks().items()}))
    return settings.early_steps + settings.late_steps, start, controller.ratio


def _progress_bar(run: _Run):
    """On stderr; redrawn in a terminal, else (a log file, CI) a line every 30 s; rank 0 only."""
    interactive = sys.stderr.isatty()
    return tqdm(total=run.total, initial=min(run.start, run.total), desc="fit",
                disable=not run.settings.progress or rank(getattr(run.controller, "process_group", None)) != 0,
                dynamic_ncols=True, mininterval=0.1 if interactive else 30.0)


def _train(run: _Run, train_step: TrainStep, train_loader: Iterable, labeled: bool, guide, bar) -> None:
    """Steps ``start + 1 .. total``: each step, its record, evals, checkpoints, the bar."""
    stage = run.controller.stage if run.controller is not None else "fixed"
    skipped = train_step.skipped_steps()
    for step, batch in zip(range(run.start + 1, run.total + 1), _batches(train_loader, run.start)):
        inputs, targets = _unpack(batch) if labeled else (batch, None)
        t0 = perf_counter()
        if guide is not None:
            targets = (targets, guide.record(inputs), inputs)
        task = train_step(inputs, targets)      # forward, penalty, backward, clip, optimizer, controller
        if run.scheduler is not None:
            run.scheduler.step()
        event = train_step.last_event
        task_value, loss_value = float(task), float(train_step.last_total)
        if train_step.skipped_steps() > skipped:  # fit reads the loss anyway: no extra sync
            skipped += 1
            run.history.skipped.append(step)
        step_ms = (perf_counter() - t0) * 1e3
        if run.controller is not None:
            stage = run.controller.stage
            if event.shapes_changed:
                run.ratio = run.controller.ratio
        run.history.record(step, loss_value, task_value, run.ratio, step_ms, stage)
        if event is not None:
            _record_event(run.history, step, event, run.controller, run.ratio, run.settings.log_every, run.total)
        _after_step(run, step)
        bar.update(1)
        bar.set_postfix(loss=f"{task_value:.4f}", ratio=f"{run.ratio:.4g}", ms=f"{step_ms:.0f}", stage=stage,
                        refresh=False)


def _after_step(run: _Run, step: int) -> None:
    """The evaluation and the checkpoint due after ``step``, if any."""
    if run.eval_fn is not None and ((run.eval_every and step % run.eval_every == 0) or step == run.total):
        run.history.evals.append((step, _evaluate(run.eval_fn, run.compiled)))
    settings = run.settings
    if settings.checkpoint_path is not None and step % settings.checkpoint_every == 0:
        scheduler = run.scheduler
        save_on_rank0(run.compiled, settings.checkpoint_path, getattr(run.controller, "process_group", None),
                      optimizer=run.optimizer, controller=run.controller,
                      extra={"history": run.history.to_dict(),
                             "scheduler": scheduler.state_dict() if scheduler is not None else None})


def _record_event(history: History, step: int, event, controller: RankController, ratio: float,
                  log_every: int, total: int) -> None:
    """Stage switches, truncations and the switched-on ranks, into ``history``."""
    if event.stage_changed:
        history.events.append({"step": step, "kind": "late_stage", "target_loss": float(controller.target_loss)})
    if event.shapes_changed:
        history.events.append({"step": step, "kind": "truncation", "ratio": ratio,
                               "truncated": {k: [list(a), list(b)] for k, (a, b) in event.truncated.items()},
                               "removed": list(event.removed)})
    if event.shapes_changed or step % log_every == 0 or step == total:
        history.ranks.append((step, {k: list(v) for k, v in controller.active_ranks().items()}))


def _distributed_wrapper(model: nn.Module, ddp: dict[str, Any] | None):
    """The :class:`DistributedModel` to train through, or ``None`` (one process)."""
    if ddp is None:
        if unwrap(model) is not model and not isinstance(model, DistributedModel):
            raise TypeError("fit: a plain DistributedDataParallel wrapper keeps reducing the parameters a rank cut "
                            "replaces; pass the compiled model with fit(..., ddp=dict(...)) or wrap it in "
                            "tncompile.distributed.DistributedModel")
        return model if isinstance(model, DistributedModel) else None
    if not isinstance(ddp, dict):
        raise TypeError(f"fit: ddp must be a dict of DistributedDataParallel keyword arguments, got "
                        f"{type(ddp).__name__}")
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError("fit(ddp=...): torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group(...) first (or launch with torchrun)")
    if isinstance(model, DistributedModel):
        raise ValueError("fit: the model is already a DistributedModel; leave out ddp=")
    if is_sharded(unwrap(model)):
        raise ValueError("fit: the model is sharded by FSDP2, which reduces its gradients itself; leave out ddp=")
    return DistributedModel(unwrap(model), **ddp)


def _evaluate(eval_fn, compiled: nn.Module) -> dict[str, float]:
    compiled.eval()
    try:
        with torch.no_grad():
            result = eval_fn(compiled)
    finally:
        compiled.train()
    if isinstance(result, dict):
        return {k: float(v) for k, v in result.items()}
    return {"eval": float(result)}
