"""``tncompile.distributed``: rank-adaptive training across processes.

The public spelling of :mod:`tncompile.train.ddp` (see there):
:class:`DistributedModel`, :func:`unwrap`, :func:`save_on_rank0`,
:class:`RankMismatchError`; and of :mod:`tncompile.train.sharding` (FSDP2):
:func:`shard`, :func:`gathered`, :func:`full_parameters`, :func:`block_units`.
"""
from .train.sharding import ShardPlan, block_units, full_parameters, gathered, is_sharded, shard
from .train.ddp import (DistributedModel, RankMismatchError, active_group, broadcast_from_rank0,
                                check_same_everywhere, mean_over_processes, rank, save_on_rank0, unwrap, world_size)

__all__ = ["shard", "is_sharded", "gathered", "full_parameters", "block_units", "ShardPlan", "DistributedModel", "RankMismatchError", "unwrap", "save_on_rank0", "active_group", "rank",
           "world_size", "mean_over_processes", "broadcast_from_rank0", "check_same_everywhere"]
