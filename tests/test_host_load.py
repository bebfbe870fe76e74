"""HostLoad: the CPU other processes used while a block ran, this process's own left out."""
import subprocess
import sys
import time

import pytest

from tncompile.testing import HostLoad, host_load

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")


def test_a_competing_process_makes_the_host_busy():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        with HostLoad() as load:
            time.sleep(1.0)
    finally:
        hog.kill()
        hog.wait()
    assert load.other_cores >= 0.6 and load.busy
    assert "other processes used" in load.describe() and "load average" in load.describe()
    assert load.as_dict()["busy"] is True


def test_this_process_own_work_is_not_counted(monkeypatch):
    """The ticks /proc/stat counts include this process: its own CPU seconds come off."""
    ticks = iter([(1000, 0, 4000), (1000 + 150, 10, 4000 + 200)])   # 1.5 busy seconds at 100 ticks/s
    own = iter([5.0, 6.0])                                           # 1.0 of them this process's
    monkeypatch.setattr(host_load, "_cpu_ticks", lambda: next(ticks))
    monkeypatch.setattr(host_load, "_own_cpu_seconds", lambda: next(own))
    monkeypatch.setattr(host_load, "_TICKS_PER_SECOND", 100)
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(host_load.time, "perf_counter", lambda: next(clock))
    with HostLoad() as load:
        pass
    assert load.seconds == 1.0 and load.other_cores == pytest.approx(0.5) and load.steal_share == pytest.approx(0.05)
    assert load.busy                                                  # half a core of others > 0.25


def test_without_proc_stat_nothing_is_claimed(monkeypatch):
    monkeypatch.setattr(host_load, "_cpu_ticks", lambda: None)
    with HostLoad() as load:
        pass
    assert load.other_cores is None and load.steal_share is None and not load.busy
