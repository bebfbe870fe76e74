"""tncompile: compile PyTorch models into rank-adaptive tensor-train networks.

Layers (imports go one way, downward; ``tests/test_architecture.py`` checks it):
``tncompile.train`` > the compiler (``api``, ``passes``, ``frontend``, ``ir``,
``planning``) > ``tncompile.runtime`` > ``formats`` / ``tuning`` / ``errors``.
See ARCHITECTURE.md.
"""
from . import calibration, distributed, formats, ir, passes, planning, runtime, train, tuning
from .api import compile
from .result.compiled import CompiledModel
from .errors import (BelowTargetWarning, CalibrationWarning, ModelFileError, ModelMismatchError, PassError, SlowerThanDenseWarning, TNCompileError,
                     TraceError)
from .passes import FunctionPass, Pass, Pipeline, default_pipeline, register_pass
from .result.report import Report
from .result.materialize import materialize
from .serialization import load, save
from .serialization import resume
from .train import (Distill, History, RankController, RankEvent, TrainStep, dry_run, fit, freeze_gates, graph_calls,
                    param_groups, ungraph_calls)
from .integrations.pretrained import compress_pretrained
from .integrations import hf_folder  # save_pretrained folders: the writer and load's reader
from .integrations import plugins  # transformers' from_pretrained of compressed folders, PEFT adapters

__version__ = "0.1.0"

__all__ = ["compile", "materialize", "save", "load", "resume", "fit", "History", "Distill", "freeze_gates", "compress_pretrained", "Pass", "FunctionPass", "Pipeline", "register_pass",
           "default_pipeline", "RankController", "RankEvent", "param_groups", "TrainStep", "graph_calls", "ungraph_calls", "dry_run", "CompiledModel", "Report",
           "TNCompileError", "TraceError", "PassError", "ModelFileError", "ModelMismatchError", "SlowerThanDenseWarning", "BelowTargetWarning", "CalibrationWarning", "calibration", "distributed", "formats", "ir", "passes", "planning", "runtime", "train",
           "tuning", "__version__"]
