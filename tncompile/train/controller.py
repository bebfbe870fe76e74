"""``RankController``: CoMERA's two-stage rank-adaptive objective, with real truncation.

Usage, in any training loop::

    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3, gate_lr=1e-2))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.01, early_steps=2000)
    for x, y in loader:
        task = loss_fn(compiled(x), y)
        (task + ctl.penalty(task)).backward()
        opt.step(); opt.zero_grad()
        event = ctl.step()          # may cut ranks; event.shapes_changed says so

Stages
------
*early*: ``rank_weight * sum|g| / #g + core_weight * sum ||G||^2`` -- an l1
pull on every gate entry (normalized by their count, as in the paper) and an
l2 pull on the cores, so that the gates cannot shrink by the cores growing.

*late*: CoMERA's scalarized rule. With ``d_loss = (L - L*) / L*`` and
``d_size = (S - S*) / S*`` (``S`` the model's ratio counting only gate
entries at or above ``threshold``, ``S*`` the ``target_ratio``), each step
optimizes the task loss when ``d_loss >= d_size`` and the size term
``size_weight * S_soft / S*`` otherwise (``S_soft``: the same count with each
rank weighted by ``|g|``, which is differentiable). As in CoMERA, when both
are under their targets the less-ahead one is still pushed, so the model may
end below ``S*``; ``stop_at_target=True`` trains only the task loss once
``S <= S*``. The choice is a
``torch.where`` on device tensors: no host sync, so it can be captured in a
CUDA graph. The core l2 term stays on in both stages.

That rule is ``schedule="comera"``. It does not promise to reach ``S*``
(an MLP asked for 0.05 ended at 0.146 in 600 steps). The default,
``schedule="budget"``, does: in the late stage the early penalty stays on and
every cut also removes the least important ranks (by ``|g|`` times the norms
of the two core slices the rank joins) until the model is within a budget
that falls linearly from the ratio at the stage switch to ``S*`` over the
first ``1 - recovery`` of ``late_steps``; the rest of the steps train the
task loss at ``S*`` (recovery). Without ``late_steps`` the first late-stage
cut goes to ``S*`` at once.
"""
from __future__ import annotations

import heapq
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..passes import CollapseLayers, Replan, TruncateRanks
from ..runtime.layers import TNModule, owning_layers
from .ddp import (active_group, broadcast_from_rank0, check_same_everywhere, mean_over_processes,
                          unwrap)
from .sharding import gathered, is_shard, summed_over_shards, whole
from .schedules import SCHEDULES as SCHEDULE_CLASSES
from .truncation import Cut, check_optimizer, remap_optimizer, unwrap_optimizer
from ..errors import check_float, check_int, check_materialized
from ..result.model_api import is_compressed

__all__ = ["RankController", "RankEvent", "param_groups"]

STAGES = ("early", "late")
SCHEDULES = tuple(SCHEDULE_CLASSES)
NONFINITE = ("raise", "skip")


def _owners(compiled) -> dict[str, TNModule]:
    """``name -> layer`` for every TT/TTM layer that owns its cores (tied heads excluded)."""
    return owning_layers(compiled.tensorized_modules())


def param_groups(compiled: nn.Module, lr: float, *, core_lr: float | None = None,
                 gate_lr: float | None = None, weight_decay: float = 0.0,
                 core_weight_decay: float | None = None, gate_weight_decay: float = 0.0,
                 implementation: str | None = "foreach") -> list[dict]:
    """Optimizer parameter groups ``cores``, ``gates`` and ``other``.

    CoMERA trains the rank gates with their own learning rate and no weight
    decay; this builds the groups so that any ``torch.optim`` optimizer takes
    them directly: ``AdamW(param_groups(compiled, lr=1e-3, gate_lr=1e-2))``.
    Each group carries a ``"name"`` key. Learning rates and weight decays
    not given default to ``lr`` / ``weight_decay`` (gates: no decay).

    ``implementation`` goes into every group: a compressed model holds several times its
    dense model's parameter tensors, each small, and PyTorch's optimizers step CPU tensors
    one at a time unless told otherwise. ``"foreach"`` (default) steps them in groups, with
    the same results bit for bit (AdamW over the six-encoder at 1/44.9: 14.1 -> 9.7 ms on 2
    cores, ``benchmarks/bench_optimizer.py``); ``"fused"`` runs one kernel (3.2 ms; results
    within rounding of the loop's, not bitwise; floating-point parameters on CPU or CUDA,
    no sparse embedding); ``None`` leaves the optimizer's own choice. An optimizer without
    the option ignores the key.
    """
    compiled = unwrap(compiled)
    if not is_compressed(compiled):
        raise TypeError(f"param_groups expects a CompiledModel, got {type(compiled).__name__}")
    for name, value in (("lr", lr), ("core_lr", core_lr), ("gate_lr", gate_lr), ("weight_decay", weight_decay)):
        if value is None and name != "lr":
            continue
        check_float(value, f"param_groups: {name}", 0.0, low_open=name != "weight_decay")
    owners = _owners(compiled).values()
    cores = {id(p): p for m in owners for p in m.cores._parameters.values()}
    gates = {id(p): p for m in owners for p in m.gates._parameters.values()}
    other = {id(p): p for p in compiled.parameters() if id(p) not in cores and id(p) not in gates}
    groups = [
        {"name": "cores", "params": list(cores.values()), "lr": core_lr if core_lr is not None else lr,
         "weight_decay": core_weight_decay if core_weight_decay is not None else weight_decay},
        {"name": "gates", "params": list(gates.values()), "lr": gate_lr if gate_lr is not None else lr,
         "weight_decay": gate_weight_decay},
        {"name": "other", "params": list(other.values()), "lr": lr, "weight_decay": weight_decay},
    ]
    keys = _implementation_keys(compiled, implementation)
    for g in groups:
        g.update(keys)
    return [g for g in groups if g["params"]]


def _implementation_keys(model: nn.Module, implementation: str | None) -> dict[str, bool]:
    """The group keys that pick the optimizer's multi-tensor implementation (see
    :func:`param_groups`)."""
    if implementation is None:
        return {}
    if implementation not in ("fused", "foreach"):
        raise ValueError(f"param_groups: implementation must be 'foreach', 'fused' or None, got {implementation!r}")
    if implementation == "fused" and not (
            all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in model.parameters())
            and not any(getattr(m, "sparse", False) for m in model.modules())):
        raise ValueError("param_groups(implementation='fused'): fused optimizers need floating-point parameters on "
                         "CPU or CUDA and no sparse embedding; use 'foreach'")
    return {implementation: True}


@dataclass
class RankEvent:
    """What :meth:`RankController.step` did.

    Attributes
    ----------
    step : int
        Steps done so far (including this one).
    stage : str
        ``"early"`` or ``"late"`` after this step.
    stage_changed : bool
        The late stage started at this step.
    truncated : dict
        ``layer -> (old ranks, new ranks)`` for every layer that was cut.
    removed : list of str
        Layers that collapsed to their bias (``allow_layer_removal=True``).
    """

    step: int
    stage: str
    stage_changed: bool = False
    truncated: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)

    @property
    def shapes_changed(self) -> bool:
        """Parameters were replaced: captured graphs and compiled code are stale."""
        return bool(self.truncated or self.removed)

    @property
    def changed(self) -> bool:
        """Anything a captured training step depends on changed (shapes or stage)."""
        return self.shapes_changed or self.stage_changed

    def __bool__(self) -> bool:
        return self.changed


class RankController:
    """Drives a compiled model's ranks toward ``target_ratio`` while it trains.

    Parameters
    ----------
    compiled : CompiledModel
        The model whose TT / TTM layers carry rank gates.
    optimizer : torch.optim.Optimizer or None
        Updated in place when ranks are cut (parameters replaced, state
        sliced). It must update the gates; build it with :func:`param_groups`.
    target_ratio : float
        Whole-model size to reach, ``params / params(original)``; must be
        below the model's current ratio.
    early_steps : int or None
        Steps of the early stage; ``None`` stays early until
        :meth:`start_late_stage` is called (``tncompile.fit`` does).
    rank_weight : float
        Early-stage l1 weight on the gates (paper: 0.01).
    core_weight : float
        l2 weight on the cores (sum of squares), both stages.
    size_weight : float
        Late-stage weight of the size term.
    threshold : float
        Gate entries with ``|g| < threshold`` are switched off (paper: 1e-2).
    truncate_every : int
        Cut switched-off ranks every this many steps (0: only when
        :meth:`truncate` is called).
    target_loss : float or None
        Late-stage task-loss target; ``None`` takes the smoothed task loss at
        the end of the early stage.
    loss_smoothing : float
        Decay of the task-loss moving average, in ``[0, 1)``.
    allow_layer_removal : bool
        When every rank of some bond is off, replace the layer by its bias
        alone instead of keeping its strongest rank.
    optimizer_state : {"slice", "reset"}
        How truncation treats optimizer state: slice it (exact; per-element
        optimizers only) or drop the state of the cut parameters.
    stop_at_target : bool
        ``schedule="comera"``: once the size is at or under ``target_ratio``,
        train only the task loss (CoMERA's rule keeps trading).
    schedule : {"budget", "comera"}
        Late stage: cut to a budget falling to ``target_ratio`` (reaches it,
        see the module doc), or CoMERA's scalarized rule.
    late_steps : int or None
        Length of the late stage (``tncompile.fit`` sets it): the budget
        schedule's time scale.
    recovery : float in [0, 1)
        ``schedule="budget"``: share of ``late_steps`` trained at the target
        after the last cut.
    nonfinite : {"raise", "skip"}
        What a non-finite task loss or gate does. Either way it never reaches
        the loss average (the late stage's target) nor a cut. ``"raise"``:
        ``FloatingPointError`` -- for a loss on CPU at the next :meth:`step`;
        on a GPU at the next truncation (counted on the device: no host sync
        per step); for gates when a truncation reads them.
        ``"skip"``: such losses are left out of the average and layers with
        non-finite gates are not cut that time (a warning names them).
    process_group : torch.distributed group, optional
        Processes that train replicas together (default: all of them when
        ``torch.distributed`` is initialized). The task loss is averaged over
        them before it steers anything, and every cut is decided from rank 0's
        cores and gates and checked to agree (:mod:`tncompile.distributed`).
        ``compiled`` may be a DDP / :class:`~tncompile.distributed.DistributedModel` wrapper.
    """

    def __init__(self, compiled: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 target_ratio: float, early_steps: int | None = None, rank_weight: float = 0.01,
                 core_weight: float = 1e-5, size_weight: float = 1.0, threshold: float = 1e-2,
                 truncate_every: int = 100, target_loss: float | None = None,
                 loss_smoothing: float = 0.98, allow_layer_removal: bool = False,
                 optimizer_state: str = "slice", stop_at_target: bool = False,
                 schedule: str = "budget", late_steps: int | None = None, recovery: float = 0.3,
                 nonfinite: str = "raise", process_group: Any = None):
        compiled = unwrap(compiled)  # a DDP / DistributedModel wrapper: the compiled model inside
        if not is_compressed(compiled):
            raise TypeError(f"RankController expects a CompiledModel, got {type(compiled).__name__}")
        check_materialized(compiled, "RankController")
        self.compiled = compiled
        if not _owners(compiled):
            raise ValueError("RankController: the model has no TT/TTM layers to adapt; compile it "
                             "with a target_ratio that tensorizes some layers")
        _check_positive("threshold", threshold)
        for name, value in (("rank_weight", rank_weight), ("core_weight", core_weight),
                            ("size_weight", size_weight)):
            check_float(value, f"RankController: {name}", 0.0)
        check_int(truncate_every, "RankController: truncate_every", 0)
        check_int(early_steps, "RankController: early_steps", 0, none_ok=True)
        check_float(loss_smoothing, "RankController: loss_smoothing", 0.0, 1.0, high_open=True)
        if target_loss is not None:
            _check_positive("target_loss", target_loss)
        if schedule not in SCHEDULES:
            raise ValueError(f"RankController: schedule must be one of {SCHEDULES}, got {schedule!r}")
        check_int(late_steps, "RankController: late_steps", 0, none_ok=True)
        check_float(recovery, "RankController: recovery", 0.0, 1.0, high_open=True)
        if nonfinite not in NONFINITE:
            raise ValueError(f"RankController: nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        start = _compiled_ratio(compiled)
        if not (isinstance(target_ratio, (int, float)) and 0 < target_ratio < start):
            raise ValueError(f"RankController: target_ratio must be in (0, {start:.6g}), the ratio the "
                             f"model was compiled at; got {target_ratio!r}. Rank adaptation only shrinks "
                             f"the model: compile at a larger ratio or aim lower.")
        optimizer = unwrap_optimizer(optimizer)  # accelerate's AcceleratedOptimizer: the optimizer inside
        check_optimizer(optimizer, optimizer_state)
        self.optimizer = optimizer
        self.target_ratio = float(target_ratio)
        self.early_steps = early_steps
        self.rank_weight, self.core_weight, self.size_weight = float(rank_weight), float(core_weight), float(size_weight)
        self.threshold = float(threshold)
        self.truncate_every = truncate_every
        self.loss_smoothing = float(loss_smoothing)
        self.allow_layer_removal = allow_layer_removal
        self.stop_at_target = bool(stop_at_target)
        self.optimizer_state = optimizer_state
        self.schedule, self.late_steps, self.recovery = schedule, late_steps, float(recovery)
        self._schedule = SCHEDULE_CLASSES[schedule]()
        self.nonfinite = nonfinite
        self.process_group = active_group(process_group)  # None: one process
        self._bad_losses: torch.Tensor | None = None  # non-finite task losses not yet reported (device)
        self._late_start: int | None = None        # step at which the late stage began
        self._late_start_ratio: float | None = None
        self.recovering = False                   # budget schedule: the last cut is done
        self.stage = "early"
        self.steps_done = 0
        self.version = 0   # bumped whenever shapes or the stage change
        self._target_loss: torch.Tensor | None = None
        self._user_target_loss = target_loss
        self._ema: torch.Tensor | None = None      # moving average of the task loss (device)
        self._ema_w: torch.Tensor | None = None    # its accumulated weight, for bias correction (device)
        self.last_choice: torch.Tensor | None = None  # late stage: True where the task loss was chosen
        self._refresh()
        self._check_optimizer_covers_gates()
        self._schedule.check_reachable(self)

    # ------------------------------------------------------------ bookkeeping
    def rank_one_ratio(self) -> float:
        """The model's ratio with every rank cut to 1 (no layer removed)."""
        return (self._other_params + sum(_layer_size([1] * len(m.layout.ranks), m.layout)
                                         for m in self._layers.values())) / self._original

    def _refresh(self) -> None:
        self._layers = _owners(self.compiled)
        owned = sum(m.layout.num_params() for m in self._layers.values())
        self._other_params = self.compiled.program.num_params() - owned
        self._original = self.compiled.program.original_params

    def _check_optimizer_covers_gates(self) -> None:
        if self.optimizer is None:
            return
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        missing = [n for n, m in self._layers.items()
                   if any(id(g) not in held for g in m.gates._parameters.values())]
        if missing:
            raise ValueError(f"RankController: the optimizer does not update the rank gates of "
                             f"{missing[:3]}{'...' if len(missing) > 3 else ''}; build it with "
                             f"tncompile.param_groups(compiled, lr=...)")

    @property
    def layers(self) -> dict[str, TNModule]:
        """``name -> TT/TTM layer`` under control (tied heads share their embedding's)."""
        return dict(self._layers)

    def ranks(self) -> dict[str, tuple[int, ...]]:
        """Current (truncated) ranks of every layer."""
        return {n: tuple(m.layout.ranks) for n, m in self._layers.items()}

    def active_ranks(self) -> dict[str, tuple[int, ...]]:
        """Ranks that are switched on now (``|g| >= threshold``; for experts, the
        most any expert has on: the ranks they share); reads the gates (host sync)."""
        return {n: tuple(int(_on_count(g.detach().abs() >= self.threshold)) for g in gates)
                for n, gates in self._whole_gates().items()}

    @property
    def ratio(self) -> float:
        """The model's true current ratio (what truncation has cut so far)."""
        return self.compiled.ratio

    def active_ratio(self) -> float:
        """The ratio the model would have if switched-off ranks were cut now (host sync)."""
        return float(self._size_ratios(soft=False)[0])

    # ------------------------------------------------------------ objective
    def _whole_gates(self) -> dict[str, list[torch.Tensor]]:
        """Every layer's gates, whole: FSDP2 shards gathered in one all-gather
        (differentiably), so the penalty and rank counts see every rank."""
        names = [(n, len(m.gates._parameters)) for n, m in self._layers.items()]
        flat = whole([g for m in self._layers.values() for g in m.gates._parameters.values()])
        out, start = {}, 0
        for name, count in names:
            out[name], start = flat[start:start + count], start + count
        return out

    def _gates(self):
        for gates in self._whole_gates().values():
            yield from gates

    def _core_squares(self) -> list[torch.Tensor]:
        """``||G||^2`` of every core; FSDP2 shards: local sums, added over processes in one all-reduce."""
        cores = [c for m in self._layers.values() for c in m.cores._parameters.values()]
        local = [c.to_local() if is_shard(c) else c for c in cores]
        sums = torch.stack([c.pow(2).sum() for c in local]) if local else None
        if sums is not None and any(is_shard(c) for c in cores):
            group = next(c for c in cores if is_shard(c)).device_mesh.get_group()
            sharded = torch.tensor([is_shard(c) for c in cores], device=sums.device)
            sums = torch.where(sharded, summed_over_shards(sums * sharded, group), sums)
        return list(sums) if sums is not None else []

    def _size_ratios(self, soft: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Model ratio with every bond's rank counted from its gate: entries
        ``>= threshold`` (hard) and, if ``soft``, the sum of ``|g|`` (differentiable).
        One pass over the gates serves both."""
        hard_total = soft_total = 0
        for m, gates in zip(self._layers.values(), self._whole_gates().values()):
            mags = [g.abs() for g in gates]
            counts = [_on_count((a.detach() >= self.threshold).to(a.dtype)) for a in mags]
            if not self.allow_layer_removal:  # truncation keeps every bond at rank >= 1
                counts = [c.clamp_min(1) for c in counts]
            hard_total = hard_total + _layer_size(counts, m.layout)
            if soft:  # experts: each expert's own network, summed
                soft_total = soft_total + _network_size([a.sum(-1) for a in mags], m.layout.site_sizes).sum()
        hard = (hard_total + self._other_params) / self._original
        return hard, ((soft_total + self._other_params) / self._original if soft else None)

    def early_penalty(self) -> torch.Tensor:
        """``rank_weight * sum|g| / #g + core_weight * sum ||G||^2``."""
        gates = list(self._gates())
        if not gates:  # every layer was removed: nothing left to pull on
            return self._zero()
        count = sum(g.numel() for g in gates)
        l1 = torch.stack([g.abs().sum() for g in gates]).sum() / count
        return self.rank_weight * l1 + self._core_term()

    def _core_term(self) -> torch.Tensor:
        squares = self._core_squares()
        if not squares:
            return self._zero()
        return self.core_weight * torch.stack(squares).sum()

    def _zero(self) -> torch.Tensor:
        """A zero penalty on the model's device (once every layer has been removed)."""
        first = next(self.compiled.parameters(), None)
        return torch.zeros((), device=first.device if first is not None else None)

    def penalty(self, task_loss: torch.Tensor) -> torch.Tensor:
        """The stage's extra loss: train on ``task_loss + penalty(task_loss)``.

        ``task_loss`` must be a scalar tensor. No host sync in either stage.
        """
        if not isinstance(task_loss, torch.Tensor) or task_loss.dim() != 0:
            raise ValueError("RankController.penalty expects the scalar task-loss tensor")
        agreed = mean_over_processes(task_loss.detach(), self.process_group)  # every process: the same loss
        self._count_nonfinite(agreed)
        if self.stage == "early":
            self._track(agreed)
        if not self._layers:  # every layer was removed: plain training from here on
            return task_loss.new_zeros(())
        if self.stage == "early":
            return self.early_penalty()
        return self._schedule.late_penalty(self, task_loss, agreed)

    def _count_nonfinite(self, task_loss: torch.Tensor) -> None:
        """Count a non-finite task loss on its device (no host read here: :meth:`step`
        reports it on CPU, the next truncation elsewhere)."""
        bad = ~torch.isfinite(task_loss.detach())
        if self._bad_losses is None or self._bad_losses.device != bad.device:
            self._bad_losses = torch.zeros((), dtype=torch.int64, device=bad.device)
        self._bad_losses.add_(bad.to(torch.int64))  # in place: a captured graph replays it

    def _report_nonfinite_losses(self) -> None:
        """At a host sync point: raise for the non-finite losses counted on the device."""
        if self._bad_losses is None or self.nonfinite != "raise":
            return
        count = int(self._bad_losses)
        if count:
            self._bad_losses.zero_()
            raise FloatingPointError(f"RankController: {count} non-finite task loss(es) by step "
                                     f"{self.steps_done}; they were kept out of the loss average. Fix the loss "
                                     "(learning rate, inputs) or pass nonfinite='skip' to go on without them.")

    def _track(self, task_loss: torch.Tensor) -> None:
        value = task_loss.detach().to(torch.float32)
        if self._ema is None or self._ema.device != value.device:
            self._ema = torch.zeros((), dtype=torch.float32, device=value.device)
            self._ema_w = torch.zeros((), dtype=torch.float32, device=value.device)
        # both updates are in place on the device (a captured graph replays them); a
        # non-finite loss leaves both as they were
        keep = 1.0 - torch.isfinite(value).to(torch.float32) * (1.0 - self.loss_smoothing)
        self._ema.mul_(keep).add_(torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0) * (1.0 - keep))
        self._ema_w.mul_(keep).add_(1.0 - keep)

    def smoothed_loss(self) -> torch.Tensor | None:
        """Bias-corrected moving average of the early-stage task loss (a device tensor)."""
        if self._ema is None:
            return None
        return self._ema / self._ema_w

    @property
    def target_loss(self) -> torch.Tensor | None:
        """The late stage's task-loss target (set when the late stage starts)."""
        return self._target_loss

    def late_objective(self, task_loss: torch.Tensor, agreed: torch.Tensor | None = None) -> torch.Tensor:
        """The scalarized late-stage loss (replaces ``task_loss``); see the module doc.
        ``agreed``: the task loss the branch is chosen by (averaged over the
        processes when distributed; ``task_loss`` otherwise)."""
        if self._target_loss is None:
            raise RuntimeError("late stage has no target loss; call start_late_stage() first")
        if not self._layers:  # every layer was removed: nothing left to trade against the loss
            return task_loss
        if self._target_loss.device != task_loss.device:  # once: no copy per step (capturable)
            self._target_loss = self._target_loss.to(task_loss.device)
        target = self._target_loss.to(task_loss.dtype)
        chooser = (agreed if agreed is not None else task_loss.detach()).to(task_loss.dtype)
        d_loss = (chooser - target) / target.abs().clamp_min(1e-12)
        hard, soft = self._size_ratios()
        d_size = (hard.to(task_loss.dtype) - self.target_ratio) / self.target_ratio
        size_term = self.size_weight * soft.to(task_loss.dtype) / self.target_ratio
        choose_task = d_loss >= d_size
        if self.stop_at_target:  # never shrink past the target: once met, train the task loss only
            choose_task = choose_task | (d_size <= 0)
        self.last_choice = choose_task
        return torch.where(choose_task, task_loss, size_term) + self._core_term()

    def start_late_stage(self, target_loss: float | None = None) -> None:
        """Switch to the late stage. The task-loss target is ``target_loss``, else
        the one given at construction, else the smoothed early-stage loss."""
        if self.stage == "late":
            return
        chosen = target_loss if target_loss is not None else self._user_target_loss
        if chosen is not None:
            _check_positive("target_loss", chosen)
            self._target_loss = torch.tensor(float(chosen))
        else:
            smoothed = self.smoothed_loss()
            if smoothed is None:
                raise RuntimeError("no task loss seen in the early stage to set the late-stage target; "
                                   "call penalty() during the early stage or pass target_loss=")
            self._target_loss = smoothed.detach().clone()
        self.stage = "late"
        self._late_start, self._late_start_ratio = self.steps_done, self.compiled.ratio
        self.version += 1

    # ------------------------------------------------------------ truncation
    def step(self) -> RankEvent:
        """Call after ``optimizer.step()``: advance the schedule; every
        ``truncate_every`` steps cut switched-off ranks (host sync only then)."""
        self.steps_done += 1
        if self._bad_losses is not None and self._bad_losses.device.type == "cpu":
            self._report_nonfinite_losses()  # a free read on CPU; on a GPU the next truncation reads it
        stage_changed = False
        if self.stage == "early" and self.early_steps is not None and self.steps_done >= self.early_steps:
            self.start_late_stage()
            stage_changed = True
        event = RankEvent(self.steps_done, self.stage, stage_changed)
        budget = self._due_budget()
        if budget is not None:
            cut = self.truncate(budget=budget)
            event.truncated, event.removed = cut.truncated, cut.removed
            if budget <= self.target_ratio:
                self.recovering = True  # the objective changes: captured steps are stale
                self.version += 1
        elif self.truncate_every and self.steps_done % self.truncate_every == 0:
            cut = self.truncate()
            event.truncated, event.removed = cut.truncated, cut.removed
        return event

    def final_cut_step(self) -> int | None:
        """``schedule="budget"``: the step of the last cut (to ``target_ratio``), once
        the late stage has begun; then the recovery steps follow."""
        return self._schedule.final_cut_step(self)

    def budget(self) -> float | None:
        """``schedule="budget"``: the ratio the late stage allows now (falls linearly
        from the ratio at the stage switch to ``target_ratio`` at :meth:`final_cut_step`)."""
        final = self.final_cut_step()
        if final is None:
            return None
        start = self._late_start_ratio if self._late_start_ratio is not None else self.compiled.ratio
        share = min(1.0, (self.steps_done - self._late_start) / max(1, final - self._late_start))
        return max(self.target_ratio, start + (self.target_ratio - start) * share)

    def _due_budget(self) -> float | None:
        """The budget to cut to at this step, or ``None`` when no budget cut is due."""
        return self._schedule.due_budget(self)

    @torch.no_grad()
    def truncate(self, budget: float | None = None) -> RankEvent:
        """Cut every switched-off rank now (cores, gates, optimizer state, plans),
        and with ``budget`` also the least important ranks until the model's
        ratio is at most ``budget`` (:meth:`importance`; every bond keeps one).

        This decides what to cut from the gates; the edits run as passes
        through a pipeline on ``compiled.program`` -- ``truncate_ranks`` (slice
        cores and gates), ``collapse_layers`` (layers whose bond lost every
        rank become their bias) and ``replan`` -- so they are linted, recorded
        in its history and dumped like compile-time passes. The optimizer's
        state is then sliced to match.

        A model sharded by :func:`tncompile.distributed.shard` (FSDP2) is
        gathered first and sharded again after the cut, optimizer state
        included (:func:`~.sharding.gathered`).
        """
        with gathered(self.compiled, self.optimizer):
            return self._truncate(budget)

    def _truncate(self, budget: float | None) -> RankEvent:
        event = RankEvent(self.steps_done, self.stage)
        # every process decides from rank 0's numbers (replicas agree anyway; this makes sure)
        broadcast_from_rank0([p for m in self._layers.values()
                              for p in (*m.cores._parameters.values(), *m.gates._parameters.values())],
                             self.process_group)
        self._report_nonfinite_losses()
        keep: dict[str, list[torch.Tensor]] = {}
        collapse: dict[str, str] = {}
        dropped: list[Cut] = []
        unreadable = self._nonfinite_gates()
        for name, mod in self._layers.items():
            if name in unreadable:
                continue
            kept = []
            for k, g in enumerate(mod.gates._parameters.values()):
                on = _switched_on(g.abs(), self.threshold)
                if on.shape[-1] == 0:
                    if self.allow_layer_removal:
                        collapse[name] = f"removed by rank adaptation: every rank of bond {k} switched off"
                        break
                    on = g.abs().argmax(-1).unsqueeze(-1)  # a bond keeps its strongest rank
                kept.append(on)
            if name in collapse:
                dropped += [Cut(p, None, {}) for p in (*mod.cores._parameters.values(),
                                                       *mod.gates._parameters.values())]
            elif any(idx.shape[-1] != r for idx, r in zip(kept, mod.layout.ranks)):
                keep[name] = kept
        if budget is not None:
            keep.update(self._budget_keep(budget, keep, set(collapse) | unreadable))
        if not keep and not collapse:
            self._check_ranks_agree()
            return event
        truncate = TruncateRanks(keep)
        edits = ([truncate] if keep else []) + ([CollapseLayers(collapse)] if collapse else []) + [Replan()]
        self.compiled._run_passes(edits)
        event.truncated, event.removed = dict(truncate.truncated), list(collapse)
        remap_optimizer(self.optimizer, truncate.cuts + dropped, self.optimizer_state)
        self.version += 1
        self._refresh()
        self._check_ranks_agree()
        if collapse and not self._layers:
            warnings.warn(f"RankController: rank adaptation removed every TT/TTM layer (step {self.steps_done}); "
                          f"the model is at ratio {self.compiled.ratio:.4g} and trains on without a rank "
                          "penalty. Pass allow_layer_removal=False to keep each layer at rank >= 1.",
                          RuntimeWarning, stacklevel=2)
        return event

    def _check_ranks_agree(self) -> None:
        """Distributed: every process must hold the same layers at the same ranks
        (:class:`~.distributed.RankMismatchError` on all of them otherwise)."""
        if self.process_group is None:
            return
        flat = [len(self._layers)] + [r for m in self._layers.values() for r in (len(m.layout.ranks), *m.layout.ranks)]
        check_same_everywhere(flat, self.process_group, "the TT ranks after a truncation")

    def _nonfinite_gates(self) -> set[str]:
        """Layers whose gates hold NaN / inf (host read: truncation syncs anyway).
        ``nonfinite="raise"`` raises naming them; ``"skip"`` leaves them uncut."""
        bad = {name for name, mod in self._layers.items()
               if not all(bool(torch.isfinite(g).all()) for g in mod.gates._parameters.values())}
        if bad and self.nonfinite == "raise":
            raise FloatingPointError(f"RankController: rank gates of {sorted(bad)[:3]} are not finite at step "
                                     f"{self.steps_done}; cutting from them would drop every rank. Lower the "
                                     f"learning rate (gate_lr) or pass nonfinite='skip' to leave them uncut.")
        if bad:
            warnings.warn(f"RankController: not cutting {sorted(bad)[:3]}: their rank gates are not finite "
                          f"(step {self.steps_done})", RuntimeWarning, stacklevel=3)
        return bad

    def importance(self, name: str) -> list[torch.Tensor]:
        """Per bond of layer ``name``, each rank's weight in the product:
        ``|g_i| * ||G_k[..., i]|| * ||G_{k+1}[i, ...]||`` (a rank the gate keeps
        on but whose core slices are small matters little too). Experts:
        ``(experts, r)`` per bond, each expert's own."""
        mod = self._layers[name]
        lead = mod.stacked
        cores = list(mod.cores._parameters.values())
        out = []
        for k, g in enumerate(mod.gates._parameters.values()):
            left = cores[k].detach().flatten(lead, -2).norm(dim=-2)
            right = cores[k + 1].detach().flatten(lead + 1).norm(dim=-1)
            out.append(g.detach().abs() * left * right)
        return out

    def _budget_keep(self, budget: float, keep: dict[str, list[torch.Tensor]],
                     removed: set[str]) -> dict[str, list[torch.Tensor]]:
        """Which ranks each layer keeps so that the model's ratio is at most
        ``budget``: from the ranks kept after dropping switched-off ones, the
        one with the smallest share of its bond's importance is dropped, one at
        a time, globally (every bond keeps one). Shares, not raw importances:
        core norms differ between layers and bonds, and a narrow boundary bond
        (4 ranks) must not lose ranks before a wide inner one (48)."""
        limit = budget * self._original - self._other_params
        kept: dict[str, list[list[int]]] = {}
        scores: dict[str, list[list[float]]] = {}
        ordered: dict[str, list[torch.Tensor]] = {}  # experts: each expert's candidates, strongest first
        size = 0
        for name, mod in self._layers.items():
            if name in removed:
                continue
            on = keep[name] if name in keep else [torch.arange(r, device=g.device).expand(*g.shape[:-1], r)
                                                  for r, g in zip(mod.layout.ranks, mod.gates._parameters.values())]
            # each rank's share of its bond's total importance: comparable across bonds and layers
            shares = [(t / t.sum(-1, keepdim=True).clamp_min(1e-30)).double() for t in self.importance(name)]
            if mod.stacked:  # positions: the j-th strongest rank of every expert, scored by the strongest of them
                ordered[name], kept[name], scores[name] = [], [], []
                for share, idx in zip(shares, on):
                    cand = share.gather(-1, idx.to(share.device))
                    order = cand.argsort(-1, descending=True)
                    ordered[name].append(idx.to(share.device).gather(-1, order))
                    kept[name].append(list(range(idx.shape[-1])))
                    scores[name].append(cand.gather(-1, order).amax(0).cpu().tolist())
            else:
                kept[name] = [sorted(idx.cpu().tolist()) for idx in on]
                scores[name] = [s.cpu().tolist() for s in shares]
            size += _layer_size([len(b) for b in kept[name]], mod.layout)
        heap = [(scores[n][k][i], n, k, i) for n, bonds in kept.items() for k, b in enumerate(bonds) for i in b]
        heapq.heapify(heap)
        while size > limit and heap:
            _, name, k, i = heapq.heappop(heap)
            bonds = kept[name]
            if len(bonds[k]) <= 1:
                continue
            layout = self._layers[name].layout
            before = _layer_size([len(b) for b in bonds], layout)
            bonds[k].remove(i)
            size += _layer_size([len(b) for b in bonds], layout) - before
        out = {}
        for name, bonds in kept.items():
            ranks = self._layers[name].layout.ranks
            if name in keep or any(len(b) != r for b, r in zip(bonds, ranks)):
                device = next(iter(self._layers[name].gates._parameters.values())).device
                if name in ordered:  # positions are a prefix of each expert's strongest-first order
                    out[name] = [idx[:, :len(b)].to(device) for idx, b in zip(ordered[name], bonds)]
                else:
                    out[name] = [torch.tensor(b, dtype=torch.long, device=device) for b in bonds]
        return out

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Schedule, targets and loss average (not the model or optimizer)."""
        return {"stage": self.stage, "steps_done": self.steps_done, "version": self.version,
                "target_loss": self._target_loss, "ema": self._ema, "ema_weight": self._ema_w,
                "early_steps": self.early_steps, "target_ratio": self.target_ratio,
                "late_steps": self.late_steps, "late_start": self._late_start,
                "late_start_ratio": self._late_start_ratio, "recovering": self.recovering}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (into a controller built on the
        reloaded model and optimizer)."""
        missing = [k for k in ("stage", "steps_done", "version", "target_loss", "ema", "ema_weight", "early_steps")
                   if k not in state] if isinstance(state, dict) else ["(not a dict)"]
        if missing:
            raise ValueError(f"RankController.load_state_dict: not a controller state (missing {missing}); "
                             "pass what RankController.state_dict() returned")
        if state["stage"] not in STAGES:
            raise ValueError(f"unknown stage {state['stage']!r:.40} in controller state")
        if not isinstance(state.get("recovering", False), bool):
            raise ValueError("controller state: recovering must be true or false")
        counts = {k: check_int(state.get(k), f"controller state {k}", 0, 2**62, none_ok=k in ("late_steps", "late_start", "early_steps"))
                  for k in ("steps_done", "version", "early_steps", "late_steps", "late_start")}
        scalars = {k: _scalar_tensor(state[k], k) for k in ("target_loss", "ema", "ema_weight")}
        late_start_ratio = check_float(state.get("late_start_ratio"), "controller state late_start_ratio", 0.0,
                                       none_ok=True)
        self.stage = state["stage"]
        self.steps_done, self.version, self.early_steps = counts["steps_done"], counts["version"], counts["early_steps"]
        self._target_loss, self._ema, self._ema_w = scalars["target_loss"], scalars["ema"], scalars["ema_weight"]
        if "late_steps" in state:
            self.late_steps = counts["late_steps"]
        self._late_start, self._late_start_ratio = counts["late_start"], late_start_ratio
        self.recovering = state.get("recovering", False)
        self._refresh()

    def __repr__(self) -> str:
        return (f"RankController(stage={self.stage}, schedule={self.schedule}, step={self.steps_done}, "
                f"ratio={self.ratio:.5f}, "
                f"target_ratio={self.target_ratio:g}, layers={len(self._layers)})")


def _scalar_tensor(value: Any, name: str) -> torch.Tensor | None:
    """A saved loss figure: ``None`` or a one-element floating tensor."""
    if value is None or (isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1):
        return value
    raise ValueError(f"controller state {name}: must be None or a one-element float tensor, got {type(value).__name__}")


def _network_size(widths: list, sites: tuple[int, ...]):
    """Parameters of a TT/TTM network whose internal bonds have ``widths``
    (cores ``w[k-1] * n_k * w[k]`` with unit boundaries, plus the gates)."""
    full = [1, *widths, 1]
    return sum(full[k] * n * full[k + 1] for k, n in enumerate(sites)) + sum(widths)


def _layer_size(widths: list, layout) -> Any:
    """Parameters of a layer whose networks (one, or one per expert) have bond ``widths``."""
    return layout.copies * _network_size(widths, layout.site_sizes)


def _on_count(on: torch.Tensor) -> torch.Tensor:
    """Ranks of a bond switched on: ``on (r,)`` counted; ``on (experts, r)``: the
    most any expert has on (the experts' networks share their ranks)."""
    return on.sum(-1).reshape(-1).amax()


def _switched_on(mags: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices a bond keeps: where ``mags (r,) >= threshold``; for ``mags
    (experts, r)``, each expert's strongest ranks, as many as the expert with
    the most on has (``(experts, k)``, strongest first)."""
    if mags.dim() == 1:
        return (mags >= threshold).nonzero().flatten()
    k = int((mags >= threshold).sum(-1).max())
    return mags.argsort(-1, descending=True)[:, :k]


def _compiled_ratio(compiled) -> float:
    """The ratio right after compilation, else (a program built by hand) the current one."""
    at_compile = compiled.program.compiled_ratio
    return max(at_compile, compiled.ratio) if at_compile is not None else compiled.ratio


def _check_positive(name: str, value: Any) -> None:
    check_float(value, f"RankController: {name}", 0.0, low_open=True)
