"""``transformers.Trainer`` with a compressed model.

A swap-mode model (``tncompile.compile(hf_model, ..., mode="swap")``) is still the
HF class, so ``Trainer`` trains it as it is. Two things here add what Trainer
cannot know:

- :class:`RankControlCallback` runs a :class:`~tncompile.RankController` inside
  Trainer's loop: the rank penalty's gradient is added before each optimizer
  step, the early/late stages and cuts follow ``state.max_steps``, cut
  parameters are replaced (and their optimizer state sliced) inside Trainer's
  own optimizer, and each cut is appended to ``trainer.state.log_history``.
- plain ``Trainer`` resumes from a compressed model's checkpoints and loads the best
  one: their ``model.safetensors`` holds the cut ranks, which the model's
  ``load_state_dict`` adopts (cutting its layers to them) before loading.
  :class:`CompressedTrainer` rebuilds each checkpoint with ``tncompile.load`` instead
  and makes it ``trainer.model``: for checkpoints whose layers a run collapsed.

Only the ``"budget"`` schedule runs here (CoMERA's ``"comera"`` rule replaces the
task loss inside the backward pass, which a callback cannot reach), and not under
fp16 loss scaling (the penalty's gradient would miss the scale).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..serialization import load
from .hf_folder import is_model_folder
from ..swap.swapped import is_swapped, user_class
from ..train.controller import RankController
from ..train.ddp import unwrap
from ..errors import check_float
from ..result.model_api import is_compressed

__all__ = ["RankControlCallback", "CompressedTrainer"]

_TENSOR_STATE = ("target_loss", "ema", "ema_weight")


def _loss_of(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


class RankControlCallback(TrainerCallback, ExportableState):
    """Rank-adaptive training inside ``transformers.Trainer``.

    Parameters
    ----------
    target_ratio : float
        Whole-model size to reach (below the ratio the model was compiled at).
    early_fraction : float in [0, 1)
        Share of ``max_steps`` in the early stage (gates learn which ranks
        matter); the rest is the late stage, cutting to ``target_ratio`` and then
        training at it for its last ``recovery`` share.
    recovery : float in [0, 1)
        As :class:`~tncompile.RankController`.
    rank_weight, threshold, truncate_every, allow_layer_removal, optimizer_state
        As :class:`~tncompile.RankController`.

    The loss the controller tracks is the model output's ``loss`` (HF models
    return it when given ``labels``), averaged over the micro-batches of each
    step. Give Trainer an optimizer whose gates learn faster than the weights
    for sharper cuts: ``optimizers=(torch.optim.AdamW(tncompile.param_groups(model,
    lr=5e-5, gate_lr=5e-3)), None)``. ``controller`` and ``events`` (each cut and
    the late-stage start, also in ``trainer.state.log_history``) are kept here.
    """

    def __init__(self, target_ratio: float, early_fraction: float = 0.3, recovery: float = 0.3,
                 rank_weight: float = 0.01, threshold: float = 1e-2, truncate_every: int = 100,
                 allow_layer_removal: bool = False, optimizer_state: str = "slice"):
        check_float(early_fraction, "RankControlCallback: early_fraction", 0.0, 1.0, high_open=True)
        self.settings = {"target_ratio": target_ratio, "early_fraction": early_fraction, "recovery": recovery,
                         "rank_weight": rank_weight, "threshold": threshold, "truncate_every": truncate_every,
                         "allow_layer_removal": allow_layer_removal, "optimizer_state": optimizer_state}
        self.controller: RankController | None = None
        self.events: list[dict[str, Any]] = []
        self.resume_state: dict[str, Any] | None = None  # set by Trainer when it restores callback states
        self._losses: list[torch.Tensor] = []
        self._hook = None

    # ------------------------------------------------------------ Trainer events
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if getattr(args, "fp16", False):
            raise NotImplementedError("RankControlCallback: fp16 loss scaling would leave the rank penalty's "
                                      "gradient unscaled; train in bf16 or float32")
        compiled = unwrap(model)  # a DDP wrapper: the compressed model inside
        if not is_compressed(compiled):
            raise TypeError(f"RankControlCallback: Trainer's model is a {type(compiled).__name__}, not a compressed "
                            "model; pass tncompile.compile(model, ...) to Trainer (HF models come back in swap mode)")
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps Trainer's optimizer
        s = self.settings
        early = round(s["early_fraction"] * state.max_steps)
        self.controller = RankController(
            compiled, opt, target_ratio=s["target_ratio"], early_steps=early, late_steps=state.max_steps - early,
            rank_weight=s["rank_weight"], threshold=s["threshold"], truncate_every=s["truncate_every"],
            allow_layer_removal=s["allow_layer_removal"], optimizer_state=s["optimizer_state"],
            recovery=s["recovery"], schedule="budget")
        saved = self.resume_state or _stored_state(state, type(self).__name__)
        if saved is not None and state.global_step > 0:
            self.controller.load_state_dict(_decoded(saved))
        self._hook = compiled.register_forward_hook(self._record_loss)

    def _record_loss(self, module, args, output) -> None:
        loss = _loss_of(output)
        if module.training and loss is not None:
            self._losses.append(loss.detach())

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        ctl = self.controller
        task = torch.stack(self._losses).mean() if self._losses else torch.zeros(())
        self._losses.clear()
        penalty = ctl.penalty(task)
        if penalty.requires_grad:
            penalty.backward()

    def on_step_end(self, args, state, control, **kwargs):
        ctl = self.controller
        event = ctl.step()
        record = None
        if event.stage_changed:
            record = {"tncompile_event": "late_stage"}
        if event.truncated or event.removed:
            record = {"tncompile_event": "cut", "tncompile_truncated": sorted(event.truncated),
                      "tncompile_removed": sorted(event.removed)}
        if record is not None:
            record.update({"step": state.global_step, "tncompile_ratio": round(ctl.ratio, 6),
                           "tncompile_stage": ctl.stage})
            self.events.append(record)
            state.log_history.append(dict(record))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.controller is not None:
            logs["tncompile_ratio"] = round(self.controller.ratio, 6)  # for the callbacks after this one

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        """What Trainer writes into ``trainer_state.json`` with each checkpoint."""
        saved = None
        if self.controller is not None:
            saved = {k: (float(v) if isinstance(v, torch.Tensor) else v)
                     for k, v in self.controller.state_dict().items()}
        return {"args": dict(self.settings), "attributes": {"resume_state": saved}}


def _stored_state(state, name: str) -> dict | None:
    entry = (getattr(state, "stateful_callbacks", None) or {}).get(name)
    if isinstance(entry, list):
        entry = entry[0] if entry else None
    if not isinstance(entry, dict):
        return None
    return (entry.get("attributes") or {}).get("resume_state")


def _decoded(saved: dict) -> dict:
    return {k: (torch.tensor(v, dtype=torch.float32) if k in _TENSOR_STATE and v is not None else v)
            for k, v in saved.items()}


class CompressedTrainer(transformers.Trainer):
    """``transformers.Trainer`` that also loads a compressed model's checkpoints: the
    checkpoint folder's model, with the ranks it was cut to, is loaded with
    ``tncompile.load`` and becomes ``trainer.model``

    * to resume (``train(resume_from_checkpoint=...)``): optimizer, scheduler, RNG
      and Trainer state resume as usual;
    * at the end of training with ``load_best_model_at_end=True``: the best
      checkpoint's model.

    Plain ``Trainer`` does both through ``load_state_dict``, which adopts smaller ranks;
    this class is for checkpoints whose layers rank adaptation collapsed (their state
    has other names), which only a rebuild loads.

    Anything else is plain ``Trainer``."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not self._loads_compressed(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._become(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        if not self._loads_compressed(self.state.best_model_checkpoint):
            return super()._load_best_model()
        self._become(self.state.best_model_checkpoint)

    def _loads_compressed(self, folder: str | None) -> bool:
        return folder is not None and is_model_folder(Path(os.fspath(folder))) and is_swapped(self.model)

    def _become(self, folder: str) -> None:
        """``trainer.model`` := the compressed model saved in ``folder``, on the device and in
        the train/eval mode of the one it replaces."""
        device = next(self.model.parameters()).device
        loaded = load(Path(os.fspath(folder)), model=user_class(self.model))
        loaded.train(self.model.training)
        self.model = self.model_wrapped = loaded.to(device)
