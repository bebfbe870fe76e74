"""``TTMTiedLinear``: an output head tied to a :class:`~.ttm_embedding.TTMEmbedding`.

The head shares the embedding's cores and gates and keeps its merged forms; how a call
runs is :mod:`..ways.tied_head`'s.
"""
from __future__ import annotations

import torch
from torch import nn

from ...formats.layout import TTMLayout
from ..ways import tied_head as tied_way
from ..ways.tied_head import head_halves, tied_merge_macs
from .derived import kept
from .tn_module import TNModule
from .ttm_embedding import TTMEmbedding

__all__ = ["TTMTiedLinear", "tied_merge_macs", "owning_layers"]


class TTMTiedLinear(TNModule):
    """Output head tied to a :class:`TTMEmbedding`: ``y = x @ E.T + b``.

    The cores and gates *are* the embedding's (one set of parameters serves
    both, as ``lm_head.weight is wte.weight`` in the dense model); only the
    bias, if any, is the head's own.

    Shapes
    ------
    input ``(..., embedding_dim)`` -> output ``(..., num_embeddings)``.
    """

    transposed = True
    transient_state = TNModule.transient_state + ("_merged", "_halves")
    # inference (no autograd): the table merged once, or over a few rows two half tables (.tied_head),
    # kept until a core or gate may have changed (derived.kept)
    merge_in_inference = True

    def __init__(self, embedding: TTMEmbedding, bias: bool = False):
        super().__init__()
        self.embedding = embedding
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings
        self.bias = nn.Parameter(torch.zeros(self.out_features, device=embedding.cores[0].device,
                                             dtype=embedding.cores[0].dtype)) if bias else None

    @property
    def layout(self) -> TTMLayout:  # type: ignore[override]
        return self.embedding.layout

    @property
    def cores(self) -> nn.ParameterList:  # type: ignore[override]
        return self.embedding.cores

    @property
    def gates(self) -> nn.ParameterList:  # type: ignore[override]
        return self.embedding.gates

    def compressed_params(self) -> int:
        return 0  # shared with the embedding

    def reset_parameters(self, variance: float | None = None) -> None:
        """The bias back to zero; the cores are the embedding's (its own reset draws them)."""
        if self.bias is not None:
            with torch.no_grad():
                nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tied_way.run(self, x)

    def kept_head_halves(self, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The half tables split before core ``split``, laid out for the head's two GEMMs
        (:func:`..ways.tied_head.head_halves`), kept (not saved) until a core or gate may
        have changed (:func:`.derived.kept`)."""
        return kept(self, "_halves", self.embedding.network_tensors(),
                    lambda: head_halves(self.embedding.scaled_cores(), split), key=(split,))

    def to_dense_head(self, embedding: nn.Embedding | None = None) -> nn.Linear:
        """An ``nn.Linear`` whose weight *is* ``embedding``'s (the dense table this head's
        embedding was rebuilt as; rebuilt here when not given), with this head's bias."""
        emb = embedding if embedding is not None else self.embedding.to_dense_module()
        head = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                         device=emb.weight.device, dtype=emb.weight.dtype)
        head.weight = emb.weight
        if self.bias is not None:
            with torch.no_grad():
                head.bias.copy_(self.bias)
        return head

    def merges_at(self, rows: int) -> bool:
        """Whether ``rows`` rows cost fewer multiply-adds through the table merged from the
        cores (once per call, differentiably: ``V·D·r`` to merge, then a dense head's
        ``rows·V·D``) than through the network contracted per row (its plan's count). A tied
        head's output is vocabulary-sized, so past a few rows the merged table wins (GPT-2:
        the network costs ~11x a dense head per row)."""
        return tied_merge_macs(self.layout, rows) < self.plan_for(rows).fwd_flops

    def merged_weight_t(self) -> torch.Tensor:
        """The table transposed, ``[embedding_dim, out_features]`` and contiguous, merged from
        the cores and kept (not saved) until a core or gate may have changed
        (:func:`.derived.kept`). A tied head over vocabulary-sized outputs costs a dense head's multiply-adds
        this way (contracting the network for every row, as decoding feeds it, costs many
        times more); stored this way round, ``x @ table_t`` reads it in order, which at a
        few rows runs ~1.2x (1 row) to ~1.8x (8 rows) faster than ``F.linear`` on the
        ``[vocab, dim]`` table (50257 x 768, CPU)."""
        return kept(self, "_merged", self.embedding.network_tensors(),
                    lambda: self.embedding.weight()[: self.out_features].t().contiguous())

    def extra_repr(self) -> str:
        return f"tied to embedding {self.layout.describe()}, bias={self.bias is not None}"


def owning_layers(layers: dict[str, TNModule]) -> dict[str, TNModule]:
    """``name -> layer`` of ``layers`` (``compiled.tensorized_modules()``) keeping each layer
    that owns its cores once: tied heads (whose cores are their embedding's) and a layer met
    again under a second name are left out."""
    out: dict[str, TNModule] = {}
    seen: set[int] = set()
    for name, mod in layers.items():
        if isinstance(mod, TTMTiedLinear) or id(mod) in seen:
            continue
        seen.add(id(mod))
        out[name] = mod
    return out
