"""Real rank truncation vs masking: train-step time of the paper's six-encoder.

    python benchmarks/bench_truncation.py [--batch 8] [--seq 128] [--rounds 6] [--device cuda]

Three copies of one compiled six-encoder (CoMERA's 44.9x-smaller start):

* ``full``: ranks as compiled;
* ``masked``: half of every bond's gate entries set to zero -- what the
  reference CoMERA code does, same shapes, same work;
* ``truncated``: the masked model after ``RankController.truncate()``: the
  switched-off ranks are cut out of the cores, gates and optimizer state.

``masked`` and ``truncated`` compute the same function (checked). Each step
is forward, backward and AdamW; variants are timed round-robin with a
rotating order, so the ratios come from one run. The TT linears alone
(forward + backward of all 36 at ``batch x seq`` rows) are timed the same way,
to show which share of the step the ranks govern. On CUDA each step is a
:class:`tncompile.TrainStep` captured as a CUDA graph (eager, a GPU step is bound by
kernel launches, not by ranks) and every timed call ends with a synchronize; the
TT linears alone still run eagerly there (launch- and Python-bound on a GPU). Writes
``benchmarks/results/truncation_b{batch}x{seq}.json`` (``gpu-truncation_...`` on CUDA).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import tncompile
from tncompile.runtime import TTLinear
from tncompile.runtime.kernels.cpu_allocator import retain_freed_memory
from tncompile.train import TrainStep
from tncompile.testing import six_encoder

from common import interleaved_ms, machine, parser, write_json

PAPER_RATIO = 1 / 44.9


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--keep", type=float, default=0.5, help="share of every bond's ranks kept")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        retain_freed_memory()
    torch.manual_seed(0)
    x = torch.randint(1, 30522, (args.batch, args.seq), device=device)
    y = torch.randint(0, 3, (args.batch,), device=device)
    full = tncompile.compile(six_encoder(), target_ratio=PAPER_RATIO, init="random",
                             batch_sizes=[args.batch * args.seq]).to(device)
    masked = copy.deepcopy(full)
    probe_opt = torch.optim.AdamW(tncompile.param_groups(masked, lr=1e-4))
    ctl = tncompile.RankController(masked, probe_opt, target_ratio=PAPER_RATIO / 10, truncate_every=0)
    with torch.no_grad():
        for mod in ctl.layers.values():
            for g in mod.gates:
                g[max(1, round(g.numel() * args.keep)):] = 0.0
    truncated = copy.deepcopy(masked)
    cut_opt = torch.optim.AdamW(tncompile.param_groups(truncated, lr=1e-4))
    cut_ctl = tncompile.RankController(truncated, cut_opt, target_ratio=PAPER_RATIO / 10, truncate_every=0)
    cut_ctl.truncate()
    for m in (full, masked, truncated):
        m.eval()
    with torch.no_grad():
        assert torch.allclose(masked(x), truncated(x), atol=1e-4, rtol=1e-4), "truncation changed the function"

    runs = {}
    for name, model in (("full", full), ("masked", masked), ("truncated", truncated)):
        model.train()
        opt = torch.optim.AdamW(tncompile.param_groups(model, lr=1e-6))
        if cuda:
            captured = TrainStep(model, opt, F.cross_entropy, cuda_graph=True)

            def step(captured=captured):
                captured(x, y)
        else:
            def step(model=model, opt=opt):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        runs[name] = step
    ms = interleaved_ms(runs, reps=args.rounds, warmup=3, device=device)  # alternating warm-up: the heap settles
    layer_runs = {}
    rows = args.batch * args.seq
    for name, model in (("full", full), ("masked", masked), ("truncated", truncated)):
        linears = [m for m in model.tensorized_modules().values() if isinstance(m, TTLinear)]
        inputs = [torch.randn(rows, m.in_features, device=device, requires_grad=True) for m in linears]
        grads = [torch.randn(rows, m.out_features, device=device) for m in linears]

        def layers(linears=linears, inputs=inputs, grads=grads):
            for m, h, g in zip(linears, inputs, grads):
                m(h).backward(g)
        layer_runs[name] = layers
    layer_ms = interleaved_ms(layer_runs, reps=args.rounds, warmup=3, device=device)
    ranks_before = {n: list(m.layout.ranks) for n, m in ctl.layers.items()}
    ranks_after = {n: list(r) for n, r in cut_ctl.ranks().items()}
    result = {
        "benchmark": "truncation", "device": str(device), "step": "TrainStep, CUDA graph" if cuda else "eager",
        "batch": args.batch, "seq": args.seq, "keep": args.keep,
        "step_ms": ms, "tt_linears_ms": layer_ms,
        "tt_linears_speedup_truncated_vs_full": layer_ms["full"] / layer_ms["truncated"], "ratio": {"full": full.ratio, "masked": masked.ratio, "truncated": truncated.ratio},
        "speedup_truncated_vs_full": ms["full"] / ms["truncated"],
        "speedup_masked_vs_full": ms["full"] / ms["masked"],
        "ranks_before": ranks_before, "ranks_after": ranks_after, **machine(device),
    }
    path = write_json(f"{'gpu-' if cuda else ''}truncation_b{args.batch}x{args.seq}.json", result)
    print(f"six-encoder train step, batch {args.batch} x {args.seq}, {result['threads']} threads "
          f"(median of {args.rounds} interleaved rounds)")
    print("| variant | ranks | ratio | step ms | speed-up vs full | TT linears ms | speed-up |\n|---|---|---|---|---|---|---|")
    for name in ("full", "masked", "truncated"):
        rk = "as compiled" if name == "full" else f"{args.keep:.0%} switched on" + (
            ", cut" if name == "truncated" else ", masked")
        print(f"| {name} | {rk} | {result['ratio'][name]:.5f} | {ms[name]:.0f} | {ms['full'] / ms[name]:.2f}x | "
              f"{layer_ms[name]:.0f} | {layer_ms['full'] / layer_ms[name]:.2f}x |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
