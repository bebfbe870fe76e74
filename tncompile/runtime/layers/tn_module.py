"""What every layer stored as a tensor network shares: :class:`TNModule`.

A layer holds its cores, one rank-gate vector per internal bond (all ones until rank
adaptation trains them) and, for linears, a bias. The gates scale the right-hand bond of
their core, so the network computes exactly the matrix ``tt_to_dense(scaled_cores())``.
How a call runs is its op's module in :mod:`..ways`, which the layer calls once.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ...formats.factorization import core_std
from ...formats.indices import planner_problem
from ...formats.layout import TTLayout, TTMLayout
from ..kernels.plans import ContractionPlan, LookupPlan, get_planner
from ..kernels.tracing import constant_while_traced, never_traced
from ..ways.network import plan_for, scaled_cores
from .derived import advance_weights_epoch

__all__ = ["TNModule", "INITS", "resolve_layout", "check_init", "draw_whole"]

INITS = ("svd", "random")


def resolve_layout(layout, make, rank, dense_shape):
    """The given layout (or a balanced new one), with ``rank`` applied when given,
    checked against the dense weight's shape."""
    layout = make() if layout is None else layout
    if layout.ranks is None or rank is not None:
        layout = layout.with_ranks(rank)
    if tuple(layout.dense_shape) != tuple(dense_shape):
        raise ValueError(f"layout is for a {tuple(layout.dense_shape)} weight, the layer's is "
                         f"{tuple(dense_shape)}")
    return layout


def check_init(init: str) -> None:
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")



def draw_whole(param: torch.Tensor, std: float = 1.0, uniform: bool = False) -> None:
    """Fill ``param`` with ``N(0, std^2)`` (``uniform``: ``U(-std, std)``) drawn whole from the
    current random stream (a core or a bias is small): a ``DTensor`` shard of FSDP2 keeps
    its part of the same whole draw, so processes seeded alike hold one model, and the
    values equal one process's (DTensor's own random ops draw per shard, from a stream of
    their own)."""
    shape, kw = tuple(param.shape), {"dtype": param.dtype, "device": param.device}
    whole = (torch.rand(shape, **kw) * 2 - 1) * std if uniform else torch.randn(shape, **kw) * std
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415
        if isinstance(param, DTensor):  # each process keeps its shard of the whole draw, no communication
            whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(whole)


class TNModule(nn.Module):
    """Shared behaviour of layers stored as a tensor network."""

    layout: TTLayout | TTMLayout
    cores: nn.ParameterList
    gates: nn.ParameterList
    transposed = False  # a tied head applies its embedding's matrix transposed
    stacked = 0  # leading dims of stacked networks on cores and gates (1 for experts)
    transient_state = ("_chain_choice", "_fused_choice")  # caches, not saved with the model

    def _init_params(self, layout, device, dtype) -> None:
        """Zero cores and unit gates for ``layout`` (with a leading dim of
        ``layout.copies`` when the layer stacks networks: ``stacked``). New parameters
        start every kept form afresh: they may land at the freed ones' addresses with the
        same shapes and version counters (a PEFT merge that keeps a layer's ranks did)."""
        if layout.ranks is None:
            raise ValueError(f"{type(self).__name__} needs a layout with ranks; "
                             "call layout.with_ranks(r) first")
        self.layout = layout
        kw = {"device": device, "dtype": dtype}
        lead = (layout.copies,) * self.stacked
        self.cores = nn.ParameterList(nn.Parameter(torch.zeros(*lead, *s, **kw)) for s in layout.core_shapes())
        self.gates = nn.ParameterList(nn.Parameter(torch.ones(*lead, r, **kw)) for r in layout.ranks)
        advance_weights_epoch()

    def init_variance(self) -> float:
        """The variance of an entry of the matrix under the dense layer's default init."""
        raise NotImplementedError(f"{type(self).__name__}.init_variance")

    def reset_parameters(self, variance: float | None = None) -> None:
        """Draw the cores again, in place on their device and dtype (a ``to_empty`` model's,
        and FSDP2's sharded ``DTensor`` cores, too), so that the network's matrix has entries
        of variance ``variance`` (default :meth:`init_variance`: the dense layer's default
        init); every gate back to one; the layer's own other parameters (a bias) as its dense
        layer resets them. With ``to_empty(device=...)`` first, this makes a model compiled
        on the meta device real (:func:`tncompile.materialize` does both)."""
        std = core_std(self.layout, self.init_variance() if variance is None else variance)
        with torch.no_grad():
            for core in self.cores:
                draw_whole(core, std)
            for gate in self.gates:
                nn.init.ones_(gate)
            self.reset_own_parameters()
        advance_weights_epoch()

    def reset_own_parameters(self) -> None:
        """Reset what the layer holds besides its cores and gates (none here)."""

    def train(self, mode: bool = True) -> "TNModule":
        """``nn.Module.train``; also starts every kept inference form afresh
        (:func:`.derived.advance_weights_epoch`): entering evaluation or training is where
        weights are swapped (an EMA copied in through ``p.data``, which no counter sees)."""
        advance_weights_epoch()
        return super().train(mode)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        advance_weights_epoch()  # loaded shards of an FSDP2 model reach its gathered tensors unseen
        super()._load_from_state_dict(*args, **kwargs)

    def network_tensors(self) -> list[torch.Tensor]:
        """The cores and gates: what every merged form of the network derives from
        (:func:`.derived.kept` keeps such a form while they hold the same bits)."""
        return [*self.cores._parameters.values(), *self.gates._parameters.values()]

    def scaled_cores(self) -> list[torch.Tensor]:
        """Cores with each gate multiplied into its left core's right bond."""
        # read the lists' dicts directly: ParameterList indexing costs microseconds per item
        return scaled_cores(list(self.cores._parameters.values()), list(self.gates._parameters.values()))

    def set_cores(self, cores: Sequence[torch.Tensor]) -> None:
        """Copy ``cores`` in (shapes must match the layout); gates reset to one."""
        with torch.no_grad():
            for p, c in zip(self.cores, cores):
                if tuple(p.shape) != tuple(c.shape):
                    raise ValueError(f"core shape {tuple(c.shape)} != expected {tuple(p.shape)}")
                p.copy_(c)
            for g in self.gates:
                g.fill_(1.0)

    # ------------------------------------------------------------ planning
    @property
    def plans(self) -> dict[int, ContractionPlan | LookupPlan]:
        """``bucket -> plan`` cache (saved with the module)."""
        if "_plans" not in self.__dict__:
            self._plans = {}
        return self._plans

    def planner_problem(self) -> tuple[list[tuple[str, ...]], tuple[str, ...], dict[str, int]]:
        """``(inputs, output, sizes)`` of the network the executor contracts
        (:func:`tncompile.formats.planner_problem`)."""
        return planner_problem(self.layout, self.transposed)

    def plan_for(self, rows: int) -> ContractionPlan:
        """The plan for ``rows`` rows (:func:`..ways.network.plan_for`: a dict lookup once its
        bucket is planned; a constant of the graph under ``torch.compile``)."""
        return plan_for(self, rows)

    @constant_while_traced
    def _plan_while_tracing(self, bucket: int):
        """The plan of ``bucket``, planned now if new (run eagerly while tracing;
        the cache is not read by traced code, so no guard sees it change)."""
        plan = self.plans.get(bucket)
        if plan is None:
            plan = self.plan_bucket(bucket)
        return plan

    @never_traced  # planning is host-side search: never traced into a compiled graph
    def plan_bucket(self, bucket: int) -> ContractionPlan:
        """Plan (and cache) the contraction for a bucket of ``bucket`` rows."""
        plan = get_planner().plan_contraction(self.layout, self.transposed, int(bucket))
        self.plans[int(bucket)] = plan
        return plan

    def compressed_params(self) -> int:
        """Parameters of the cores and gates (not the bias)."""
        return self.layout.num_params()

    def extra_repr(self) -> str:
        return f"{self.layout.describe()}, params={self.compressed_params():,}"
