"""Training: rank control (CoMERA), truncation, ``TrainStep`` and its capture
cache, ``fit`` and its ``History``.

It may use the compiler and the runtime; it changes a compiled model's graph
only by running passes (``collapse_layers``, ``replan``) through a pipeline.
"""
from .capture_cache import CacheStats, CaptureCache
from .controller import RankController, RankEvent, param_groups
from .distill import Distill
from .gates import freeze_gates
from .dry_run import CaptureError, DryRunReport, Hazard, dry_run
from .fit import FitSettings, fit
from .graphed_calls import graph_calls, ungraph_calls
from .history import History
from .train_step import TrainStep, call_model, make_capturable
from .truncation import Cut, cut_ranks, remap_optimizer

__all__ = ["Distill", "freeze_gates", "dry_run", "DryRunReport", "Hazard", "CaptureError", "RankController", "RankEvent", "param_groups", "TrainStep", "fit", "FitSettings", "History", "CaptureCache",
           "CacheStats", "Cut", "cut_ranks", "remap_optimizer", "call_model", "make_capturable",
           "graph_calls", "ungraph_calls"]
