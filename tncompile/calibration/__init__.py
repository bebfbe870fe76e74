"""Calibration for pretrained models (``compile(calibration=...)``).

:mod:`.statistics` runs the dense model on a few batches and keeps, per layer,
what an output-preserving fit needs (input second moments, row use);
:mod:`.layer_fit` fits each network to its layer's outputs;
:mod:`.allocation` shares the parameter budget by sensitivity.
"""
from .allocation import ErrorCurve, allocate_by_sensitivity, candidate_ranks, error_curve
from .layer_fit import FitResult, fit_linear_cores, fit_table_cores
from .statistics import CalibrationStats, InputMoment, collect_statistics

__all__ = ["CalibrationStats", "InputMoment", "collect_statistics", "FitResult", "fit_linear_cores",
           "fit_table_cores", "ErrorCurve", "candidate_ranks", "error_curve", "allocate_by_sensitivity"]
