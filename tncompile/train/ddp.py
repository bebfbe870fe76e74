"""Rank-adaptive training across processes (``torch.distributed``, DDP).

Rank truncation replaces parameters, which a ``DistributedDataParallel``
wrapper built earlier no longer reduces, and CoMERA's late-stage rule reads the
loss, which differs per process. So, when ``torch.distributed`` is initialized
(or a ``process_group`` is given):

* :class:`~tncompile.train.controller.RankController` averages the task loss
  over the processes (one scalar all-reduce per step, on the loss's device: no
  host sync on CUDA) before it enters the loss average or the late-stage rule;
* a truncation first broadcasts every TT/TTM layer's cores and gates from rank
  0, so every process decides the same cut from the same numbers, then gathers
  the new ranks from every process and raises :class:`RankMismatchError` on all
  of them (never a hang) if any differ;
* :class:`DistributedModel` wraps a compiled model in DDP and rebuilds the DDP
  wrapper (with your keyword arguments) after each cut: call its
  :meth:`~DistributedModel.after_step` with the controller's event, or let
  ``tncompile.fit(..., ddp=dict(...))`` / ``TrainStep`` do it.

``fit``, ``TrainStep``, ``param_groups``, ``RankController`` and ``save``
accept such a wrapper (or a plain DDP one) in place of the compiled model
(:func:`unwrap`).
"""
from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..serialization import save
from .sharding import full_parameters
from .side_stream import side_stream

__all__ = ["DistributedModel", "RankMismatchError", "unwrap", "is_ddp", "active_group", "world_size", "rank",
           "mean_over_processes", "broadcast_from_rank0", "check_same_everywhere", "save_on_rank0",
           "check_controller_group", "DDP_WARMUP_STEPS"]


class RankMismatchError(RuntimeError):
    """Processes ended a truncation with different ranks (raised on every process)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The compiled model inside a :class:`DistributedModel`, a DDP or a ``DataParallel``
    wrapper, or what ``torch.compile`` returned (any depth, as accelerate's ``prepare``
    hands them); ``model`` itself otherwise."""
    while True:
        if isinstance(model, (DistributedModel, nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def is_ddp(model: nn.Module) -> bool:
    """Whether ``model`` reduces gradients with DistributedDataParallel (itself, or a
    wrapper around one at any depth)."""
    while isinstance(model, (DistributedModel, nn.parallel.DistributedDataParallel, nn.DataParallel)):
        if not isinstance(model, nn.DataParallel):
            return True
        model = model.module
    return False


def active_group(process_group: Any = None) -> Any:
    """The group to agree over: ``process_group`` if given, else the default group
    when ``torch.distributed`` is initialized with more than one process, else ``None``."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def world_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else 1


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 when not distributed)."""
    group = active_group(group)
    return dist.get_rank(group) if group is not None else 0


def mean_over_processes(value: torch.Tensor, group: Any) -> torch.Tensor:
    """``value`` averaged over the processes of ``group`` (a new tensor; one all-reduce)."""
    if group is None:
        return value
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out / world_size(group)


def broadcast_from_rank0(tensors: list[torch.Tensor], group: Any) -> None:
    """Overwrite ``tensors`` in place with rank 0's values."""
    if group is None:
        return
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)


def check_same_everywhere(values: list[int], group: Any, what: str) -> None:
    """Raise :class:`RankMismatchError` on every process of ``group`` unless all of
    them hold the same ``values`` (one all-gather of a small integer tensor)."""
    if group is None:
        return
    device = _collective_device(group)
    mine = torch.tensor([len(values), *values], dtype=torch.int64, device=device)
    length = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    longest = length.clone()
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    padded = torch.full((int(longest),), -1, dtype=torch.int64, device=device)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in range(world_size(group))]
    dist.all_gather(gathered, padded, group=group)
    differ = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if differ:
        raise RankMismatchError(f"{what} differ between processes: rank 0 has {_values(gathered[0])}, rank "
                                f"{differ[0]} has {_values(gathered[differ[0]])}. Every process must run the same "
                                "steps with the same controller settings (and cut only through the controller).")


def check_controller_group(controller: Any, model: nn.Module) -> None:
    """Raise unless ``controller`` agrees over as many processes as ``model``
    (a :class:`DistributedModel`) averages gradients over: with fewer, processes
    outside its group would decide their cuts alone and the replicas would split."""
    if controller is None or not isinstance(model, DistributedModel):
        return
    ddp_group = model.ddp_kwargs.get("process_group") or dist.group.WORLD
    ddp_n, ctl_n = dist.get_world_size(ddp_group), world_size(controller.process_group)
    if ddp_n != ctl_n:
        raise ValueError(f"RankController agrees over {ctl_n} process(es) but DistributedModel averages gradients "
                         f"over {ddp_n}: processes would cut different ranks. Build the controller with "
                         "process_group= the group DDP uses (or leave both out: the default group).")


def _values(t: torch.Tensor) -> list[int]:
    n = int(t[0])
    return t[1:1 + n].tolist()


def _collective_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def save_on_rank0(compiled: nn.Module, path: Any, group: Any = None, **save_kwargs: Any) -> None:
    """``tncompile.save`` by rank 0 alone (atomically, as always), with every
    process's CPU random state in the file (``extra["rng_per_rank"]``) so that
    :func:`tncompile.resume` gives each rank its own back. All processes wait
    until the file is complete.

    A model sharded by :func:`~.sharding.shard` (FSDP2) is saved whole: every
    process gathers the shards (and the ``optimizer=`` states) for the write
    and keeps its shards afterwards.
    """
    group = active_group(group)
    compiled = unwrap(compiled)
    with full_parameters(compiled, save_kwargs.get("optimizer")):
        if group is None:
            save(compiled, path, **save_kwargs)
            return
        mine = torch.get_rng_state()
        states = [torch.empty_like(mine) for _ in range(world_size(group))]
        dist.all_gather(states, mine, group=group)
        if dist.get_rank(group) == 0:
            extra = dict(save_kwargs.pop("extra", None) or {})
            extra["rng_per_rank"] = states
            save(compiled, path, extra=extra, **save_kwargs)
        dist.barrier(group=group)


DDP_WARMUP_STEPS = 11
"""Eager DDP iterations before a CUDA graph may capture a DDP step (PyTorch's CUDA-graph notes)."""


class DistributedModel(nn.Module):
    """A compiled model under ``DistributedDataParallel`` that survives rank cuts.

    Parameters
    ----------
    compiled : CompiledModel
    **ddp_kwargs
        Passed to ``torch.nn.parallel.DistributedDataParallel`` every time the
        wrapper is (re)built (``device_ids``, ``bucket_cap_mb``, ...).

    Call it like the model. After each ``optimizer.step()`` and
    ``controller.step()``, call :meth:`after_step` with the event: when ranks
    were cut it builds a new DDP wrapper over the new parameters (the old one
    is released so its gradient hooks go too).

    On CUDA the wrapper is built on a side stream (:meth:`use_stream`), as
    CUDA-graph capture of a DDP step requires; ``TrainStep`` also runs
    :data:`DDP_WARMUP_STEPS` eager steps before each capture, and again after
    every cut (the new wrapper starts over).
    """

    def __init__(self, compiled: nn.Module, **ddp_kwargs: Any):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistributedModel: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group(...) first (torchrun does the environment)")
        self.module = unwrap(compiled)
        self.ddp_kwargs = dict(ddp_kwargs)
        self.rebuilds = 0
        self.__dict__["build_stream"] = None
        self._build()

    def use_stream(self, stream: Any) -> None:
        """Build DDP (now, and after every cut) on ``stream``: the stream a
        captured step warms up and captures on (``TrainStep`` passes its own).
        PyTorch's CUDA-graph notes: DDP must be built on a side stream, and its
        gradient-accumulation nodes belong to the stream they were made on."""
        if stream is not self.__dict__["build_stream"]:
            self.__dict__["build_stream"] = stream
            self._build()

    def _stream(self) -> Any:
        """The side stream to build DDP on: the one given, else (CUDA parameters) a stream of our own."""
        stream = self.__dict__["build_stream"]
        if stream is None and any(p.is_cuda for p in self.module.parameters()):
            stream = self.__dict__.setdefault("_own_stream", side_stream(next(self.module.parameters()).device))
        return stream

    def _build(self) -> None:
        self.__dict__.pop("_ddp", None)
        gc.collect()  # the old reducer's hooks are removed when it is freed
        stream = self._stream()
        if stream is None:
            ddp = nn.parallel.DistributedDataParallel(self.module, **self.ddp_kwargs)
        else:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                ddp = nn.parallel.DistributedDataParallel(self.module, **self.ddp_kwargs)
            torch.cuda.current_stream().wait_stream(stream)
        # not a registered submodule: the parameters belong to ``module`` alone
        self.__dict__["_ddp"] = ddp

    @property
    def ddp(self) -> nn.parallel.DistributedDataParallel:
        return self.__dict__["_ddp"]

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def after_step(self, event: Any = None) -> bool:
        """Rebuild the DDP wrapper if ``event`` says shapes changed (or when called
        with no event). Returns whether it did."""
        if event is not None and not getattr(event, "shapes_changed", False):
            return False
        self._build()
        self.rebuilds += 1
        return True
