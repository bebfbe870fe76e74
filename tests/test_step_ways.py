"""TrainStep(compile=...): the compiled step chosen by measurement, per input signature."""
import pytest
import torch
import torch.nn.functional as F

import tncompile
from tncompile import tuning
from tncompile.testing import mlp
from tncompile.train import TrainStep
from tncompile.train.step_ways import StepWays


def test_ways_measure_plain_then_compiled_and_keep_the_faster():
    ways = StepWays("auto", settle_steps=2)
    seen = []
    for _ in range(12):
        way = ways.way("a")
        timed = ways.timed("a", way)
        seen.append((way, timed))
        ways.ran("a", way, (0.010 if way == "plain" else 0.004) if timed else None)
    n = tuning.STEP_MEASURE_STEPS
    assert seen[:2 + n] == [("plain", False)] * 2 + [("plain", True)] * n
    assert seen[2 + n:4 + 2 * n] == [("compiled", False)] * 2 + [("compiled", True)] * n
    assert all(s == ("compiled", False) for s in seen[4 + 2 * n:])
    assert ways.rows()["'a'"] == {"chosen": "compiled", "plain_ms": 10.0, "compiled_ms": 4.0}
    # another signature measures on its own; a slower compiled way loses
    for _ in range(4 + 2 * n):
        way = ways.way("b")
        ways.ran("b", way, (0.003 if way == "plain" else 0.004) if ways.timed("b", way) else None)
    assert ways.way("b") == "plain" and ways.way("a") == "compiled"
    assert StepWays(True, 2).way("x") == "compiled" and StepWays(False, 2).way("x") == "plain"
    assert not StepWays(True, 2).timed("x", "compiled")
    with pytest.raises(ValueError, match="compile must be False, True or 'auto'"):
        StepWays("fast", 2)


def _setup(seed=0):
    torch.manual_seed(seed)
    compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.5, init="random", prefer="size")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    return compiled, opt


def _data(steps=12):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(steps)]


class _Clock:
    """A clock each forward of a way moves on by that way's cost."""

    def __init__(self):
        self.now = 0.0

    def costing(self, forward, seconds: float, calls: list):
        def run(*args, **kwargs):
            self.now += seconds
            calls.append(1)
            return forward(*args, **kwargs)
        return run


@pytest.mark.parametrize("compiled_s, expected", [(0.001, "compiled"), (0.050, "plain")])
def test_train_step_keeps_the_way_measured_faster(compiled_s, expected):
    """compile="auto": both ways train (each step a real one), the faster is kept; the
    compiled way is real torch.compile, its steps equal eager's."""
    data = _data()
    model, opt = _setup()
    reference = TrainStep(model, opt, F.cross_entropy)
    want = torch.stack([reference(x, y) for x, y in data])

    model, opt = _setup()
    step = TrainStep(model, opt, F.cross_entropy, compile="auto")
    clock, calls = _Clock(), {"plain": [], "compiled": []}
    step._clock = lambda: clock.now
    step._forwards = {"plain": clock.costing(model, 0.010, calls["plain"]),
                      "compiled": clock.costing(torch.compile(model), compiled_s, calls["compiled"])}
    got = torch.stack([step(x, y) for x, y in data])
    n = tuning.STEP_MEASURE_STEPS
    measured = 2 * (2 + n)
    assert len(calls["plain"]) == 2 + n + (len(data) - measured if expected == "plain" else 0)
    assert len(calls["compiled"]) == 2 + n + (len(data) - measured if expected == "compiled" else 0)
    (row,) = step.stats()["ways"].values()
    assert row == {"chosen": expected, "plain_ms": 10.0, "compiled_ms": 1e3 * compiled_s}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert "compile='auto'" in repr(step)


def test_a_compiled_way_that_fails_falls_back_to_plain_with_a_warning():
    data = _data(8)
    model, opt = _setup()
    want = torch.stack([TrainStep(model, opt, F.cross_entropy)(x, y) for x, y in data])

    def broken(*args, **kwargs):
        raise RuntimeError("inductor could not lower this op")
    model, opt = _setup()
    step = TrainStep(model, opt, F.cross_entropy, compile="auto")
    step._forwards["compiled"] = broken
    with pytest.warns(UserWarning, match="failed on inputs .* inductor could not lower this op"):
        got = torch.stack([step(x, y) for x, y in data])
    torch.testing.assert_close(got, want)   # the failed step was run again, plainly: nothing lost
    (row,) = step.stats()["ways"].values()
    assert row["chosen"] == "plain" and "inductor could not lower" in row["compile_failed"]

    model, opt = _setup()
    fixed = TrainStep(model, opt, F.cross_entropy, compile=True)
    fixed._forwards["compiled"] = fixed._forward = broken
    with pytest.raises(RuntimeError, match="could not lower"):   # compile=True: no measuring, no fallback
        fixed(*data[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_step_captured_on_cuda_matches_eager():
    data = [(x.cuda(), y.cuda()) for x, y in _data(10)]
    losses = {}
    for compile_mode in (False, True, "auto"):
        model, _ = _setup()
        model = model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = TrainStep(model, opt, F.cross_entropy, cuda_graph=True, compile=compile_mode)
        losses[compile_mode] = torch.stack([step(x, y) for x, y in data])
        assert step.stats()["replays"] > 0
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(losses["auto"], losses[False], rtol=1e-3, atol=1e-4)
