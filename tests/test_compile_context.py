"""Issue 54: a compile's transient inputs (calibration statistics, a load's decisions) travel
in a ``CompileContext`` given to ``Pipeline.run``: passes read ``program.context`` while it
runs; no program keeps it after, also when a pass raises."""
from __future__ import annotations

import warnings

import pytest
import torch

import tncompile
from tncompile.ir import CompileContext
from tncompile.passes import Pass, Pipeline
from tncompile.testing import mlp


class _Peek(Pass):
    name = "peek"

    def __init__(self, fail: bool = False):
        super().__init__()
        self.seen, self.fail = [], fail

    def run(self, program):
        self.seen.append(program.context)
        if self.fail:
            raise RuntimeError("boom")
        return program


def _compiled():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tncompile.compile(mlp((64, 128, 64, 8)), target_ratio=0.5)


def test_passes_see_the_context_while_the_pipeline_runs_and_it_is_gone_after():
    compiled = _compiled()
    program = compiled.program
    assert program.context == CompileContext()
    peek = _Peek()
    context = CompileContext(calibration="stats")
    Pipeline([peek]).run(program, progress=False, context=context)
    assert peek.seen == [context] and program.context == CompileContext()


def test_the_context_is_gone_when_a_pass_raises():
    program = _compiled().program
    with pytest.raises(Exception, match="boom"):
        Pipeline([_Peek(fail=True)]).run(program, progress=False, context=CompileContext(decisions="d"))
    assert program.context == CompileContext()


def test_a_calibrated_compile_keeps_no_statistics():
    torch.manual_seed(0)
    batches = [torch.randn(16, 64) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(mlp((64, 128, 64, 8)), target_ratio=0.5, calibration=batches)
    assert compiled.program.context == CompileContext() and compiled.program.calibration_summary
