"""Issue 52 item 3: long compile work shows a bar naming its stage (after
``tuning.PROGRESS_DELAY`` seconds; set to 0 here so a small compile shows them), and
``TNCOMPILE_PROGRESS=0`` turns them off."""
from __future__ import annotations

import torch

import tncompile
from tncompile import tuning
from tncompile.testing import mlp


def _compile_with_calibration():
    torch.manual_seed(0)
    batches = [torch.randn(16, 64) for _ in range(4)]
    return tncompile.compile(mlp((64, 128, 64, 10)), target_ratio=0.4, calibration=batches)


def test_each_long_stage_shows_a_named_bar(monkeypatch, capsys):
    monkeypatch.setattr(tuning, "PROGRESS_DELAY", 0.0)
    monkeypatch.delenv("TNCOMPILE_PROGRESS", raising=False)
    _compile_with_calibration()
    err = capsys.readouterr().err
    for stage in ("tncompile calibration", "tncompile decomposition", "tncompile passes"):
        assert stage in err, f"no bar for {stage!r}: {err[-500:]!r}"


def test_no_bar_for_work_shorter_than_the_delay_or_when_turned_off(monkeypatch, capsys):
    monkeypatch.setattr(tuning, "PROGRESS_DELAY", 60.0)
    _compile_with_calibration()
    assert "tncompile" not in capsys.readouterr().err
    monkeypatch.setattr(tuning, "PROGRESS_DELAY", 0.0)
    monkeypatch.setenv("TNCOMPILE_PROGRESS", "0")
    _compile_with_calibration()
    assert "tncompile" not in capsys.readouterr().err
