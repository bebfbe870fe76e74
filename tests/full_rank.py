"""A compile pipeline whose networks are exact: every bond at its full rank.

For tests that compare a compiled model with the ORIGINAL model (not with
``to_dense()``, which would carry the same mistake): at full rank TT-SVD
reproduces every weight to float rounding, so any difference is a lost
operation, not compression.
"""
import tncompile
from tncompile.passes import FunctionPass, PendingLayer


def full_ranks(program):
    pending = {node.target: m for node, m in program.modules() if isinstance(m, PendingLayer)}
    for m in pending.values():
        if m.tied_to is None:
            m.layout = m.layout.with_ranks(list(m.layout.rank_bounds()))
    for m in pending.values():
        if m.tied_to is not None:
            m.layout = pending[m.tied_to].layout
    return program


def full_rank_pipeline() -> list:
    """The default pipeline with the full-rank pass in place of assign_ranks."""
    return ["canonicalize", "follow_device", "tensorize", FunctionPass(full_ranks, "full_ranks"), "decompose",
            "plan_contractions", "fuse_feed_forward", "lower_dropout", "fuse_attention", "fuse_siblings",
            "measure_ways"]


def compile_full_rank(model, example_inputs, **kw):
    return tncompile.compile(model, target_ratio=1.0, example_inputs=example_inputs, passes=full_rank_pipeline(),
                             **kw)
