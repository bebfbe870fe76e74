"""Runtime: trainable TT / TTM layers, the planned executor and the native kernels.

It knows nothing of the compiler or of training (it imports neither
``tncompile.ir`` / ``passes`` / ``planning`` nor ``tncompile.train``): layers
run the plans they carry and ask the registered planner (:mod:`.kernels.plans`) for
buckets nobody planned yet. The optional Triton backend (:mod:`.triton`) is not imported
with it: a loader (:mod:`.optional_backends`) imports it the first time ``tuning.TRITON_KERNELS`` is
on or a call runs on a GPU (its thin pair is a measured candidate there), or when the user
imports ``tncompile.runtime.triton``.
"""
from .layers.collapsed import CollapsedLayer
from .kernels.plans import ContractionPlan, LookupPlan, Step, bucket_of
from .layers.embedding_bag import TTMEmbeddingBag
from .layers import TNModule, TTLinear, TTMEmbedding, TTMTiedLinear, tied_merge_macs
from . import optional_backends  # noqa: F401 - registers the loaders

__all__ = ["TTLinear", "TTMEmbedding", "TTMEmbeddingBag", "TTMTiedLinear", "tied_merge_macs", "TNModule", "CollapsedLayer",
           "ContractionPlan", "LookupPlan", "Step", "bucket_of"]
