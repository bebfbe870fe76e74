"""``TTMEmbedding``: an embedding table stored as a TTM network.

The layer holds its cores, gates and kept half tables; how a lookup runs is
:mod:`..ways.lookup`'s.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ...formats.factorization import matched_variance, random_cores, ttm_from_embedding_weight, ttm_to_dense
from ...formats.layout import TTMLayout
from ..kernels.plans import LookupPlan, get_planner
from ..kernels.tracing import never_traced
from ..kernels.traced_lookup import half_tables
from ..ways import lookup as lookup_way
from .derived import kept
from .network_matrix import NetworkMatrix
from .tn_module import TNModule, check_init, resolve_layout

__all__ = ["TTMEmbedding"]


class TTMEmbedding(TNModule):
    """Embedding lookup with the table stored in TTM format.

    Each id is split into mode digits ``(i_1..i_d)`` (row-major over
    ``row_modes``); the slices ``G_k[:, i_k]`` are gathered and contracted.
    ``padding_idx`` keeps ``nn.Embedding``'s meaning: a lookup of it returns
    the table's row and sends no gradient to the cores. (TT-SVD of a zero row
    gives a row near zero; as the cores are shared by every row, training
    other rows moves it, where ``nn.Embedding``'s stays fixed. A tied head
    reads the same row, so ``to_dense()`` matches exactly.)

    Shapes
    ------
    input ``(...)`` integer ids -> output ``(..., embedding_dim)``.
    """

    transient_state = TNModule.transient_state + ("_halves",)

    def __init__(self, layout: TTMLayout, padding_idx: int | None = None, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(layout, TTMLayout):
            raise TypeError(f"TTMEmbedding needs a TTMLayout, got {type(layout).__name__}")
        self._init_params(layout, device, dtype)
        self.num_embeddings, self.embedding_dim = layout.num_embeddings, layout.embedding_dim
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} out of range for {self.num_embeddings} rows")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, rank: int | Sequence[int] = 16,
                       num_cores: int = 4, init: str = "svd",
                       layout: TTMLayout | None = None,
                       generator: torch.Generator | None = None) -> "TTMEmbedding":
        """Build from an ``nn.Embedding``.

        ``init="svd"`` fits the cores by TT-SVD; ``init="random"`` matches the
        variance of the table as the model initialized it (:func:`matched_variance`;
        ``nn.Embedding``'s default ``N(0, 1)`` on the meta device).
        ``max_norm`` is not supported (``ValueError``); a ``sparse=True`` table is
        compressed with dense gradients on its cores (small), which SGD, Adagrad or
        Adam take and SparseAdam does not.
        """
        check_init(init)
        if embedding.max_norm is not None:
            raise ValueError("TTMEmbedding does not support max_norm (it renormalizes rows in "
                             "place); leave this embedding dense")
        weight = embedding.weight
        V, D = weight.shape
        layout = resolve_layout(layout, lambda: TTMLayout.for_shape(V, D, num_cores), rank, weight.shape)
        mod = cls(layout, padding_idx=embedding.padding_idx, device=weight.device, dtype=weight.dtype)
        cores = ttm_from_embedding_weight(weight, layout) if init == "svd" else random_cores(layout, matched_variance(weight, 1.0), generator)
        mod.set_cores([c.to(weight.dtype) for c in cores])
        return mod

    def init_variance(self) -> float:
        """``nn.Embedding``'s default: entries ``N(0, 1)``. (A padding row is not zeroed: it is
        one row of a network, not a row of its own; its positions send no gradient.)"""
        return 1.0

    @property
    def weight(self) -> NetworkMatrix:
        """``weight()``: the dense ``[num_embeddings, embedding_dim]`` table (padding row as
        stored; ``weight.device`` / ``dtype`` / ``shape`` without making it)."""
        return NetworkMatrix(self, lambda: ttm_to_dense(self.scaled_cores(), self.layout),
                             (self.layout.num_embeddings, self.layout.embedding_dim))

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Ids must be integers in ``[0, num_embeddings)`` (:func:`..ways.lookup.check_layer_ids`)."""
        lookup_way.check_layer_ids(self, ids)

    @never_traced  # as TNModule.plan_bucket
    def plan_bucket(self, bucket: int) -> LookupPlan:  # type: ignore[override]
        plan = get_planner().plan_lookup(self.layout, int(bucket))
        self.plans[int(bucket)] = plan
        return plan

    def half_tables(self, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``L[M_L, N_L, r]`` from cores ``[:split]`` and ``R[M_R, r, N_R]`` from the rest:
        merged now in a differentiable or traced call, else kept (:meth:`kept_half_tables`)."""
        return lookup_way.half_tables_of(self, split)

    def kept_half_tables(self, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The half tables kept, not saved, until a core or gate may have changed
        (:func:`.derived.kept`): merging them is most of a small lookup."""
        # contiguous once here, not copied by every lookup's kernel
        return kept(self, "_halves", self.network_tensors(),
                    lambda: tuple(t.contiguous() for t in half_tables(self.scaled_cores(), split)), key=(split,))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return lookup_way.run(self, ids)

    def to_dense_module(self) -> nn.Embedding:
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx,
                           device=self.cores[0].device, dtype=self.cores[0].dtype)
        with torch.no_grad():
            emb.weight.copy_(self.weight())  # the padding row as stored, as a lookup returns it
        return emb

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return super().extra_repr() + pad
