"""How a layer reads its network in the current context: its gated cores, the plan of a
bucket of rows, and whether merged forms may be kept between calls.

Under ``torch.compile`` the gates are one opaque op and a plan is a constant of the
traced graph; in eager code they are plain products and a dict lookup. The layers ask
here, so no layer module reads the tracer's state itself.
"""
from __future__ import annotations

import torch

from ..kernels.gated_cores import gate_cores
from ..kernels.plans import bucket_of
from ..kernels.tracing import exporting

__all__ = ["scaled_cores", "plan_for", "keeps_merged_forms", "checks_on_host", "recorded_elsewhere"]


def scaled_cores(cores: list[torch.Tensor], gates: list[torch.Tensor]) -> list[torch.Tensor]:
    """``cores`` with each gate multiplied into its left core's right bond: one opaque op
    under ``torch.compile`` (not a kernel per core and gradient), plain products otherwise."""
    if torch.compiler.is_compiling() and not exporting():
        return [*gate_cores(cores[:-1], gates), cores[-1]]
    return [c * g for c, g in zip(cores[:-1], gates)] + [cores[-1]]


def plan_for(layer, rows: int):
    """``layer``'s plan for ``rows`` rows: a dict lookup once its bucket is planned. Under
    ``torch.compile`` fetched (and a new bucket planned: the search runs eagerly, no graph
    break) by one call whose result is a constant of the graph
    (``layer._plan_while_tracing``)."""
    bucket = bucket_of(rows)
    if torch.compiler.is_compiling():
        return layer._plan_while_tracing(bucket)
    plan = layer.plans.get(bucket)
    if plan is None:
        plan = layer.plan_bucket(bucket)
    return plan


def keeps_merged_forms() -> bool:
    """Whether a layer may use a merged form kept from an earlier call (no autograd, not
    traced): a traced graph or a differentiable call merges afresh."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def checks_on_host(t: torch.Tensor) -> bool:
    """Whether checks of ``t``'s values may read them on the host: eager CPU tensors only
    (on a GPU, under ``torch.compile`` or capture they are trusted or asserted on device)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def recorded_elsewhere() -> bool:
    """Inside activation checkpointing (saved-tensor hooks; its recomputation runs in a
    backward pass): a checkpointed region must record the same ops when it is run again,
    so nothing there may depend on what happened before (batched merges, timings)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooked = True if top is None else top(False) is not None
    return hooked or torch._C._current_graph_task_id() != -1
