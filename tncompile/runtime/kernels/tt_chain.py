"""A TT linear over a few rows as one native call forward and one backward.

At a few tokens the planned executor's ~20 GEMMs and the gate products cost
more in per-op overhead than in arithmetic, and the layer ends up slower
than the dense matrix-vector product it replaces. Up to :data:`tncompile.tuning.CHAIN_ROWS`
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

from ... import tuning
from ...formats.layout import TTLayout
from ..native import kernels_for

__all__ = ["chain_available", "chain_kernels", "chain_macs", "tt_chain"]


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
    if rows > tuning.CHAIN_ROWS or rows < 1:
        return None
    key = (rows, layout.ranks)
    cheap = cache.get(key)
    if cheap is None:
        cheap = cache[key] = chain_macs(layout, rows) <= (tuning.CHAIN_FLOP_SLACK * plan_for(rows).fwd_flops
                                                           + tuning.CHAIN_FLOP_FLOOR)
    return kernels_for(x) if cheap else None


def chain_available(x: torch.Tensor, rows: int):
    """The native ops when a chain call can run ``rows`` rows of ``x`` at all (few rows,
    native kernels for ``x``), whatever it costs, else ``None``."""
    return kernels_for(x) if 1 <= rows <= tuning.CHAIN_ROWS else None


def tt_chain(ops, n_in: int, x: torch.Tensor, bias: torch.Tensor | None, cores: list[torch.Tensor],
             gates: list[torch.Tensor]) -> torch.Tensor:
    """``x (rows, *in_modes) -> (rows, out)`` through ``cores`` (input cores
    first, ``n_in`` of them) and ``gates``, plus ``bias``: one
    ``tncompile::tt_chain`` call, whose autograd node (built in C++, not a
    Python ``autograd.Function``: at one row the Python machinery costs as
    much as the arithmetic) runs ``tt_chain_backward``."""
    return ops.tt_chain(x, cores, gates, bias, n_in)
