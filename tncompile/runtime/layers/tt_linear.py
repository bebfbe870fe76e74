"""``TTLinear``: ``y = x @ W.T + b`` with ``W`` stored as a tensor train.

The layer holds its parameters and the forms derived from them; how a call runs (seven
ways, chosen per context and rows, measured where several apply) is
:mod:`..ways.linear`'s.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ...formats.factorization import matched_variance, random_cores, tt_factors, tt_from_linear_weight, tt_to_dense
from ...formats.layout import TTLayout
from ..ways import linear as linear_way
from .derived import kept
from .module_kinds import linear_weight_of
from .network_matrix import NetworkMatrix
from .tn_module import TNModule, check_init, draw_whole, resolve_layout

__all__ = ["TTLinear"]


class TTLinear(TNModule):
    """``y = x @ W.T + b`` with ``W`` stored in TT format (input modes first).

    Parameters
    ----------
    layout : TTLayout
        Modes and ranks; ``layout.ranks`` must be set.
    bias : bool
        Whether the layer has a bias of shape ``[out_features]``.

    Shapes
    ------
    input ``(..., in_features)`` -> output ``(..., out_features)``.

    Inference (no autograd, not under ``torch.compile``) multiplies by the network
    merged into two thin factors ``W.T = A @ B`` (or the whole ``W`` when that is
    smaller), kept until a core or gate may have changed, whenever that costs no more
    multiply-adds than the planned contraction: two GEMMs instead of a chain of
    small products, which is what decoding (one row per sequence) needs.
    """

    transient_state = TNModule.transient_state + ("_inference", "_pair_choice", "_whole_choice", "_measured_choice",
                                                 "_measured_keys",
                                                 "_factor_peers")
    merge_in_inference = True

    def __init__(self, layout: TTLayout, bias: bool = True, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(layout, TTLayout):
            raise TypeError(f"TTLinear needs a TTLayout, got {type(layout).__name__}")
        self._init_params(layout, device, dtype)
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self.bias = nn.Parameter(torch.zeros(layout.out_features, device=device, dtype=dtype)) if bias else None
        self._chain_choice: dict = {}  # see ways.linear.choice_cache

    @classmethod
    def from_linear(cls, linear: nn.Module, rank: int | Sequence[int] = 16, num_cores: int = 3,
                    init: str = "svd", layout: TTLayout | None = None,
                    generator: torch.Generator | None = None) -> "TTLinear":
        """Build from an ``nn.Linear`` (or HF ``Conv1D``).

        ``init="svd"`` fits the cores to the weight by TT-SVD (exact at full
        rank); ``init="random"`` draws cores whose product has the variance of
        the layer's weight as the model initialized it (:func:`matched_variance`;
        ``nn.Linear``'s default ``1 / (3 in_features)`` on the meta device).
        """
        check_init(init)
        weight = linear_weight_of(linear)
        out_f, in_f = weight.shape
        layout = resolve_layout(layout, lambda: TTLayout.for_shape(in_f, out_f, num_cores),
                                 rank, weight.shape)
        bias = getattr(linear, "bias", None)
        mod = cls(layout, bias=bias is not None, device=weight.device, dtype=weight.dtype)
        cores = (tt_from_linear_weight(weight, layout) if init == "svd"
                 else random_cores(layout, matched_variance(weight, 1.0 / (3 * in_f)), generator))
        mod.set_cores([c.to(weight.dtype) for c in cores])
        if bias is not None:
            with torch.no_grad():
                mod.bias.copy_(bias)
        return mod

    def init_variance(self) -> float:
        """``nn.Linear``'s default: entries uniform in ``±1/sqrt(in_features)``, variance ``1/(3 in)``."""
        return 1.0 / (3 * self.in_features)

    def reset_own_parameters(self) -> None:
        """The bias as ``nn.Linear`` draws it: uniform in ``±1/sqrt(in_features)``."""
        if self.bias is not None:
            draw_whole(self.bias, self.in_features ** -0.5, uniform=True)

    @property
    def weight(self) -> NetworkMatrix:
        """``weight()``: the dense ``[out_features, in_features]`` matrix the network stands for
        (``weight.device`` / ``dtype`` / ``shape`` without making it: :class:`.NetworkMatrix`)."""
        return NetworkMatrix(self, lambda: tt_to_dense(self.scaled_cores(), self.layout),
                             (self.layout.out_features, self.layout.in_features))

    def merged_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The matrix as two thin factors, ``W.T = A @ B`` (gates included):
        ``A (padded_in, r)`` merges the input cores, ``B (r, padded_out)``
        the output cores, ``r`` the bond between them. Differentiable.

        In a model ``compile`` made, computed with those of every layer of the same
        layout in one batched pass (:mod:`.factor_groups`)."""
        peers = self.__dict__.get("_factor_peers")
        if peers is not None:
            got = peers.factors(self)
            if got is not None:
                return got
        return tt_factors(self.scaled_cores(), len(self.layout.in_modes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_way.run(self, x)

    def activated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(self(x))`` for ``activation`` in :data:`~tncompile.runtime.triton.ACTIVATIONS`
        (``"gelu"``, ``"gelu_tanh"``, ``"relu"``): on the Triton kernels the thin pair's
        epilogue, so the activation's input is never written; otherwise the layer, then the
        activation. ``x (..., in_features) -> (..., out_features)``."""
        return linear_way.run_activated(self, x, activation)

    def inference_macs(self, rows: int) -> int:
        """Multiply-adds of an inference forward (no autograd) over ``rows`` rows, as this
        layer runs it: through its merged factors or its planned contraction."""
        return linear_way.inference_macs(self, rows)

    def inference_factors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(A (in, r), B (r, out))`` with ``W.T = A @ B`` (padding cropped), or
        ``(W.T, None)`` when the whole matrix has fewer entries than the two factors;
        kept (not saved) until a core or gate may have changed (:func:`.derived.kept`)."""
        return kept(self, "_inference", self.network_tensors(), self._make_inference_factors)

    def _make_inference_factors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        # merged alone, not with its batch: a kept form is made rarely, and a batch would leave
        # its peers factors that outlive this call
        a, b = tt_factors(self.scaled_cores(), len(self.layout.in_modes))
        a, b = a[: self.in_features], b[:, : self.out_features]
        if a.shape[1] * (self.in_features + self.out_features) >= self.in_features * self.out_features:
            return (a @ b).contiguous(), None
        return a.contiguous(), b.contiguous()

    def to_dense_module(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.cores[0].device, dtype=self.cores[0].dtype)
        with torch.no_grad():
            lin.weight.copy_(self.weight())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin
