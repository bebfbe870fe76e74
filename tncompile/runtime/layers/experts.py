"""Mixture-of-experts weights: the dense ``ExpertLinear`` and its TT form ``TTExperts``.

Transformers 5.x keeps an MoE block's experts as fused 3-D parameters
(Mixtral's ``gate_up_proj``, ``down_proj``: ``(experts, out, in)``) and runs
them as grouped products over rows sorted by expert (:mod:`.grouped`). The
frontend outlines each such product into an :class:`ExpertLinear` (the
parameter and the grouped product, nothing else), which ``tensorize``
compresses like a linear layer: every expert becomes a TT matrix of one shared
layout, with its own cores and its own rank gates (:class:`TTExperts`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn

from ...formats.factorization import matched_variance, random_cores, tt_from_linear_weight, tt_to_dense
from ...formats.layout import TTLayout
from ..kernels.grouped import grouped_mm
from ..ways import experts as experts_way
from .tn_module import INITS, TNModule

__all__ = ["ExpertLinear", "TTExperts", "experts_rows"]


class ExpertLinear(nn.Module):
    """``experts`` dense linear maps applied to blocks of rows sorted by expert.

    Parameters
    ----------
    weight : nn.Parameter
        ``(experts, out, in)``, or ``(experts, in, out)`` with ``transposed=True``
        (the model's own parameter object; it is not copied).
    transposed : bool
        How ``weight`` is stored.

    Shapes
    ------
    ``x (rows, in)``, ``offs (experts,)`` (running row totals per expert) ->
    ``(rows, out)``.
    """

    def __init__(self, weight: nn.Parameter, transposed: bool = False):
        super().__init__()
        if weight.dim() != 3:
            raise ValueError(f"ExpertLinear needs a 3-D (experts, out, in) weight, got {tuple(weight.shape)}")
        self.weight = weight
        self.transposed = bool(transposed)
        self.num_experts = weight.shape[0]
        self.in_features, self.out_features = ((weight.shape[1], weight.shape[2]) if transposed
                                               else (weight.shape[2], weight.shape[1]))

    def matrices(self) -> Tensor:
        """Every expert's ``(in, out)`` matrix: ``(experts, in, out)``."""
        return self.weight if self.transposed else self.weight.transpose(-2, -1)

    def expert_weight(self, e: int) -> Tensor:
        """Expert ``e``'s ``(out, in)`` weight, as ``nn.Linear`` stores it."""
        return self.weight[e].t() if self.transposed else self.weight[e]

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        return grouped_mm(x, self.matrices(), offs)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, transposed={self.transposed}")


class TTExperts(TNModule):
    """The experts of an :class:`ExpertLinear`, each a TT matrix of ``layout``.

    Cores are stacked over experts, ``(experts, r[k-1], n[k], r[k])``, and so
    are the rank gates, ``(experts, r[k])``: every expert has its own gates.
    All experts keep the same ranks (the stacked shapes need it); truncation
    keeps, per bond, each expert's strongest ranks (a permutation of a bond's
    index within one expert leaves its matrix unchanged).

    On CPU outside a trace each expert's block of rows runs through its own
    network in the planned order (one host read of ``offs``). On a GPU and
    under ``torch.compile`` the expert matrices are rebuilt (one batched
    contraction) and multiplied by :func:`.grouped.grouped_mm`: no host sync.

    Shapes
    ------
    ``x (rows, in_features)``, ``offs (experts,)`` -> ``(rows, out_features)``.
    """

    stacked = 1  # cores and gates have one leading dim of experts

    def __init__(self, layout: TTLayout, transposed_storage: bool = False, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(layout, TTLayout):
            raise TypeError(f"TTExperts needs a TTLayout, got {type(layout).__name__}")
        self._init_params(layout, device, dtype)
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self.num_experts = layout.experts
        self.transposed_storage = bool(transposed_storage)

    def init_variance(self) -> float:
        """Each expert as ``nn.Linear``'s default: variance ``1/(3 in_features)``."""
        return 1.0 / (3 * self.in_features)

    @classmethod
    def from_experts(cls, dense: ExpertLinear, rank: int | Sequence[int] | None = 16, num_cores: int = 3,
                     init: str = "svd", layout: TTLayout | None = None,
                     generator: torch.Generator | None = None) -> "TTExperts":
        """Build from an :class:`ExpertLinear`: TT-SVD of each expert's weight
        (``init="svd"``), or cores drawn with ``nn.Linear``'s variance."""
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        if layout is None:
            layout = TTLayout.for_shape(dense.in_features, dense.out_features, num_cores, experts=dense.num_experts)
        if layout.ranks is None or rank is not None:
            layout = layout.with_ranks(rank)
        if (layout.in_features, layout.out_features, layout.experts) != (
                dense.in_features, dense.out_features, dense.num_experts):
            raise ValueError(f"layout is for {layout.experts} experts {layout.in_features}->{layout.out_features}, "
                             f"the layer has {dense.num_experts} experts {dense.in_features}->{dense.out_features}")
        weight = dense.weight
        mod = cls(layout, transposed_storage=dense.transposed, device=weight.device, dtype=weight.dtype)
        per_expert = []
        for e in range(dense.num_experts):
            per_expert.append(tt_from_linear_weight(dense.expert_weight(e), layout) if init == "svd"
                              else random_cores(layout, matched_variance(dense.expert_weight(e),
                                                                         1.0 / (3 * dense.in_features)), generator))
        mod.set_cores([torch.stack(cs).to(weight.dtype) for cs in zip(*per_expert)])
        return mod

    def scaled_cores(self) -> list[Tensor]:
        """Cores with each expert's gate multiplied into its core's right bond."""
        cores = list(self.cores._parameters.values())
        gates = list(self.gates._parameters.values())
        return [c * g[:, None, None, :] for c, g in zip(cores[:-1], gates)] + [cores[-1]]

    def weight(self) -> Tensor:
        """Every expert's dense ``(out, in)`` matrix: ``(experts, out, in)``."""
        layout = self.layout
        return torch.vmap(lambda *cores: tt_to_dense(list(cores), layout))(*self.scaled_cores())

    def stored_weight(self) -> Tensor:
        """Every expert's dense matrix in the orientation of the parameter it replaced:
        ``(experts, in, out)`` with ``transposed_storage``, else ``(experts, out, in)``."""
        weight = self.weight()
        return weight.transpose(-2, -1) if self.transposed_storage else weight

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        return experts_way.run(self, x, offs)

    def to_dense_module(self) -> ExpertLinear:
        with torch.no_grad():
            w = self.weight()
            w = w.transpose(-2, -1) if self.transposed_storage else w
            return ExpertLinear(nn.Parameter(w.contiguous().clone()), transposed=self.transposed_storage)


def experts_rows(rows: int, experts: int) -> int:
    """Rows one expert multiplies on average when ``rows`` (token, expert) pairs are spread over ``experts``."""
    return max(1, math.ceil(rows / max(experts, 1)))
