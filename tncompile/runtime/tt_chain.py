"""A TT linear over a few rows as one native call forward and one backward.

At a few tokens the planned executor's ~20 GEMMs and the gate products cost
more in per-op overhead than in arithmetic, and the layer ends up slower
than the dense matrix-vector product it replaces. Up to :data:`CHAIN_ROWS`
rows (measured crossover, see the README), :class:`TTLinear` instead runs
``tncompile::tt_chain`` (:mod:`.native`): the input walks through the cores
one by one, gates included, inside one C++ call, and the autograd graph
holds a single node built in C++ (``TTChainBackward``, which runs
``tt_chain_backward``).

Everywhere the native kernels do not apply (no compiler, CUDA, bf16 or
autocast, ``torch.compile`` tracing, more rows) the planned executor runs.
"""
from __future__ import annotations

import math

import torch

from ..formats.layout import TTLayout
from .native import kernels_for

__all__ = ["CHAIN_ROWS", "chain_kernels", "chain_macs", "tt_chain"]

# Up to this many rows one native chain call beats the planned executor. Measured interleaved
# (fwd+bwd, 2 cores, with the chain's C++ autograd node) on 768->768 at ranks 16 and 64,
# 768->3072 at rank 30 and 3072->768 at rank 8, the chain's time over the plan's was
# 0.59-0.76 at 4 rows, 0.70-0.90 at 6, 0.78-1.04 at 8 and 0.97-1.27 at 12
CHAIN_ROWS = 6
# ... unless walking the cores in mode order costs this many times the plan's multiply-adds
# (high ranks), plus a floor below which everything is overhead anyway
CHAIN_FLOP_SLACK, CHAIN_FLOP_FLOOR = 4, 1 << 20


def chain_macs(layout: TTLayout, rows: int) -> int:
    """Multiply-adds of the input walking through the cores in mode order."""
    ranks = (1, *layout.ranks, 1)
    total, rest, done = 0, math.prod(layout.in_modes), 1
    for k, m in enumerate(layout.in_modes):
        rest //= m
        total += rows * rest * m * ranks[k] * ranks[k + 1]
    for j, n in enumerate(layout.out_modes):
        k = len(layout.in_modes) + j
        total += rows * done * ranks[k] * n * ranks[k + 1]
        done *= n
    return total


def chain_kernels(x: torch.Tensor, layout: TTLayout, plan_for, rows: int, cache: dict):
    """The native ops when a TT linear over ``rows`` rows of ``x`` should run
    as one chain call (few rows, and the chain not far costlier than the
    plan ``plan_for(rows)``), else ``None``. The flop comparison is cached in
    ``cache`` per row count and ranks."""
    if rows > CHAIN_ROWS or rows < 1:
        return None
    key = (rows, layout.ranks)
    cheap = cache.get(key)
    if cheap is None:
        cheap = cache[key] = chain_macs(layout, rows) <= (CHAIN_FLOP_SLACK * plan_for(rows).fwd_flops
                                                           + CHAIN_FLOP_FLOOR)
    return kernels_for(x) if cheap else None


def tt_chain(ops, n_in: int, x: torch.Tensor, bias: torch.Tensor | None, cores: list[torch.Tensor],
             gates: list[torch.Tensor]) -> torch.Tensor:
    """``x (rows, *in_modes) -> (rows, out)`` through ``cores`` (input cores
    first, ``n_in`` of them) and ``gates``, plus ``bias``: one
    ``tncompile::tt_chain`` call, whose autograd node (built in C++, not a
    Python ``autograd.Function``: at one row the Python machinery costs as
    much as the arithmetic) runs ``tt_chain_backward``."""
    return ops.tt_chain(x, cores, gates, bias, n_in)
