"""How close is one TT linear's training step to what the hardware allows?

    python benchmarks/bench_tt_floor.py [--in 768] [--out 3072] [--rows 4096] [--rank 30] [--reps 15]

Issue 28's third point. Times the training step (forward, ``backward(dy)`` into the input
and every core and gate; gradients reset between steps as ``zero_grad()`` does) of a
3-core TT linear, interleaved with ``nn.Linear``'s, and puts it next to two floors
measured in the same run:

* memory: the bytes a step must move -- read ``x`` and write ``y`` forward, read ``dy``
  and write ``dx`` backward, ``4 * rows * (in + out) * 2`` -- over the measured copy
  bandwidth (bytes read plus written per second);
* compute: the multiply-adds of the plan the layer runs (forward and backward, x2 for
  FLOPs) over the measured fp32 GEMM throughput.

Then profiles a few steps and lists where the time goes (self time by op), so a gap to
the floor is explained by what runs. Writes ``benchmarks/results/tt_floor.json`` with the
host's bandwidth and throughput.
"""
from __future__ import annotations


import torch
from torch.profiler import ProfilerActivity, profile

from tncompile.formats.layout import TTLayout
from tncompile.runtime import TTLinear

from common import clear_grads, interleaved_ms, machine, parser, write_json


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--in", dest="fin", type=int, default=768)
    ap.add_argument("--out", dest="fout", type=int, default=3072)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    layer = TTLinear(TTLayout.for_shape(args.fin, args.fout, 3).with_ranks(args.rank))
    dense = torch.nn.Linear(args.fin, args.fout)
    x = torch.randn(args.rows, args.fin, requires_grad=True)
    dy = torch.randn(args.rows, args.fout)
    steps = {"tt": lambda: layer(x).backward(dy), "dense": lambda: dense(x).backward(dy)}
    ms = interleaved_ms(steps, reps=args.reps, warmup=3, setup=clear_grads(layer, dense, x))
    speed = machine()  # the host's copy bandwidth and GEMM throughput, measured right after the steps
    plan = layer.plan_for(args.rows)
    must_move = 4 * args.rows * (args.fin + args.fout) * 2
    memory_floor = 1e3 * must_move / (speed["copy_gb_per_s"] * 1e9)
    flops = 2 * (plan.fwd_flops + plan.bwd_flops)
    compute_floor = 1e3 * flops / (speed["gemm_gflop_per_s"] * 1e9)
    floor = max(memory_floor, compute_floor)
    print(f"TT step {ms['tt']:.2f} ms (dense {ms['dense']:.2f} ms, {ms['dense'] / ms['tt']:.1f}x)")
    print(f"floors: memory {memory_floor:.2f} ms ({must_move / 1e6:.0f} MB at {speed['copy_gb_per_s']} GB/s), "
          f"compute {compute_floor:.2f} ms ({flops / 1e9:.2f} GFLOP at {speed['gemm_gflop_per_s']} GFLOP/s)")
    print(f"step / larger floor: {ms['tt'] / floor:.2f} (goal <= 1.5)")

    clear_grads(layer, x)()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            clear_grads(layer, x)()
            steps["tt"]()
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    by_op = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    profile_rows = [{"op": e.key, "calls_per_step": e.count // 5, "self_ms_per_step": round(e.self_cpu_time_total / 5e3, 3),
                     "share": round(e.self_cpu_time_total / total, 3)} for e in by_op]
    for r in profile_rows:
        print(f"  {r['op'][:48]:48s} {r['calls_per_step']:4d} calls  {r['self_ms_per_step']:7.2f} ms  {r['share']:.0%}")
    path = write_json("tt_floor.json", {
        "benchmark": "tt_floor", "in": args.fin, "out": args.fout, "rows": args.rows, "rank": args.rank,
        "strategy": plan.strategy, "tt_ms": round(ms["tt"], 3), "dense_ms": round(ms["dense"], 3),
        "speedup_vs_dense": round(ms["dense"] / ms["tt"], 2),
        "bytes_that_must_move": must_move, "memory_floor_ms": round(memory_floor, 3),
        "plan_flops": flops, "compute_floor_ms": round(compute_floor, 3),
        "step_over_larger_floor": round(ms["tt"] / floor, 3), "goal": 1.5,
        "profile_self_time_per_step": profile_rows, **speed})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
