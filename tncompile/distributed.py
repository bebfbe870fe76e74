"""``tncompile.distributed``: rank-adaptive training across processes.

The public spelling of :mod:`tncompile.train.distributed` (see there):
:class:`DistributedModel`, :func:`unwrap`, :func:`save_on_rank0`,
:class:`RankMismatchError`.
"""
from .train.distributed import (DistributedModel, RankMismatchError, active_group, broadcast_from_rank0,
                                check_same_everywhere, mean_over_processes, rank, save_on_rank0, unwrap, world_size)

__all__ = ["DistributedModel", "RankMismatchError", "unwrap", "save_on_rank0", "active_group", "rank",
           "world_size", "mean_over_processes", "broadcast_from_rank0", "check_same_everywhere"]
