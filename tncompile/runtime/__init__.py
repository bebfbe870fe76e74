"""Runtime: trainable TT / TTM layers, the planned executor and rank control."""
from .pending import PendingLayer
from .rank_control import RankController, RankEvent, param_groups
from .train_step import TrainStep
from .truncation import CollapsedLayer
from .tt_layers import TNModule, TTLinear, TTMEmbedding, TTMTiedLinear

__all__ = ["TTLinear", "TTMEmbedding", "TTMTiedLinear", "TNModule", "PendingLayer", "RankController",
           "RankEvent", "param_groups", "CollapsedLayer", "TrainStep"]
