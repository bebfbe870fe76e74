"""Benchmarks write their results whole, and never through a link planted at the name."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import save_figure, write_result  # noqa: E402


def test_a_result_replaces_a_planted_link_and_reads_back(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me")
    (tmp_path / "out").mkdir()
    link = tmp_path / "out" / "r.json"
    link.symlink_to(target)
    write_result(link, {"step_ms": 1.5})
    assert not link.is_symlink() and json.loads(link.read_text()) == {"step_ms": 1.5}
    assert target.read_text() == "keep me"


def test_a_figure_is_a_png_written_whole(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "new" / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
