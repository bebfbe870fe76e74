"""Runtime: trainable TT / TTM layers."""
from .pending import PendingLayer
from .tt_layers import TNModule, TTLinear, TTMEmbedding, TTMTiedLinear

__all__ = ["TTLinear", "TTMEmbedding", "TTMTiedLinear", "TNModule", "PendingLayer"]
