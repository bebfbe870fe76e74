"""Rank-adaptive training on several processes with DistributedDataParallel or FSDP2.

    torchrun --nproc_per_node=2 examples/ddp.py            # CPU, gloo
    torchrun --nproc_per_node=2 examples/ddp.py --steps 400
    torchrun --nproc_per_node=2 examples/ddp.py --fsdp2    # parameters and optimizer state sharded

Every process compiles the same model (same seed), trains on its own shard of
a generated task through ``tncompile.fit(..., ddp={})`` and cuts ranks with
the others: the controller averages the task loss over the processes, decides
each cut from rank 0's gates, checks that every process ends with the same
ranks, and the DDP wrapper is rebuilt after each cut. With ``--fsdp2`` the
model is sharded by ``tncompile.distributed.shard`` instead and every cut
gathers, cuts and re-shards it. Rank 0 prints the report and writes the
checkpoint (``runs/ddp/ddp.tnc``; ``--out`` to change).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tncompile
import tncompile.distributed


def shard(rank: int, steps: int, batch: int):
    """This process's batches of a learnable toy task (a different shard per rank)."""
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        x = torch.randn(batch, 256, generator=g)
        yield x, x[:, :10].argmax(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="early + late steps (half each)")
    ap.add_argument("--batch", type=int, default=32, help="per process")
    ap.add_argument("--out", default=str(Path("runs") / "ddp"))
    ap.add_argument("--fsdp2", action="store_true", help="shard with FSDP2 instead of replicating with DDP")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g.: torchrun --nproc_per_node=2 examples/ddp.py")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    try:
        torch.manual_seed(0)  # the same model on every process
        model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
        compiled = tncompile.compile(model, target_ratio=0.1)
        if device is not None:
            compiled.to(device)
        if rank == 0:
            print(compiled.report())
        if args.fsdp2:  # before the optimizer, as usual with FSDP2: it then holds the shards
            tncompile.distributed.shard(compiled, units="blocks")
        opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3, gate_lr=1e-2))
        ctl = tncompile.RankController(compiled, opt, target_ratio=0.02)
        out = Path(args.out)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        ddp = None if args.fsdp2 else ({"device_ids": [device.index]} if device is not None else {})
        data = [(x.to(device), y.to(device)) if device is not None else (x, y)
                for x, y in shard(rank, args.steps, args.batch)]
        history = tncompile.fit(compiled, data, F.cross_entropy, opt, ctl, early_steps=args.steps // 2,
                                late_steps=args.steps - args.steps // 2, ddp=ddp,
                                checkpoint_path=out / "ddp.tnc", checkpoint_every=args.steps)
        if rank == 0:
            print(f"{dist.get_world_size()} processes ({'FSDP2' if args.fsdp2 else 'DDP'}): ratio {compiled.ratio:.4f}, "
                  f"task loss {history.task_loss[0]:.3f} -> {history.task_loss[-1]:.3f}, "
                  f"checkpoint {out / 'ddp.tnc'}")
        dist.barrier()  # every process done before the group goes: tearing gloo down under a busy peer can abort it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
