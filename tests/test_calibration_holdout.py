"""Issue 52 item 7: a calibrated fit is judged on calibration rows held out from it, the
report shows that error, and a set too small for the ranks it fits is warned about."""
from __future__ import annotations

import warnings

import torch
from torch import nn

import tncompile
from tncompile import CalibrationWarning


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))


def _inputs(batches: int, rows: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(128, 128, generator=g) / 128 ** 0.5  # correlated features, as real activations
    return [torch.randn(rows, 128, generator=g) @ mix for _ in range(batches)]


def _compile(calibration):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = tncompile.compile(_model(), target_ratio=0.2, prefer="size", calibration=calibration)
    return compiled, [w for w in caught if issubclass(w.category, CalibrationWarning)]


def test_a_small_calibration_set_is_warned_and_its_held_out_error_reported():
    """One batch of 10 rows for 128 input features: the fit matches those rows, not new
    ones -- the report's held-out error says so and compile warns with the rows to give."""
    compiled, warned = _compile(_inputs(1, 10))
    assert warned and "rows" in str(warned[0].message) and "256" in str(warned[0].message)
    summary = compiled.program.calibration_summary["0"]
    assert summary["rows"] == 8 and summary["held_out_error"] > 2 * summary["fit_error"]  # 2 of 10 held out
    assert "held-out" in str(compiled.report())
    # the held-out error is what new inputs see
    fresh = torch.cat(_inputs(4, 64, seed=7))
    layer, dense = compiled.tensorized_modules()["0"], _model()[0]
    with torch.no_grad():
        new_error = float((layer(fresh) - dense(fresh)).pow(2).sum() / (dense(fresh) - dense.bias).pow(2).sum())
    assert new_error > 2 * summary["fit_error"]


def test_enough_calibration_data_fits_without_a_warning():
    compiled, warned = _compile(_inputs(8, 128))
    assert not warned
    summary = compiled.program.calibration_summary["0"]
    assert summary["rows"] >= 2 * 128 and summary["held_out_error"] < 2 * summary["fit_error"] + 1e-3
