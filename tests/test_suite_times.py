"""The suite's own tooling: ``TNCOMPILE_TEST_TIMES`` records each test's seconds as it
finishes (conftest's hook), which is how docs/development.md finds the slow tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_the_times_file_gets_a_line_per_phase_of_each_test_run(tmp_path):
    times = tmp_path / "times.tsv"
    env = {**os.environ, "TNCOMPILE_TEST_TIMES": str(times)}
    chosen = "test_formats.py::test_factorize_covers_and_is_bounded"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", chosen],
                         cwd=TESTS, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [line.split("\t") for line in times.read_text().splitlines()]
    ran = int(run.stdout.split(" passed")[0].split()[-1])
    assert ran >= 1 and len(rows) == 3 * ran   # setup, call and teardown of each
    assert {phase for _, phase, _ in rows} == {"setup", "call", "teardown"}
    assert all(float(seconds) >= 0 and chosen in node for seconds, _, node in rows)
