"""``TTMEmbeddingBag``: ``nn.EmbeddingBag`` with its table stored as a TTM network.

A bag lookup is the TTM lookup of every id (:class:`~.ttm_embedding.TTMEmbedding`,
so repeated ids are gathered once and the same kernels run) followed by a
reduction of each bag's rows: a sum (``index_add``), a mean (the sum over the
bag's count) or a max (``scatter_reduce``). Bags are given as in
``nn.EmbeddingBag``: a 2-D ``input`` of fixed-size bags, or a 1-D ``input``
with ``offsets`` (``include_last_offset`` as there). The bag of each id is
found on the device (``searchsorted``), so nothing reads back to the host.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from ...formats.factorization import matched_variance, random_cores, ttm_from_embedding_weight
from ...formats.layout import TTMLayout
from ..ways.network import checks_on_host
from .tn_module import check_init as _check_init, resolve_layout as _resolve_layout
from .ttm_embedding import TTMEmbedding

__all__ = ["TTMEmbeddingBag", "BAG_MODES"]


def _check_offsets(offsets: Tensor, length: int) -> None:
    """nn.EmbeddingBag's checks of ``offsets`` on the CPU (it checks them there too; on a GPU,
    under ``torch.compile`` or CUDA-graph capture they are trusted, as its CUDA kernel does):
    the first is 0, they never decrease, and none is past the input's end."""
    if offsets.numel() == 0 or not checks_on_host(offsets):
        return
    if int(offsets[0]) != 0:
        raise ValueError(f"TTMEmbeddingBag: offsets[0] must be 0 (the first bag starts at the first id), "
                         f"got {int(offsets[0])}")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("TTMEmbeddingBag: offsets must not decrease (each is the start of a bag)")
    if int(offsets[-1]) > length:
        raise ValueError(f"TTMEmbeddingBag: offsets[-1] can not be greater than the input's length {length}, "
                         f"got {int(offsets[-1])}")

BAG_MODES = ("sum", "mean", "max")


class TTMEmbeddingBag(TTMEmbedding):
    """Bags of TTM lookups, reduced like ``nn.EmbeddingBag``.

    Parameters
    ----------
    layout : TTMLayout
    mode : {"sum", "mean", "max"}
    include_last_offset : bool
        ``offsets`` has one more entry, the end of the last bag.
    padding_idx : int, optional
        Ids equal to it are left out of their bag (and of a mean's count).

    Shapes
    ------
    ``input (B, N)``, or ``input (N,)`` with ``offsets (B,)`` / ``(B + 1,)``;
    ``per_sample_weights`` like ``input`` (``mode="sum"`` only) ->
    output ``(B, embedding_dim)``. An empty bag gives zeros.
    """

    def __init__(self, layout: TTMLayout, mode: str = "mean", include_last_offset: bool = False,
                 padding_idx: int | None = None, *, device=None, dtype=None):
        if mode not in BAG_MODES:
            raise ValueError(f"TTMEmbeddingBag: mode must be one of {BAG_MODES}, got {mode!r}")
        super().__init__(layout, padding_idx, device=device, dtype=dtype)
        self.mode, self.include_last_offset = mode, bool(include_last_offset)

    @classmethod
    def from_embedding_bag(cls, bag: nn.EmbeddingBag, rank: int | Sequence[int] | None = 16,
                           num_cores: int = 4, init: str = "svd", layout: TTMLayout | None = None,
                           generator: torch.Generator | None = None) -> "TTMEmbeddingBag":
        """Build from an ``nn.EmbeddingBag`` (TT-SVD of its table, or a fresh
        ``N(0, 1)``-variance init). ``max_norm`` is not supported
        (``ValueError``); a ``sparse=True`` bag is compressed with dense gradients on its
        cores (small), which SGD, Adagrad or Adam take and SparseAdam does not."""
        _check_init(init)
        if bag.max_norm is not None:
            raise ValueError("TTMEmbeddingBag does not support max_norm (it renormalizes rows in place); "
                             "leave this embedding bag dense")
        weight = bag.weight
        layout = _resolve_layout(layout, lambda: TTMLayout.for_shape(*weight.shape, num_cores), rank, weight.shape)
        mod = cls(layout, bag.mode, bag.include_last_offset, bag.padding_idx, device=weight.device,
                  dtype=weight.dtype)
        cores = ttm_from_embedding_weight(weight, layout) if init == "svd" else random_cores(layout, matched_variance(weight, 1.0), generator)
        mod.set_cores([c.to(weight.dtype) for c in cores])
        return mod

    def forward(self, input: Tensor, offsets: Tensor | None = None,  # noqa: A002 (nn.EmbeddingBag's name)
                per_sample_weights: Tensor | None = None) -> Tensor:
        ids, bag, bags, overflow = self._bags(input, offsets)
        out = self._reduce(input, ids, bag, bags + overflow, per_sample_weights)
        return out[:bags] if overflow else out

    def _reduce(self, input: Tensor, ids: Tensor, bag: Tensor, bags: int,  # noqa: A002
                per_sample_weights: Tensor | None) -> Tensor:
        """Each bag's rows reduced: ``(bags, embedding_dim)``."""
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError(f"TTMEmbeddingBag: per_sample_weights needs mode='sum', this bag is "
                                 f"mode={self.mode!r} (as in nn.EmbeddingBag)")
            if per_sample_weights.shape != input.shape:
                raise ValueError(f"TTMEmbeddingBag: per_sample_weights must have input's shape "
                                 f"{tuple(input.shape)}, got {tuple(per_sample_weights.shape)}")
        rows = super().forward(ids)  # (N, D)
        keep = None if self.padding_idx is None else (ids != self.padding_idx)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.reshape(-1, 1).to(rows.dtype)
        if self.mode == "max":
            if keep is not None:
                rows = rows.masked_fill(~keep.unsqueeze(-1), float("-inf"))
            index = bag.unsqueeze(-1).expand_as(rows)
            out = rows.new_zeros(bags, self.embedding_dim).scatter_reduce(0, index, rows, "amax",
                                                                          include_self=False)
            return torch.where(torch.isinf(out) & (out < 0), torch.zeros_like(out), out)
        if keep is not None:
            rows = rows * keep.unsqueeze(-1).to(rows.dtype)
        out = rows.new_zeros(bags, self.embedding_dim).index_add(0, bag, rows)
        if self.mode == "mean":
            counted = keep.to(rows.dtype) if keep is not None else rows.new_ones(ids.shape[0])
            count = rows.new_zeros(bags).index_add(0, bag, counted)
            out = out / count.clamp_min(1).unsqueeze(-1)
        return out

    def _bags(self, input: Tensor, offsets: Tensor | None) -> tuple[Tensor, Tensor, int, int]:  # noqa: A002
        """``(ids (N,), bag of each id (N,), number of bags, overflow)``: with
        ``overflow == 1`` ids are in bag ``bags``, to be dropped (no offsets: no bags).
        With ``include_last_offset``, ids at or past the last offset belong to the last
        bag, as in ``nn.EmbeddingBag`` (checked against it in the tests)."""
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("TTMEmbeddingBag: offsets must be None for a 2-D input (each row is a bag)")
            bags, size = input.shape
            bag = torch.arange(bags, device=input.device).repeat_interleave(size)
            return input.reshape(-1), bag, bags, 0
        if input.dim() != 1:
            raise ValueError(f"TTMEmbeddingBag: input must be 1-D (with offsets) or 2-D, got shape "
                             f"{tuple(input.shape)}")
        if offsets is None or offsets.dim() != 1:
            raise ValueError("TTMEmbeddingBag: a 1-D input needs 1-D offsets (the start of each bag)")
        if offsets.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"TTMEmbeddingBag: offsets must be int64 or int32 (as in nn.EmbeddingBag), got "
                            f"{offsets.dtype}")
        if self.include_last_offset and offsets.shape[0] < 1:
            raise ValueError("TTMEmbeddingBag: with include_last_offset=True, offsets needs at least one entry "
                             "(the end of the last bag)")
        _check_offsets(offsets, input.shape[0])
        starts = offsets[:-1] if self.include_last_offset else offsets
        positions = torch.arange(input.shape[0], device=input.device, dtype=starts.dtype)
        bag = torch.searchsorted(starts.contiguous(), positions, right=True) - 1
        bags = starts.shape[0]
        if bags == 0:  # no bags: every id is dropped (nn.EmbeddingBag returns an empty result)
            return input, torch.zeros_like(positions), 0, 1
        return input, bag.clamp_min(0), bags, 0

    def to_dense_module(self) -> nn.EmbeddingBag:
        bag = nn.EmbeddingBag(self.num_embeddings, self.embedding_dim, mode=self.mode,
                              include_last_offset=self.include_last_offset, padding_idx=self.padding_idx,
                              device=self.cores[0].device, dtype=self.cores[0].dtype)
        with torch.no_grad():
            bag.weight.copy_(self.weight())
        return bag

    def extra_repr(self) -> str:
        last = ", include_last_offset=True" if self.include_last_offset else ""
        return super().extra_repr() + f", mode={self.mode!r}{last}"
