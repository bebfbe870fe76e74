"""The trainable modules: TT linears, TTM embeddings and tied heads, collapsed layers,
experts, and the state derived from their parameters (merged factors, batched merges)."""
from .collapsed import CollapsedLayer
from .embedding_bag import TTMEmbeddingBag
from .tn_module import TNModule
from .tt_linear import TTLinear
from .ttm_embedding import TTMEmbedding
from .tied_linear import TTMTiedLinear, owning_layers, tied_merge_macs

__all__ = ["TNModule", "TTLinear", "TTMEmbedding", "TTMEmbeddingBag", "TTMTiedLinear", "CollapsedLayer",
           "tied_merge_macs", "owning_layers"]
