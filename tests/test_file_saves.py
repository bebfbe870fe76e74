"""Saves never lose data: temporaries of live writers survive, modes are kept, long names fit,
failures are OSErrors naming the path with the previous file intact, and a load racing an
atomic re-save gets the old model or the new one."""
import errno
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch

import tncompile
from tncompile.serialization import container
from tncompile.testing import mlp

_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.utime(sys.argv[1], (0, 0))   # looks ancient: only the lock says it is alive
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    a = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.4).eval()
    b = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.4).eval()
    return a, b


def test_a_live_writers_temporary_is_never_removed_a_dead_ones_is(models, tmp_path):
    path = tmp_path / "m.tnc"
    live = tmp_path / ".tnc-0a1b2c3d0a1b2c3d.tmp"
    writer = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(live)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "locked"
        fresh = tmp_path / ".tnc-ffffffffffffffff.tmp"
        fresh.write_bytes(b"a writer between creating and locking it")   # new: kept, lock or not
        unrelated = tmp_path / ".m.tnc.tmp"   # not a name tncompile gives its temporaries
        unrelated.write_bytes(b"")
        os.utime(unrelated, (0, 0))
        tncompile.save(models[0], path)
        assert live.exists() and fresh.exists() and unrelated.exists()
    finally:
        writer.kill()
        writer.wait()
    tncompile.save(models[0], tmp_path / "other.tnc")  # any save into the directory sweeps it:
    assert not live.exists() and fresh.exists() and unrelated.exists()  # its writer is gone and it is stale
    assert tncompile.load(path, model=mlp((64, 128, 10))) is not None


def test_a_resave_keeps_the_files_mode(models, tmp_path):
    path = tmp_path / "private.tnc"
    tncompile.save(models[0], path)
    os.chmod(path, 0o600)
    tncompile.save(models[1], path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    os.chmod(path, 0o640)
    tncompile.save(models[0], path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_a_name_at_the_file_systems_limit_saves(models, tmp_path):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    path = tmp_path / ("m" * (limit - 4) + ".tnc")
    assert len(path.name) == limit
    tncompile.save(models[0], path)
    x = torch.randn(3, 64)
    assert torch.equal(tncompile.load(path, model=mlp((64, 128, 10)))(x), models[0](x))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("code, where", [(errno.EROFS, "open"), (errno.ENOSPC, "fsync"), (errno.EIO, "replace")])
def test_write_failures_are_oserrors_naming_the_path_and_keep_the_old_file(models, tmp_path, monkeypatch,
                                                                           code, where):
    path = tmp_path / "m.tnc"
    tncompile.save(models[0], path)
    before = path.read_bytes()
    real = {"open": os.open, "fsync": os.fsync, "replace": os.replace}[where]

    def failing(*args, **kwargs):
        if where != "open" or ".tnc-" in str(args[0]):
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(container.os, where, failing)
    with pytest.raises(OSError) as info:
        tncompile.save(models[1], path)
    monkeypatch.undo()
    assert info.value.errno == code and info.value.filename == str(path) and str(path) in str(info.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.tnc"]


def test_a_load_racing_a_resave_gets_the_old_or_the_new_model(models, tmp_path):
    a, b = models
    path = tmp_path / "m.tnc"
    tncompile.save(a, path)
    x = torch.randn(4, 64)
    outputs = [a(x), b(x)]
    stop = threading.Event()

    def resave():
        k = 0
        while not stop.is_set():
            tncompile.save(models[k % 2], path)
            k += 1

    writer = threading.Thread(target=resave)
    writer.start()
    seen = [0, 0]
    try:
        deadline = time.monotonic() + 20.0
        loads = 0
        while time.monotonic() < deadline and loads < 300:
            y = tncompile.load(path, model=mlp((64, 128, 10)))(x)  # each load traces the model again
            match = [torch.equal(y, o) for o in outputs]
            assert any(match), "a load saw neither the old nor the new model"
            seen[match.index(True)] += 1
            loads += 1
    finally:
        stop.set()
        writer.join()
    assert loads >= 20 and min(seen) > 0, seen
