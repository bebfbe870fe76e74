"""Runtime: trainable TT / TTM layers, the planned executor and the native kernels.

It knows nothing of the compiler or of training (it imports neither
``tncompile.ir`` / ``passes`` / ``planning`` nor ``tncompile.train``): layers
run the plans they carry and ask the registered planner (:mod:`.kernels.plans`) for
buckets nobody planned yet. Importing it registers the optional Triton backend with the
ops' ways (:mod:`.triton.backend`; all on under ``tuning.TRITON_KERNELS = True``; by default
its thin pair is a measured candidate on a GPU).
"""
from .layers.collapsed import CollapsedLayer
from .kernels.plans import ContractionPlan, LookupPlan, Step, bucket_of
from .layers.embedding_bag import TTMEmbeddingBag
from .layers import TNModule, TTLinear, TTMEmbedding, TTMTiedLinear, tied_merge_macs
from .triton.backend import TRITON

__all__ = ["TTLinear", "TTMEmbedding", "TTMEmbeddingBag", "TTMTiedLinear", "tied_merge_macs", "TNModule", "CollapsedLayer",
           "ContractionPlan", "LookupPlan", "Step", "bucket_of", "TRITON"]
