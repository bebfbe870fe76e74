"""tncompile's own passes and the default pipeline.

Importing this module imports (and so registers) every built-in pass; ``BUILTIN_PASSES``
is taken then, before any user code can register one: what a model file may name in
its pipeline without the user passing it again.
"""
from __future__ import annotations

from . import (assign_ranks, canonicalize, choose_cores, collapse_layers, decompose, follow_device,  # noqa: F401
               fuse_attention,
               fuse_feed_forward, fuse_siblings, lower_dropout, measure_ways, plan_contractions, replan,
               tensorize, truncate_ranks)
from .infra.base import Pipeline, registered_passes

__all__ = ["BUILTIN_PASSES", "default_pipeline"]

#: tncompile's own passes (registered above, before any user code can register one): what
#: a model file may name in its pipeline without the user passing it again
BUILTIN_PASSES = frozenset(registered_passes())


def default_pipeline() -> Pipeline:
    """``canonicalize -> follow_device -> tensorize -> assign_ranks -> decompose ->
    plan_contractions -> fuse_feed_forward -> lower_dropout -> fuse_attention -> fuse_siblings ->
    measure_ways``, a fresh, editable copy."""
    return Pipeline(["canonicalize", "follow_device", "tensorize", "assign_ranks", "decompose",
                     "plan_contractions", "fuse_feed_forward", "lower_dropout", "fuse_attention",
                     "fuse_siblings", "measure_ways"])
