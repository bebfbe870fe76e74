"""tncompile: compile PyTorch models into rank-adaptive tensor-train networks."""
from . import formats, ir, passes, runtime
from .api import compile
from .compiled import CompiledModel
from .errors import PassError, TNCompileError, TraceError
from .passes import FunctionPass, Pass, Pipeline, default_pipeline, register_pass
from .report import Report
from .runtime.rank_control import RankController, RankEvent, param_groups
from .serialization import load, resume, save
from .history import History
from .training import fit

__version__ = "0.1.0"

__all__ = ["compile", "save", "load", "resume", "fit", "History", "Pass", "FunctionPass", "Pipeline", "register_pass",
           "default_pipeline", "RankController", "RankEvent", "param_groups", "CompiledModel", "Report", "TNCompileError", "TraceError",
           "PassError", "formats", "ir", "passes", "runtime", "__version__"]
