"""Issues 54 and 68: a compile's transient inputs (calibration statistics, a load's decisions,
its dump directory) travel in a ``CompileContext`` that ``Pipeline.run`` hands to each pass
(``run(program, ctx)``, as torch.fx's and tinygrad's rewrites get their context). No program
holds it, so nothing large outlives the compile. Passes written ``run(program)`` -- the form
DESIGN.md gives users -- keep working, without it."""
from __future__ import annotations

import warnings

import pytest
import torch

import tncompile
from tncompile.ir import CompileContext
from tncompile.passes import FunctionPass, Pass, Pipeline
from tncompile.passes.infra.base import takes_context
from tncompile.testing import mlp


class _Peek(Pass):
    name = "peek"

    def __init__(self, fail: bool = False):
        super().__init__()
        self.seen, self.fail = [], fail

    def run(self, program, ctx):
        self.seen.append(ctx)
        if self.fail:
            raise RuntimeError("boom")
        return program


class _OneArgument(Pass):
    name = "one-argument"

    def __init__(self):
        super().__init__()
        self.calls = 0

    def run(self, program):
        self.calls += 1
        return program


def _compiled():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tncompile.compile(mlp((64, 128, 64, 8)), target_ratio=0.5)


def test_each_pass_that_takes_it_gets_the_context_and_the_program_never_holds_it():
    program = _compiled().program
    peek, plain = _Peek(), _OneArgument()
    context = CompileContext(calibration="stats")
    Pipeline([peek, plain, _Peek()]).run(program, progress=False, context=context)
    assert peek.seen == [context] and plain.calls == 1
    assert not hasattr(program, "context")


def test_without_a_context_passes_get_an_empty_one():
    peek = _Peek()
    Pipeline([peek]).run(_compiled().program, progress=False)
    assert peek.seen == [CompileContext()]


def test_pass_functions_take_the_context_when_they_have_a_second_parameter():
    seen = []
    program = _compiled().program
    context = CompileContext(decisions="d")
    Pipeline([FunctionPass(lambda p, ctx: seen.append(ctx), "with"),
              FunctionPass(lambda p: seen.append("plain"), "without"),
              FunctionPass(lambda p, verbose=False: seen.append(verbose), "optional")]).run(
        program, progress=False, context=context)
    assert seen == [context, "plain", False]   # an optional second parameter is not the context


def test_takes_context_reads_the_signature():
    class Both(Pass):
        def run(self, program, ctx):
            return program

    class Varargs(Pass):
        def run(self, *args):
            return args[0]
    assert takes_context(Both().run) and takes_context(Varargs().run)
    assert not takes_context(_OneArgument().run) and not takes_context(len)


def test_a_raising_pass_names_itself_and_leaves_nothing_on_the_program():
    program = _compiled().program
    with pytest.raises(Exception, match="boom"):
        Pipeline([_Peek(fail=True)]).run(program, progress=False, context=CompileContext(decisions="d"))
    assert not hasattr(program, "context")


def test_a_calibrated_compile_keeps_no_statistics():
    torch.manual_seed(0)
    batches = [torch.randn(16, 64) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(mlp((64, 128, 64, 8)), target_ratio=0.5, calibration=batches)
    assert not hasattr(compiled.program, "context") and compiled.program.calibration_summary
    held = [v for v in vars(compiled.program).values() if type(v).__name__ == "CalibrationStats"]
    assert not held


def test_swap_modes_binding_lives_on_the_swapped_model_not_the_program():
    """Issue 68 item 4: the swap-only state left ``Program``. Which layers a swap-mode compile
    may compress is a compile input (the context); which paths the model swaps is the
    swapped model's own, and its dense copy drops it."""
    from tncompile.swap.kinds import SWAPPED_PATHS, swapped_paths
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = tncompile.compile(mlp((64, 128, 64, 8)), target_ratio=0.5, mode="swap",
                                    example_inputs=(torch.randn(4, 64),))
    assert not any(hasattr(swapped.program, name) for name in ("swap_layers", "swap_skipped", "context"))
    paths = swapped_paths(swapped)
    assert set(swapped.tensorized_modules()) <= set(paths) and set(paths.values()) == {"linear"}
    dense = swapped.to_dense()
    assert SWAPPED_PATHS not in dense.__dict__ and SWAPPED_PATHS in swapped.__dict__
