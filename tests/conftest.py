import json
import os
import shutil
from pathlib import Path

# Triton's kernels run through its interpreter where there is no GPU; the switch is read
# when Triton loads, so it is set before anything imports it (tests/test_triton_kernels.py)
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

DATA = Path(os.environ.get("TNCOMPILE_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _suite_speed():
    """What the suite's ``prefer="speed"`` plans with: the reference CPU's GEMM speed and
    bandwidth, kernel calls free. Its small models stand in for large ones, whose layers
    are judged by multiply-adds and bytes; ``tests/test_prefer.py`` tests the fixed costs
    with :data:`tncompile.planning.REFERENCE`. Never the CI host's measured speed: ranks
    and dense/TT choices do not depend on the machine."""
    from dataclasses import replace
    from tncompile.planning import REFERENCE
    return replace(REFERENCE, device="test suite (kernels free)", kernel_seconds=1e-12, dense_call_seconds=1e-12)


SUITE_SPEED = _suite_speed()
os.environ["TNCOMPILE_DEVICE_SPEED"] = json.dumps(SUITE_SPEED.as_dict())  # processes the tests start


@pytest.fixture(autouse=True)
def _suite_device_speed(monkeypatch):
    from tncompile import tuning
    monkeypatch.setattr(tuning, "DEVICE_SPEED", SUITE_SPEED)
    yield


@pytest.fixture
def data_dir():
    if not DATA.exists():
        pytest.skip(f"shared data not found at {DATA} (set TNCOMPILE_DATA)")
    return DATA


@pytest.fixture(scope="session")
def ops():
    """The native CPU kernels (``torch.ops.tncompile``); a failed build where a
    C++ compiler exists fails the test, no compiler skips it."""
    from tncompile.runtime.native import native_ops, native_status
    found = native_ops()
    if found is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail(f"a C++ compiler is here but the kernels did not build: {native_status()}")
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    return found


@pytest.fixture
def call_spy(monkeypatch):
    """``call_spy(function_class, arg)`` patches ``function_class.apply`` to
    record ``args[arg].shape`` of every call, and returns that list."""
    def install(function_class, arg: int) -> list:
        calls = []
        real = function_class.apply

        def counting(*args):
            calls.append(args[arg].shape)
            return real(*args)
        monkeypatch.setattr(function_class, "apply", counting)
        return calls
    return install


@pytest.fixture
def trains_like():
    """``trains_like(compiled, plain, ids)``: a rewritten model computes what the model
    without the rewrite does, outputs and every parameter's gradient."""
    def check(compiled, plain, ids):
        torch.testing.assert_close(compiled(ids), plain(ids), rtol=1e-5, atol=1e-5)
        compiled(ids).square().sum().backward()
        plain(ids).square().sum().backward()
        for (name, p), q in zip(compiled.model.named_parameters(), plain.model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    return check


@pytest.fixture
def reloads_with(tmp_path):
    """``reloads_with(compiled, ids, function, count, model)``: saved, then loaded onto the dense
    ``model``, it still calls ``function`` ``count`` times in its graph and gives the same outputs."""
    def check(compiled, ids, function, count, model):
        import tncompile
        path = tmp_path / "rewritten.tnc"
        tncompile.save(compiled, path)
        loaded = tncompile.load(path, model=model).train(compiled.training)
        assert sum(n.target is function for n in loaded.program.graph.nodes) == count
        assert torch.equal(loaded(ids), compiled(ids))
    return check


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


_TIMES = os.environ.get("TNCOMPILE_TEST_TIMES")


def pytest_runtest_logreport(report):
    """With ``TNCOMPILE_TEST_TIMES=<file>``, each test's setup, call and teardown seconds
    are appended to the file as they finish (``--durations`` prints only at the end, and a
    run stopped early prints nothing): how docs/development.md finds the slow tests."""
    if _TIMES:
        with open(_TIMES, "a", encoding="utf-8") as out:
            out.write(f"{report.duration:.3f}\t{report.when}\t{report.nodeid}\n")
