"""Rank-adaptive training on 1 vs 2 processes (DDP or FSDP2 over gloo), and what one cut costs.

    python benchmarks/bench_distributed.py [--batch 4] [--seq 64] [--steps 12] [--small]

The six-encoder at CoMERA's 44.9x-smaller start (``--small``: the 2-layer
``small_encoder``), trained with ``RankController`` through
``tncompile.distributed.DistributedModel``:

* **1 process** with all the machine's threads vs **2 processes** with half the
  threads each, every process taking ``--batch`` sequences per step: samples per
  second of the whole job (both run in this one invocation, one after the other);
* **2 processes under FSDP2** (``tncompile.distributed.shard``, one unit per
  encoder block): the same, with parameters and optimizer state sharded;
* **one cut** to 70% of the current size (``truncate(budget=...)``), timed on
  rank 0: under DDP the controller's truncation (broadcast from rank 0, cut,
  rank check) plus the DDP rebuild that follows; under FSDP2 the whole gather
  -> cut -> reshard, optimizer state included.

On one machine the 2 processes share the same cores, so this measures the
overhead of the distributed machinery (all-reduces, rebuilds), not scaling.
Writes ``benchmarks/results/distributed.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import tncompile
from tncompile.distributed import DistributedModel, shard
from tncompile.testing import six_encoder, small_encoder

from common import machine, parser, write_json

PAPER_RATIO = 1 / 44.9


def _model(small: bool):
    torch.manual_seed(0)
    model = small_encoder(max_len=128) if small else six_encoder()
    return tncompile.compile(model, target_ratio=0.3 if small else PAPER_RATIO, init="random")


def _worker(rank: int, world: int, port: int, mode: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    distributed = world > 1
    if distributed:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        compiled = _model(args.small)
        vocab = compiled.get_submodule("token_embedding").num_embeddings
        model = {"single": lambda c: c, "ddp": DistributedModel, "fsdp2": shard}[mode](compiled)
        opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=3e-4, gate_lr=3e-2))
        ctl = tncompile.RankController(compiled, opt, target_ratio=0.5 * compiled.ratio, early_steps=10**9)
        g = torch.Generator().manual_seed(rank)
        times = []
        for step in range(args.steps + 2):
            x = torch.randint(1, vocab, (args.batch, args.seq), generator=g)
            y = torch.randint(0, 3, (args.batch,), generator=g)
            start = time.perf_counter()
            task = F.cross_entropy(model(x), y)
            (task + ctl.penalty(task)).backward()
            opt.step()
            opt.zero_grad()
            if distributed:
                dist.barrier()
            times.append(time.perf_counter() - start)
        rebuild_ms = None
        before = compiled.ratio
        start = time.perf_counter()
        event = ctl.truncate(budget=0.7 * before)  # the least important ranks: the same cut in every mode
        cut_ms = 1e3 * (time.perf_counter() - start)
        if mode == "ddp":
            start = time.perf_counter()
            model.after_step(event)
            rebuild_ms = 1e3 * (time.perf_counter() - start)
        if rank == 0:
            step_s = statistics.median(times[2:])  # the first steps plan and warm up
            Path(out).write_text(json.dumps({"step_ms": 1e3 * step_s, "samples_per_s": world * args.batch / step_s,
                                             "cut_ms": cut_ms, "ddp_rebuild_ms": rebuild_ms,
                                             "ratio_before_cut": before, "ratio_after_cut": compiled.ratio,
                                             "threads_per_process": torch.get_num_threads()}))
    finally:
        if distributed:
            dist.destroy_process_group()


def _run(world: int, mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(world, port, mode, args, out), nprocs=world, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=4, help="sequences per process per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--small", action="store_true", help="the 2-layer small_encoder instead of the six-encoder")
    args = ap.parse_args()
    one, two, sharded = _run(1, "single", args), _run(2, "ddp", args), _run(2, "fsdp2", args)
    result = {"benchmark": "distributed", "model": "small_encoder" if args.small else "six_encoder",
              "batch_per_process": args.batch, "seq": args.seq, "steps": args.steps,
              "one_process": one, "two_processes": two, "two_processes_fsdp2": sharded,
              "throughput_ratio_2_over_1": two["samples_per_s"] / one["samples_per_s"],
              "throughput_ratio_fsdp2_over_ddp": sharded["samples_per_s"] / two["samples_per_s"],
              "cut_ratio_fsdp2_reshard_over_ddp_cut_and_rebuild":
                  sharded["cut_ms"] / (two["cut_ms"] + two["ddp_rebuild_ms"]), **machine()}
    write_json("distributed.json", result)
    print(f"1 process: {one['samples_per_s']:.1f} samples/s ({one['step_ms']:.0f} ms/step); "
          f"2 processes: {two['samples_per_s']:.1f} samples/s ({two['step_ms']:.0f} ms/step), "
          f"{result['throughput_ratio_2_over_1']:.2f}x; one cut {two['cut_ms']:.0f} ms + DDP rebuild "
          f"{two['ddp_rebuild_ms']:.0f} ms (1 process: cut {one['cut_ms']:.0f} ms); FSDP2 per block: "
          f"{sharded['samples_per_s']:.1f} samples/s, one cut (gather -> cut -> reshard) {sharded['cut_ms']:.0f} ms")


if __name__ == "__main__":
    main()
