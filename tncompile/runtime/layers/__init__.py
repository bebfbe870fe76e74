"""The trainable modules: TT linears, TTM embeddings and tied heads, collapsed layers,
experts, and the state derived from their parameters (merged factors, batched merges)."""
from .collapsed import CollapsedLayer
from .embedding_bag import TTMEmbeddingBag
from .tt_layers import TNModule, TTLinear, TTMEmbedding, TTMTiedLinear, tied_merge_macs

__all__ = ["TNModule", "TTLinear", "TTMEmbedding", "TTMEmbeddingBag", "TTMTiedLinear", "CollapsedLayer",
           "tied_merge_macs"]
