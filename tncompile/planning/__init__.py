"""Compile-time search and cost models: contraction orders, lookup splits,
per-layer costs. Its thresholds live in :mod:`tncompile.tuning`.

Importing this package registers :class:`SearchPlanner` with the runtime
(:func:`tncompile.runtime.kernels.plans.set_planner`), so TT/TTM layers can plan a
bucket they meet for the first time without the runtime importing this code.
"""
from .contraction import fixed_order_macs, fixed_order_plan, plan_contraction
from .speed_model import (REFERENCE, DeviceSpeed, device_speed, layer_step_seconds, lookup_step_seconds,
                          measure_device_speed, merge_family)
from .layer_info import fmt_count, layer_info, ranks_str
from .lookup import per_id_macs, plan_lookup
from .planner import SearchPlanner

__all__ = ["SearchPlanner", "plan_contraction", "fixed_order_macs", "fixed_order_plan",
           "DeviceSpeed", "REFERENCE", "device_speed", "measure_device_speed", "layer_step_seconds", "lookup_step_seconds", "merge_family", "plan_lookup", "per_id_macs", "layer_info",
           "fmt_count", "ranks_str"]
