"""One run of the pretraining study (issue 66): the batches, the training loop with its
checkpoints, and the evaluation on a whole split.

* **Batches.** The train stream is cut into windows of ``seq + 1`` tokens (stride ``seq``);
  each epoch visits every window once, in an order drawn from the seed alone, so every
  variant of a seed sees the same batches.
* **Evaluation.** Every token of a split is predicted once (from the tokens before it in
  its window): the split's mean next-token loss; perplexity is its ``exp``.
* **Checkpoints.** Every ``checkpoint_s`` seconds of wall time and at the end of training
  (:mod:`pretrain_checkpoint`); a run started again continues from its checkpoint.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pretrain_checkpoint import load_run, save_run
from pretrain_models import ModelShape, Run, build, lr_factor

CLIP_NORM = 1.0
EVAL_BATCH = 32


def windows(ids: torch.Tensor, seq: int) -> list[torch.Tensor]:
    """``ids`` as consecutive windows of ``seq + 1`` tokens overlapping by one (the last may
    be shorter, at least 2): each token but the first is a target exactly once."""
    n = ids.numel()
    return [ids[s: s + seq + 1] for s in range(0, n - 1, seq) if min(n, s + seq + 1) - s >= 2]


def epoch_steps(train_tokens: int, seq: int, batch: int) -> int:
    """Steps in one epoch: every full window once."""
    return ((train_tokens - 1) // seq) // batch


def batch_windows(step: int, n_windows: int, batch: int, seed: int) -> torch.Tensor:
    """The window indices of ``step`` (from 0): epoch ``e`` visits all windows in the order
    ``randperm`` draws from ``(seed, e)``; a batch never spans two epochs."""
    per_epoch = n_windows // batch
    epoch, within = divmod(step, per_epoch)
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(1000 * seed + 7919 * epoch + 1))
    return order[within * batch: (within + 1) * batch]


def train_batch(train: torch.Tensor, step: int, batch: int, seq: int, seed: int,
                device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, each ``(batch, seq)``, of ``step``."""
    n_windows = (train.numel() - 1) // seq
    starts = batch_windows(step, n_windows, batch, seed) * seq
    rows = torch.stack([train[s: s + seq + 1] for s in starts.tolist()]).to(device)
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(model: torch.nn.Module, ids: torch.Tensor, seq: int, device: str) -> float:
    """Mean next-token loss (nats) over every token of ``ids`` but the first."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    pieces = windows(ids, seq)
    for length in sorted({w.numel() for w in pieces}):
        same = [w for w in pieces if w.numel() == length]
        for start in range(0, len(same), EVAL_BATCH):
            rows = torch.stack(same[start: start + EVAL_BATCH]).to(device)
            logits = model(input_ids=rows[:, :-1]).logits
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += rows[:, 1:].numel()
    model.train(was)
    return total / count


@dataclass
class RunSpec:
    """What one row of the study trains: ``variant`` at peak ``lr`` from ``seed`` for
    ``steps`` steps of ``batch`` x ``shape.seq`` tokens, with ``eval_points`` curve points
    (train loss; the valid split's loss too when ``curve_valid``)."""
    key: str
    variant: str
    lr: float
    seed: int
    steps: int
    batch: int
    shape: ModelShape
    eval_points: int = 8
    curve_valid: bool = True


def train_run(spec: RunSpec, corpus: dict[str, torch.Tensor], checkpoint: Path, device: str = "cpu",
              checkpoint_s: float = 300.0, progress: Callable[[int], None] | None = None,
              stop_after: int | None = None) -> dict[str, Any] | None:
    """Train ``spec`` (continuing from ``checkpoint`` if it exists) and return its result row:
    the curve, the final valid and test losses, parameters at start and end, wall seconds.
    The checkpoint stays: it holds the trained model (the timing pass times its end form).
    A run whose loss turns non-finite ends there and is marked ``diverged``.
    ``stop_after``: stop (checkpointed) once that many steps are done, returning ``None``
    -- what an interrupted run leaves."""
    seq = spec.shape.seq
    if checkpoint.exists():
        run, state = load_run(checkpoint, spec.variant, spec.shape, spec.lr, spec.steps, device)
        if state.get("key") != spec.key:
            raise ValueError(f"{checkpoint} continues run {state.get('key')!r}, not {spec.key!r}")
    else:
        run = build(spec.variant, spec.shape, spec.lr, spec.seed, spec.steps, device)
        state = {"key": spec.key, "step": 0, "wall_s": 0.0, "params_start": run.params(), "curve": [],
                 "loss_sum": 0.0, "loss_count": 0, "diverged": False}
    marks = {round(spec.steps * (i + 1) / spec.eval_points) for i in range(spec.eval_points)}
    last_save = time.monotonic()
    while state["step"] < spec.steps and not state["diverged"]:
        step = state["step"]
        began = time.perf_counter()
        loss = _step(run, *train_batch(corpus["train"], step, spec.batch, seq, spec.seed, device),
                     lr_factor(step, spec.steps))
        state["wall_s"] += time.perf_counter() - began
        state["step"] = step + 1
        state["loss_sum"] += loss
        state["loss_count"] += 1
        if not math.isfinite(loss):
            state["diverged"] = True
        if progress is not None:
            progress(1)
        if state["step"] in marks or state["diverged"]:
            point = {"step": state["step"], "tokens": state["step"] * spec.batch * seq, "params": run.params(),
                     "wall_s": state["wall_s"], "train_loss": state["loss_sum"] / max(1, state["loss_count"])}
            if spec.curve_valid and not state["diverged"]:
                point["valid_loss"] = evaluate(run.model, corpus["valid"], seq, device)
            state["curve"].append(point)
            state["loss_sum"], state["loss_count"] = 0.0, 0
        if time.monotonic() - last_save > checkpoint_s or state["step"] == spec.steps \
                or (stop_after is not None and state["step"] >= stop_after):
            save_run(run, checkpoint, state)
            last_save = time.monotonic()
        if stop_after is not None and state["step"] >= stop_after and state["step"] < spec.steps:
            return None
    final = {"valid_loss": math.inf, "test_loss": math.inf}
    if not state["diverged"]:
        last = state["curve"][-1] if state["curve"] else {}
        final = {"valid_loss": last["valid_loss"] if last.get("step") == spec.steps and "valid_loss" in last
                 else evaluate(run.model, corpus["valid"], seq, device),
                 "test_loss": evaluate(run.model, corpus["test"], seq, device)}
    return {"key": spec.key, "variant": spec.variant, "lr": spec.lr, "seed": spec.seed, "steps": state["step"],
            "planned_steps": spec.steps, "tokens": state["step"] * spec.batch * seq, "batch": spec.batch,
            "diverged": state["diverged"], "params_start": state["params_start"], "params_end": run.params(),
            "wall_s_under_load": state["wall_s"], "curve": state["curve"], "device": device, **final}


def _step(run: Run, inputs: torch.Tensor, targets: torch.Tensor, factor: float) -> float:
    """One optimizer step at ``factor`` of the peak learning rate; the task loss."""
    run.set_lr(factor)
    logits = run.model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    value = loss.item()
    if not math.isfinite(value):
        return value
    total = loss + run.controller.penalty(loss) if run.controller is not None else loss
    run.optimizer.zero_grad(set_to_none=True)
    total.backward()
    torch.nn.utils.clip_grad_norm_(list(run.model.parameters()), CLIP_NORM)
    run.optimizer.step()
    if run.controller is not None:
        run.controller.step()
    return value
