"""Issue 54: among a TT linear's row ways that all apply, the one measured fastest on this
device runs -- timed once per shape, bucket of rows, dtype and device, then kept in memory
and, where ``tuning.WAY_CACHE_DIR`` is set, on disk; a hostile cache file is refused."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import tncompile
from tncompile import tuning
from tncompile.runtime import TTLinear
from tncompile.runtime.ways import linear as linear_ways, measured
from tncompile.runtime.ways.linear import LinearWay, choose
from tncompile.testing import mlp


@pytest.fixture(autouse=True)
def fresh_winners():
    measured.forget()
    yield
    measured.forget()


def _layer(seed=0):
    torch.manual_seed(seed)
    return TTLinear.from_linear(nn.Linear(96, 192), rank=6)


def _timed_as(monkeypatch, seconds: dict[str, float]) -> None:
    """Each candidate way's timing as given (the fastest named wins)."""
    monkeypatch.setattr(linear_ways, "_timer", lambda *args: seconds.__getitem__)


@pytest.mark.parametrize("fastest", [LinearWay.PLANNED, LinearWay.THIN_PAIR, LinearWay.WHOLE_MATRIX])
def test_the_fastest_measured_way_runs_and_is_what_choose_says(fastest, monkeypatch):
    layer = _layer()
    x = torch.randn(64, 96)
    seconds = {w.value: (0.001 if w is fastest else 0.01) for w in LinearWay}
    _timed_as(monkeypatch, seconds)
    assert choose(layer, x) is fastest
    y = layer(x)
    assert layer.ran_as is fastest
    torch.testing.assert_close(y, nn.functional.linear(x, layer.weight(), layer.bias), rtol=1e-4, atol=1e-5)


def test_whole_matrices_switched_off_are_never_measured_nor_run(monkeypatch):
    """``tuning.WHOLE_MATRICES = False`` holds against measurement: a whole matrix measured
    fastest before the switch does not run after it (an H200 run found it running anyway:
    the switch did not reach the measured choice), and switching back finds it again."""
    layer = _layer()
    x = torch.randn(64, 96)
    timed = []

    def timer(*args):
        return lambda way: timed.append(way) or {"whole matrix": 0.001}.get(way, 0.01)
    monkeypatch.setattr(linear_ways, "_timer", timer)
    layer(x)
    assert layer.ran_as is LinearWay.WHOLE_MATRIX
    with tuning.override(WHOLE_MATRICES=False):
        timed.clear()
        assert choose(layer, x) is not LinearWay.WHOLE_MATRIX
        y = layer(x)
        assert layer.ran_as is not LinearWay.WHOLE_MATRIX and "whole matrix" not in timed and timed
    torch.testing.assert_close(y, nn.functional.linear(x, layer.weight(), layer.bias), rtol=1e-4, atol=1e-5)
    layer(x)
    assert layer.ran_as is LinearWay.WHOLE_MATRIX


def test_a_shape_is_measured_once_and_a_second_compile_measures_nothing():
    x = torch.randn(200, 32)

    def step(model):
        model(x).square().mean().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = tncompile.compile(mlp((32, 64, 64, 8)), target_ratio=0.5)
        step(first)
        shapes = measured.stats()["measured"]
        assert shapes >= 1
        step(first)
        assert measured.stats()["measured"] == shapes          # the same calls: nothing new to time
        second = tncompile.compile(mlp((32, 64, 64, 8)), target_ratio=0.5)
        step(second)
    assert measured.stats()["measured"] == shapes              # the same shapes: known
    ran = {m.ran_as for m in second.modules() if isinstance(m, TTLinear)}
    assert ran <= {LinearWay.PLANNED, LinearWay.THIN_PAIR, LinearWay.WHOLE_MATRIX, LinearWay.NATIVE_CHAIN}


def test_measuring_leaves_no_gradient_and_no_side_effect():
    layer = _layer()
    x = torch.randn(64, 96, requires_grad=True)
    y = layer(x)
    assert measured.stats()["measured"] == 1
    assert all(p.grad is None for p in layer.parameters()) and x.grad is None
    y.sum().backward()
    reference = _layer()
    x2 = x.detach().clone().requires_grad_()
    nn.functional.linear(x2, reference.weight(), reference.bias).sum().backward()
    for p, q in zip(layer.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("context", ["no-grad", "deterministic", "switched off", "compiled"])
def test_nothing_is_measured_where_the_choice_must_not_depend_on_timing(context):
    layer = _layer()
    layer.merge_in_inference = False
    x = torch.randn(64, 96)
    if context == "no-grad":
        with torch.no_grad():
            layer(x)
    elif context == "deterministic":
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            layer(x)
        finally:
            torch.use_deterministic_algorithms(before)
    elif context == "switched off":
        with tuning.override(MEASURE_WAYS=False):
            layer(x)
    else:
        torch._dynamo.reset()
        torch.compile(layer, backend="eager", fullgraph=True)(x)
    assert measured.stats()["measured"] == 0


def test_the_disk_cache_serves_a_later_process(tmp_path):
    with tuning.override(WAY_CACHE_DIR=str(tmp_path)):
        layer = _layer()
        layer(torch.randn(64, 96))
        way = layer.ran_as
        assert measured.stats()["measured"] == 1
        files = list(tmp_path.glob("ways-*.json"))
        assert len(files) == 1 and torch.__version__.replace("/", "_") in files[0].name
        saved = json.loads(files[0].read_text())
        assert way.value in saved["winners"].values()
        measured.forget()                                   # a new process: memory empty
        again = _layer(1)
        again(torch.randn(64, 96))
        assert measured.stats() == {"measured": 0, "hits": 1, "seconds": 0.0} and again.ran_as is way


@pytest.mark.parametrize("content", [
    "not json",
    json.dumps({"format": 1, "winners": {"k": "__import__('os').system('x')"}}),
    json.dumps({"format": 1, "winners": {"k" * 600: "thin pair"}}),
    json.dumps({"format": 2, "winners": {}}),
    json.dumps([1, 2, 3]),
])
def test_a_hostile_cache_file_is_refused_whole(tmp_path, content):
    with tuning.override(WAY_CACHE_DIR=str(tmp_path)):
        path = measured.cache_file()
        path.write_text(content)
        with pytest.warns(UserWarning, match="ignoring the measured-ways cache"):
            _layer()(torch.randn(64, 96))
        assert measured.stats()["measured"] == 1            # measured afresh, nothing taken from the file


def test_an_oversized_cache_file_is_refused_before_it_is_read(tmp_path):
    with tuning.override(WAY_CACHE_DIR=str(tmp_path)):
        path = measured.cache_file()
        with open(path, "wb") as f:
            f.truncate(measured.MAX_FILE_BYTES + 1)
        with pytest.warns(UserWarning, match="larger than"):
            _layer()(torch.randn(64, 96))


def test_a_checkpoint_carries_the_winners_and_resume_takes_them(tmp_path, monkeypatch):
    """A resumed run continues bit for bit: it takes the ways the saved run took, measured
    on another process or machine, over any of its own; ``restore_rng=False`` keeps its own."""
    x = torch.randn(200, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(mlp((32, 64, 64, 8)), target_ratio=0.5)
        compiled(x).sum().backward()
        layers = [m for m in compiled.modules() if isinstance(m, TTLinear)]
        taken = {id(m): m.ran_as for m in layers}
        saved = measured.snapshot()
        assert saved
        opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
        tncompile.save(compiled, tmp_path / "ckpt.tnc", optimizer=opt)
        # a new process whose own timing would choose otherwise
        measured.forget()
        other = {k: (LinearWay.PLANNED.value if v != LinearWay.PLANNED.value else LinearWay.THIN_PAIR.value)
                 for k, v in saved.items()}
        measured.install(other)
        loaded = tncompile.load(tmp_path / "ckpt.tnc", model=mlp((32, 64, 64, 8)))
        opt2 = torch.optim.SGD(loaded.parameters(), lr=0.1)
        tncompile.resume(loaded, opt2)
        loaded(x).sum().backward()
    assert measured.snapshot() == saved and measured.stats()["measured"] == 0
    again = [m for m in loaded.modules() if isinstance(m, TTLinear)]
    assert [m.ran_as for m in again] == [taken[id(m)] for m in layers]


def test_a_checkpoint_naming_an_unknown_way_is_refused(tmp_path):
    from tncompile.errors import ModelFileError
    from tncompile.serialization.checkpoint import check_training_state
    state = {"extra": None, "optimizer": None, "controller": None, "rng": None, "ways": {"k": "rm -rf"}}
    with pytest.raises(ModelFileError, match="measured ways"):
        check_training_state(state, "ckpt")
    state["ways"] = None
    assert check_training_state(state, "ckpt") is state


def test_where_nothing_may_be_timed_the_prior_runs_and_the_key_is_built_once(monkeypatch):
    """Inside activation checkpointing nothing is timed (a recomputation must record the same
    ops); each call asks for a winner again, but builds the shape's key only once."""
    from torch.utils.checkpoint import checkpoint
    layer = _layer()
    built = []
    real = measured.key_of
    monkeypatch.setattr(measured, "key_of", lambda *args: built.append(1) or real(*args))
    x = torch.randn(64, 96, requires_grad=True)
    for _ in range(3):
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert measured.stats()["measured"] == 0 and len(built) == 1
    layer(x)                                                  # outside: timed now, once
    assert measured.stats()["measured"] == 1


def test_a_layer_with_measured_choices_deep_copies_and_pickles():
    import copy
    import pickle
    layer = _layer()
    layer(torch.randn(2, 96))          # a few rows: the native chain among the candidates
    layer(torch.randn(64, 96))
    with torch.enable_grad():
        copy.deepcopy(layer)
    pickle.loads(pickle.dumps(layer))


def test_a_backends_pair_is_one_more_candidate_and_runs_where_it_wins(monkeypatch):
    """Issue 55: a backend's thin pair (tncompile's Triton kernel on a GPU) is timed like
    the default ways where its switch is ``None`` and kept only where it is fastest; where
    it loses it never runs, and its switch ``False`` takes it out of the choice."""
    from tncompile.runtime.ways import backends
    calls = []

    def pair(x, a, b, bias, activation=None):
        calls.append(tuple(x.shape))
        y = (x @ a) @ b
        return y if bias is None else y + bias
    fake = backends.Backend("fake", lambda like: True, {"thin_pair": pair}, measured_on=("cpu",))
    monkeypatch.setitem(backends._BACKENDS, "fake", fake)
    layer, x = _layer(), torch.randn(64, 96)
    _timed_as(monkeypatch, {w.value: (0.001 if w is LinearWay.TRITON_PAIR else 0.01) for w in LinearWay})
    assert choose(layer, x) is LinearWay.TRITON_PAIR
    y = layer(x)
    assert calls and layer.ran_as is LinearWay.TRITON_PAIR
    torch.testing.assert_close(y, nn.functional.linear(x, layer.weight(), layer.bias), rtol=1e-4, atol=1e-5)
    measured.forget()
    calls.clear()
    _timed_as(monkeypatch, {w.value: (0.02 if w is LinearWay.TRITON_PAIR else 0.01) for w in LinearWay})
    layer(x)
    assert not calls and layer.ran_as is not LinearWay.TRITON_PAIR
    monkeypatch.setitem(backends.SWITCHES, "fake", "TRITON_KERNELS")
    with tuning.override(TRITON_KERNELS=False):
        assert backends.candidate(x, "thin_pair") is None


def test_the_triton_pair_is_never_a_candidate_off_a_gpu():
    """On the CPU (the interpreter included) the measured choice never times Triton."""
    from tncompile.runtime.triton import backend  # noqa: F401 - registers it
    from tncompile.runtime.ways import backends
    assert backends.get("triton") is not None and backends.get("triton").measured_on == ("cuda",)
    assert backends.candidate(torch.randn(4, 4), "thin_pair") is None


def _scripted(times: dict[str, list[float]]):
    """``time_way`` returning each way's scripted run times in turn, and the calls made."""
    calls: list[str] = []
    left = {way: list(ts) for way, ts in times.items()}

    def time_way(way: str) -> float:
        calls.append(way)
        return left[way].pop(0)
    return time_way, calls


def test_a_clear_winner_costs_two_runs_a_candidate_not_four():
    time_way, calls = _scripted({"a": [0.02, 0.010, 0.010, 0.010], "b": [0.05, 0.040, 0.04, 0.04],
                                 "c": [0.03, 0.025, 0.02, 0.02]})
    assert measured.race(time_way, ("a", "b", "c")) == "a"
    assert calls == ["a", "b", "c", "a", "b", "c"]          # warm-up, one round; b and c out, a alone left


def test_a_close_race_is_repeated_and_the_fastest_single_run_wins():
    time_way, calls = _scripted({"a": [0.02, 0.012, 0.0115, 0.0104], "b": [0.02, 0.010, 0.0110, 0.0090]})
    assert measured.race(time_way, ("a", "b")) == "b"       # 9.0 ms in round three
    assert calls.count("a") == calls.count("b") == 1 + tuning.MEASURE_REPEATS


def test_a_tie_ends_the_race():
    time_way, calls = _scripted({"a": [0.02, 0.0102, 0.01, 0.01], "b": [0.02, 0.0100, 0.01, 0.01]})
    assert measured.race(time_way, ("a", "b")) == "b" and calls == ["a", "b", "a", "b"]   # 2% apart: stop


def test_a_way_far_behind_at_warm_up_drops_out_and_a_long_one_is_timed_once():
    time_way, calls = _scripted({"fast": [0.01, 0.009, 0.009, 0.009], "hopeless": [0.5]})
    assert measured.race(time_way, ("fast", "hopeless")) == "fast" and calls.count("hopeless") == 1
    time_way, calls = _scripted({"long": [0.40], "longer": [0.45]})    # both over MEASURE_LONG_S
    assert measured.race(time_way, ("long", "longer")) == "long" and calls == ["long", "longer"]
    time_way, calls = _scripted({"short": [0.2, 0.30, 0.3, 0.3], "long": [0.28]})
    assert measured.race(time_way, ("short", "long")) == "long" and calls.count("long") == 1


def test_long_measuring_is_named_once_on_stderr(monkeypatch, caplog):
    layer = _layer()
    monkeypatch.setattr(linear_ways, "_timer", lambda *args: {w.value: 0.001 for w in LinearWay}.__getitem__)
    with tuning.override(MEASURE_NOTICE_S=0.0), caplog.at_level("WARNING", logger="tncompile.ways"):
        measured._NOTICED.clear()
        choose(layer, torch.randn(64, 96))
        choose(layer, torch.randn(300, 96))                 # another bucket: measured, not named again
    lines = [r.getMessage() for r in caplog.records if "timing each compressed layer's ways" in r.getMessage()]
    assert len(lines) == 1 and "TNCOMPILE_WAY_CACHE" in lines[0] and "MEASURE_WAYS = False" in lines[0]
    assert measured.stats()["measured"] == 2 and measured.stats()["seconds"] >= 0.0
