"""``StepGuard``: an optimizer step that a non-finite loss or gradient leaves undone, decided on the device.

On the CPU the flag is read on the host (free there) and the optimizer is
simply not stepped. On a GPU, GradScaler skips the step of a fused optimizer
on the device and syncs with the host for the others; a captured training
step cannot sync. There the guard works with any optimizer: it keeps a copy of the parameters and the
optimizer's tensor state, lets the optimizer step, and puts the copy back
where the step was not finite (``torch.where`` on a device flag: no host
read, so it is captured with the rest of the step). State the step created
(an optimizer's first step) is reset to zeros when the step was not finite,
which is its fresh value for Adam, AdamW and SGD with momentum (up to
dampening). The copy costs one more set of the parameters and optimizer
state, small for a compressed model. Skipped steps are counted on the device.
Under FSDP2 the guard works on each process's shards and the processes agree
on the decision (one all-reduce of the flag), so every shard skips alike.
"""
from __future__ import annotations

import torch
from torch import nn

from ..runtime.layers.module_kinds import is_shard

__all__ = ["StepGuard"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard's local tensor (a view: writing it writes the shard); a plain tensor itself."""
    return t.to_local() if is_shard(t) else t


class StepGuard:
    """Run ``optimizer.step()`` only where ``total`` and every gradient are finite.

    Attributes
    ----------
    skipped : torch.Tensor or None
        ``int64`` scalar on the parameters' device: steps left undone so far
        (updated in place, so captured replays count too).
    """

    def __init__(self) -> None:
        self.skipped: torch.Tensor | None = None

    def step(self, optimizer: torch.optim.Optimizer, total: torch.Tensor) -> torch.Tensor:
        """Step ``optimizer`` unless ``total`` or a gradient is non-finite; returns the device flag
        (``True``: the step was applied)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [_local(p.grad) for p in params if p.grad is not None]
        device = _local(params[0]).device if params else total.device
        finite = torch.isfinite(_local(total.detach())).all().to(device)
        if grads:
            finite = finite & torch.stack([torch.isfinite(g).all().to(device) for g in grads]).all()
        if any(is_shard(p) for p in params) and torch.distributed.is_initialized():
            # FSDP2: each process sees its own shards; all of them must take the same decision
            agreed = finite.to(torch.int32)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            finite = agreed.bool()
        if device.type == "cpu":  # reading the flag is free here: step or not, nothing to copy
            if bool(finite):
                optimizer.step()
        else:
            self._step_where(optimizer, params, finite)
        if self.skipped is None or self.skipped.device != finite.device:
            self.skipped = torch.zeros((), dtype=torch.int64, device=finite.device)
        self.skipped.add_((~finite).to(torch.int64))
        return finite

    def _step_where(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                    finite: torch.Tensor) -> None:
        """The device path: step, then put the copy back where ``finite`` is false (no host read)."""
        kept = [(t, t.clone()) for t in (_local(x).detach() for x in self._tensors(optimizer, params))]
        had_state = {id(p) for p in params if optimizer.state.get(p)}
        optimizer.step()
        with torch.no_grad():
            for t, copy in kept:
                t.copy_(torch.where(finite.to(t.device), t, copy))
            for p in params:
                if id(p) in had_state:
                    continue
                for value in optimizer.state.get(p, {}).values():  # state this step created
                    if isinstance(value, torch.Tensor):
                        value = _local(value)
                        value.copy_(torch.where(finite.to(value.device), value, torch.zeros_like(value)))

    @staticmethod
    def _tensors(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = list(params)
        for p in params:
            out += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return out
