"""One run of the pretraining study (issue 66): the batches, the training loop with its
checkpoints, and the evaluation on a whole split.

* **Batches.** The train stream is cut into windows of ``seq + 1`` tokens (stride ``seq``);
  each epoch visits every window once, in an order drawn from the seed alone, so every
  variant of a seed sees the same batches.
* **Evaluation.** Causal LM: every token of a split is predicted once (from the tokens
  before it in its window): the split's mean next-token loss; perplexity is its ``exp``.
  Masked LM: 15% of every window's tokens are masked (BERT's 80/10/10 rule) by a fixed
  seed, the same for every model: the masked tokens' mean loss and the share predicted
  exactly (masked-token accuracy).
* **Masking in training** (masked LM): drawn afresh for every step from ``(seed, step)``
  (RoBERTa's dynamic masking), the same for every variant of a seed.
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
from pretrain_models import MASK_ID, MLM_SPECIAL_TOKENS, ModelShape, Run, build, lr_factor

CLIP_NORM = 1.0
EVAL_BATCH = 32
MASK_RATE = 0.15
EVAL_MASK_SEED = 4242
IGNORE = -100


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
                device: str, objective: str = "clm", vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)``, each ``(batch, seq)``, of ``step``: the next tokens (causal LM), or
    the masked tokens' ids and ``-100`` elsewhere (masked LM)."""
    n_windows = (train.numel() - 1) // seq
    starts = batch_windows(step, n_windows, batch, seed) * seq
    rows = torch.stack([train[s: s + seq + 1] for s in starts.tolist()])
    if objective == "mlm":
        inputs, labels = mask_tokens(rows[:, :-1], torch.Generator().manual_seed(10 ** 6 * (seed + 1) + step), vocab)
        return inputs.to(device), labels.to(device)
    rows = rows.to(device)
    return rows[:, :-1], rows[:, 1:]


def mask_tokens(rows: torch.Tensor, generator: torch.Generator, vocab: int,
                rate: float = MASK_RATE) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of ``rows`` ``(n, seq)``: each token chosen with probability ``rate``;
    a chosen one becomes ``<mask>`` (80%), a random ordinary token (10%) or stays (10%).
    Returns ``(inputs, labels)``, labels ``-100`` where not chosen."""
    chosen = torch.rand(rows.shape, generator=generator) < rate
    action = torch.rand(rows.shape, generator=generator)
    random_ids = torch.randint(len(MLM_SPECIAL_TOKENS), vocab, rows.shape, generator=generator)
    inputs = torch.where(chosen & (action < 0.8), torch.full_like(rows, MASK_ID), rows)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, inputs)
    return inputs, torch.where(chosen, rows, torch.full_like(rows, IGNORE))


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


@torch.no_grad()
def evaluate_masked(model: torch.nn.Module, ids: torch.Tensor, seq: int, device: str, vocab: int) -> tuple[float, float]:
    """``(mean loss, accuracy)`` over the masked tokens of ``ids``' windows of ``seq`` tokens,
    masked by :data:`EVAL_MASK_SEED` (the same tokens for every model)."""
    was = model.training
    model.eval()
    g = torch.Generator().manual_seed(EVAL_MASK_SEED)
    total, right, count = 0.0, 0, 0
    pieces = [w[:-1] for w in windows(ids, seq) if w.numel() > 2]
    for length in sorted({w.numel() for w in pieces}):
        same = [w for w in pieces if w.numel() == length]
        for start in range(0, len(same), EVAL_BATCH):
            inputs, labels = mask_tokens(torch.stack(same[start: start + EVAL_BATCH]), g, vocab)
            inputs, labels = inputs.to(device), labels.to(device)
            logits = model(input_ids=inputs).logits.float()
            chosen = labels != IGNORE
            total += F.cross_entropy(logits[chosen], labels[chosen], reduction="sum").item()
            right += int((logits[chosen].argmax(-1) == labels[chosen]).sum())
            count += int(chosen.sum())
    model.train(was)
    return total / count, right / count


def score(model: torch.nn.Module, ids: torch.Tensor, spec: "RunSpec", device: str) -> dict[str, float]:
    """``{"loss"}`` (and ``"accuracy"`` for a masked LM) of ``model`` on the split ``ids``."""
    if spec.objective == "mlm":
        loss, accuracy = evaluate_masked(model, ids, spec.shape.seq, device, spec.shape.vocab)
        return {"loss": loss, "accuracy": accuracy}
    return {"loss": evaluate(model, ids, spec.shape.seq, device)}


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
    objective: str = "clm"


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
        run, state = load_run(checkpoint, spec.variant, spec.shape, spec.lr, spec.steps, device, spec.objective)
        if state.get("key") != spec.key:
            raise ValueError(f"{checkpoint} continues run {state.get('key')!r}, not {spec.key!r}")
    else:
        run = build(spec.variant, spec.shape, spec.lr, spec.seed, spec.steps, device, spec.objective)
        state = {"key": spec.key, "step": 0, "wall_s": 0.0, "params_start": run.params(), "curve": [],
                 "loss_sum": 0.0, "loss_count": 0, "diverged": False}
    marks = {round(spec.steps * (i + 1) / spec.eval_points) for i in range(spec.eval_points)}
    if progress is not None and state["step"]:
        progress(state["step"])                   # a continued run's bar starts where it is
    last_save = time.monotonic()
    while state["step"] < spec.steps and not state["diverged"]:
        step = state["step"]
        began = time.perf_counter()
        loss = _step(run, *train_batch(corpus["train"], step, spec.batch, seq, spec.seed, device, spec.objective,
                                       spec.shape.vocab), lr_factor(step, spec.steps))
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
                point.update({f"valid_{k}": v for k, v in score(run.model, corpus["valid"], spec, device).items()})
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
        valid = ({k[len("valid_"):]: v for k, v in last.items() if k.startswith("valid_")}
                 if last.get("step") == spec.steps and "valid_loss" in last
                 else score(run.model, corpus["valid"], spec, device))
        final = {f"valid_{k}": v for k, v in valid.items()}
        final.update({f"test_{k}": v for k, v in score(run.model, corpus["test"], spec, device).items()})
    return {"key": spec.key, "variant": spec.variant, "lr": spec.lr, "seed": spec.seed, "steps": state["step"],
            "planned_steps": spec.steps, "tokens": state["step"] * spec.batch * seq, "batch": spec.batch,
            "diverged": state["diverged"], "params_start": state["params_start"], "params_end": run.params(),
            "wall_s_under_load": state["wall_s"], "curve": state["curve"], "device": device, **final,
            "networks": networks(run.model)}


def networks(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Each TT / TTM network's cores and ranks at the end (``{}`` for a dense model)."""
    out = {}
    for name, module in model.named_modules():
        layout = getattr(module, "layout", None)
        if layout is not None and getattr(layout, "ranks", None) is not None and hasattr(layout, "core_shapes"):
            out[name] = {"cores": len(layout.core_shapes()), "ranks": [int(r) for r in layout.ranks]}
    return out


def _step(run: Run, inputs: torch.Tensor, targets: torch.Tensor, factor: float) -> float:
    """One optimizer step at ``factor`` of the peak learning rate; the task loss (targets
    ``-100`` are not scored: a masked LM's unmasked tokens)."""
    run.set_lr(factor)
    logits = run.model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE)
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
