"""TT linear / TTM embedding / six-encoder step: planned tncompile vs dense and vs fixed orders.

    python benchmarks/bench_layers.py [--quick] [--six-encoder-only]

Everything is measured in one process, round-robin interleaved (each round
calls every variant once; medians per variant), forward + backward, fp32,
with tncompile's CPU allocator setting (freed memory is reused; it applies to
every variant alike). Gradients are set to ``None`` before every call, as
``optimizer.zero_grad()`` does between training steps, so no variant pays
for accumulating into an old gradient. Ratios, not absolute times, are the result: the
machines are shared and noisy. Writes benchmarks/results/layers.json and
layers_speedup.png.

Variants for a TT linear ``in -> out`` at rank ``r`` over ``tokens`` rows:
  dense        nn.Linear
  planned      TTLinear with the plan tncompile picks for the bucket
  one-einsum   torch.einsum over the whole network, opt_einsum's path
               (what tensorly-torch does)
  merge-first  the fixed merge-cores-then-two-matmuls order (CoMERA's code)
  left-right   the fixed input-through-the-cores order
"""
from __future__ import annotations


import torch
from torch import nn
from tqdm.auto import tqdm

from common import clear_grads, host_speed, interleaved_ms, machine, parser, save_figure, write_json
from tncompile.formats import TTLayout
from tncompile.ir import TensorNetwork
from tncompile.planning import plan_contraction
from tncompile.runtime.kernels.plans import bucket_of
from tncompile.runtime import TTLinear, TTMEmbedding
from tncompile.runtime.kernels.cpu_allocator import retain_freed_memory
from tncompile.runtime.kernels.executor import contract
from tncompile.runtime.native import native_kernels, native_ops, native_status
from tncompile.runtime.ways.rows import drop_boundary as _drop_boundary

SHAPES = [(768, 768), (768, 3072), (3072, 768)]
TOKENS = [1, 32, 512, 4096]
RANKS = [8, 16, 30, 64]


def tt_variants(tt: TTLinear, tokens: int):
    lay = tt.layout
    inputs, output, sizes = tt.planner_problem()
    sizes = {**sizes, "b": bucket_of(tokens)}
    eq = TensorNetwork.of(tt).equation(include_gates=False)

    def fixed(strategy):
        plan = plan_contraction(inputs, output, sizes, strategies=[strategy])

        def run(x):
            ops = [x.reshape(tokens, *lay.in_modes), *_drop_boundary(tt.scaled_cores())]
            return contract(plan, ops).reshape(tokens, -1) + tt.bias
        return run

    def one_einsum(x):
        return torch.einsum(eq, x.reshape(tokens, *lay.in_modes), *tt.scaled_cores()).reshape(tokens, -1) + tt.bias

    return {"planned": tt, "one-einsum": one_einsum,
            "merge-first": fixed("merge-cores-first"), "left-right": fixed("left-to-right")}


def bench_linear(quick: bool) -> list[dict]:
    rows = []
    grid = [(s, r, t) for s in SHAPES for r in (RANKS if not quick else [8, 30]) for t in TOKENS]
    for (fin, fout), rank, tokens in tqdm(grid, desc="TT linear"):
        dense = nn.Linear(fin, fout)
        lay = TTLayout.for_shape(fin, fout, 3).with_ranks(rank)
        tt = TTLinear.from_linear(dense, layout=lay, rank=None, init="random")
        plan = tt.plan_bucket(bucket_of(tokens))
        x = torch.randn(tokens, fin, requires_grad=True)
        g = torch.randn(tokens, fout)
        reps = 5 if tokens >= 4096 else (21 if tokens >= 512 else 151)  # tiny calls are noisy: more rounds
        fns = {"dense": dense, **tt_variants(tt, tokens)}
        times = interleaved_ms({name: (lambda fn=fn: fn(x).backward(g)) for name, fn in fns.items()}, reps,
                               setup=clear_grads(dense, tt, x))
        fixed_best = min(times["merge-first"], times["left-right"])
        rows.append({
            "in": fin, "out": fout, "rank": rank, "tokens": tokens, "ms": times,
            "speedup_vs_dense": times["dense"] / times["planned"],
            "flop_limit": (fin * fout * tokens) / plan.fwd_flops,
            "planned_over_best_fixed": times["planned"] / fixed_best,
            "plan": plan.order(["x"] + [f"G{k}" for k in range(6)]), "strategy": plan.strategy,
        })
    return rows


def naive_ttm_lookup(emb: TTMEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """Gather every core's slice per id and contract the chain per id (one einsum)."""
    lay = emb.layout
    digits, rest = [], ids
    for m in reversed(lay.row_modes):
        digits.append(rest % m)
        rest = torch.div(rest, m, rounding_mode="floor")
    digits.reverse()
    slices = [c.index_select(1, i) for c, i in zip(emb.scaled_cores(), digits)]
    return torch.einsum("aTbc,cTde,eTfg,gThi->Tbdfh", *slices).reshape(ids.shape[0], -1)


def bench_embedding() -> dict:
    dense = nn.Embedding(30522, 768)
    ttm = TTMEmbedding.from_embedding(dense, rank=32, init="random")  # 4+4 modes as in the paper
    # a rank off the kernels' vector width, as rank-adaptive training leaves them after a cut
    ttm30 = TTMEmbedding.from_embedding(dense, rank=30, init="random")
    ids = torch.randint(0, 30522, (4096,))
    grad = torch.randn(4096, 768)
    def eager_ttm():
        with native_kernels(False):
            ttm(ids).backward(grad)

    native_ops()  # build (or load) before timing
    times = interleaved_ms({
        "nn.Embedding": lambda: dense(ids).backward(grad),
        "planned TTM": lambda: ttm(ids).backward(grad),
        "planned TTM, rank 30": lambda: ttm30(ids).backward(grad),
        "planned TTM, eager kernels": eager_ttm,
        "naive TTM": lambda: naive_ttm_lookup(ttm, ids).backward(grad),
    }, 9, setup=clear_grads(dense, ttm, ttm30))
    # what a training step pays for the table: fwd + bwd + the AdamW update of its parameters
    opts = {"nn.Embedding": torch.optim.AdamW(dense.parameters()), "planned TTM": torch.optim.AdamW(ttm.parameters())}
    with_adamw = interleaved_ms({
        "nn.Embedding": lambda: (dense(ids).backward(grad), opts["nn.Embedding"].step()),
        "planned TTM": lambda: (ttm(ids).backward(grad), opts["planned TTM"].step()),
    }, 5, setup=clear_grads(dense, ttm))
    params = {"nn.Embedding": dense.weight.numel(), "TTM": sum(p.numel() for p in ttm.parameters())}
    return {"ids": 4096, "layout": ttm.layout.describe(), "ms": times, "ms_with_adamw_step": with_adamw,
            "planned_over_dense_time_with_adamw": with_adamw["planned TTM"] / with_adamw["nn.Embedding"],
            "planned_over_dense_time": times["planned TTM"] / times["nn.Embedding"],
            "planned_rank30_over_dense_time": times["planned TTM, rank 30"] / times["nn.Embedding"],
            "naive_over_planned_time": times["naive TTM"] / times["planned TTM"],
            "eager_over_native_time": times["planned TTM, eager kernels"] / times["planned TTM"],
            "native": native_status(),
            "param_memory_ratio": params["nn.Embedding"] / params["TTM"], "params": params,
            "plan": ttm.plans[4096].describe()}


def bench_six_encoder(batch: int, reps: int) -> dict:
    """One AdamW train step of the paper's six-encoder: the dense model, the
    compiled one (default pipeline), the compiled one without the
    ``lower_dropout`` pass (PyTorch's dropout, i.e. only the TT rewrite and
    its fusion differ from dense), and without ``fuse_siblings`` (what one pass
    over the q/k/v projections' shared input gains)."""
    import tncompile
    from tncompile.testing import six_encoder
    torch.manual_seed(0)
    dense = six_encoder()
    example = (torch.randint(1, 30522, (2, 128)),)
    compiled = tncompile.compile(dense, target_ratio=1 / 44.9, init="random", batch_sizes=[batch],
                                 example_inputs=example)
    torch_dropout = tncompile.compile(dense, target_ratio=1 / 44.9, init="random", batch_sizes=[batch],
                                      example_inputs=example,
                                      passes=tncompile.default_pipeline().remove("lower_dropout"))
    no_siblings = tncompile.compile(dense, target_ratio=1 / 44.9, init="random", batch_sizes=[batch],
                                    example_inputs=example,
                                    passes=tncompile.default_pipeline().remove("fuse_siblings"))
    x = torch.randint(1, 30522, (batch, 128))
    y = torch.randint(0, 3, (batch,))
    steps = {}
    for name, model in (("dense", dense), ("compiled", compiled), ("compiled, torch dropout", torch_dropout),
                        ("compiled, no fuse_siblings", no_siblings)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        steps[name] = step
    # round-robin: same machine noise for all; 5 alternating warm-up rounds let the heap settle
    # (the compiled step stops page-faulting after 3 steps on its own; alternating with dense takes longer)
    out = {k: v / 1000 for k, v in interleaved_ms(steps, reps, warmup=5).items()}
    return {"batch": batch, "seq": 128, "step_s": out, "speedup": out["dense"] / out["compiled"],
            "speedup_torch_dropout": out["dense"] / out["compiled, torch dropout"],
            "speedup_no_fuse_siblings": out["dense"] / out["compiled, no fuse_siblings"],
            "ratio": compiled.ratio, "breakdown_ms": {k: step_breakdown(fn) for k, fn in steps.items()}}


# where a train step's time goes: profiler self time of these ATen ops, per category
STEP_CATEGORIES = {
    "GEMMs (linear / TT layers)": ("aten::mm", "aten::addmm", "tncompile::thin_expand",
                                   "tncompile::thin_project", "tncompile::thin_expand_backward"),
    "fused TT feed-forward": ("tncompile::ffn_forward", "tncompile::ffn_backward"),  # float GELU inside them
    "embedding lookups": ("aten::embedding_dense_backward", "aten::index_select",
                          "tncompile::gathered_product", "tncompile::gathered_product_backward"),
    "dropout masks": ("aten::bernoulli_", "tncompile::dropout_forward", "tncompile::dropout_backward"),
    "attention batched matmuls": ("aten::bmm",),
    "fused attention (native)": ("tncompile::attention_forward", "tncompile::attention_backward"),
    "softmax": ("aten::_softmax", "aten::_softmax_backward_data"),
    "GELU": ("aten::gelu", "aten::gelu_", "aten::gelu_backward"),
    "layer norm": ("aten::native_layer_norm", "aten::native_layer_norm_backward"),
}


def step_breakdown(step, calls: int = 3) -> dict[str, float]:
    """``calls`` profiled calls of ``step``: mean ms per call for each
    :data:`STEP_CATEGORIES` entry, the optimizer step, everything else, and
    the total (profiler self times). Several calls, because a single one can
    be hit by page faults wherever the heap happens to grow."""
    from torch.profiler import profile
    with profile() as prof:
        for _ in range(calls):
            step()
    events = prof.key_averages()
    self_ms = {e.key: e.self_cpu_time_total / 1000 / calls for e in events}
    total = sum(self_ms.values())
    out = {name: sum(self_ms.get(op, 0.0) for op in ops) for name, ops in STEP_CATEGORIES.items()}
    out["optimizer step"] = sum(e.cpu_time_total for e in events
                                if e.key.startswith("Optimizer.step")) / 1000 / calls
    out["everything else"] = total - sum(out.values())
    out["total"] = total
    return {k: round(v, 1) for k, v in out.items()}


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(5 * len(SHAPES), 4), sharey=True)
    for ax, (fin, fout) in zip(axes, SHAPES):
        for rank in sorted({r["rank"] for r in rows}):
            pts = [r for r in rows if (r["in"], r["out"], r["rank"]) == (fin, fout, rank)]
            line, = ax.plot([p["tokens"] for p in pts], [p["speedup_vs_dense"] for p in pts], "o-",
                            label=f"rank {rank}")
            ax.plot([p["tokens"] for p in pts], [p["flop_limit"] for p in pts], ":", color=line.get_color(),
                    alpha=0.6)  # dense flops / the plan's forward flops
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"TT linear {fin}->{fout}, fwd+bwd")
        ax.set_xlabel("tokens")
    axes[0].set_ylabel("speed-up over nn.Linear (dotted: FLOP limit)")
    axes[0].legend()
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="ranks 8 and 30 only, six-encoder at batch 8")
    ap.add_argument("--embedding-only", action="store_true",
                    help="only the TTM embedding against nn.Embedding, to benchmarks/results/embedding.json")
    ap.add_argument("--six-encoder-only", action="store_true",
                    help="only the six-encoder step (batch 32x128), to benchmarks/results/six_encoder.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    allocator = retain_freed_memory()
    # the model step first, so that the layer sweep's many large allocations cannot affect it;
    # the host's speed is measured before it too (machine() measures after): a shared host's
    # bandwidth swings within minutes, so the figure comes with both readings
    before = {f"{k}_before": v for k, v in host_speed().items() if k != "speed_device"}
    if args.embedding_only:
        emb = bench_embedding()
        path = write_json("embedding.json", {**machine(), **before, "retain_freed_memory": allocator, "embedding": emb})
        _print_embedding(emb)
        print(f"wrote {path}")
        return
    six = bench_six_encoder(8 if args.quick else 32, 3 if args.quick else 7)
    if args.six_encoder_only:
        path = write_json("six_encoder.json", {**machine(), **before, "retain_freed_memory": allocator,
                                               "six_encoder": six})
        _print_six(six)
        print(f"wrote {path}")
        return
    linear = bench_linear(args.quick)
    emb = bench_embedding()
    result = {**machine(), **before, "retain_freed_memory": allocator, "linear": linear, "embedding": emb,
              "six_encoder": six}
    path = write_json("layers.json", result)
    plot(linear, path.with_name("layers_speedup.png"))

    print(f"\n{'shape':>10s} {'rank':>4s} {'tokens':>6s} {'dense ms':>9s} {'planned':>8s} {'speed-up':>8s} "
          f"{'FLOP lim':>8s} {'1-einsum':>8s} {'merge1st':>8s} {'L-to-R':>8s} {'plan/best fixed':>15s}")
    for r in linear:
        t = r["ms"]
        print(f"{r['in']:>4d}->{r['out']:<5d} {r['rank']:>4d} {r['tokens']:>6d} {t['dense']:9.2f} {t['planned']:8.2f} "
              f"{r['speedup_vs_dense']:7.1f}x {r['flop_limit']:7.1f}x {t['one-einsum']:8.2f} {t['merge-first']:8.2f} "
              f"{t['left-right']:8.2f} {r['planned_over_best_fixed']:15.2f}")
    _print_embedding(emb)
    _print_six(six)
    print(f"\nwrote {path} and {path.with_name('layers_speedup.png')}")


def _print_embedding(emb: dict) -> None:
    print(f"\nTTM embedding 30522x768, {emb['layout']}, 4096 ids, fwd+bwd ms: "
          + ", ".join(f"{k} {v:.1f}" for k, v in emb["ms"].items()))
    print(f"  planned TTM / nn.Embedding time {emb['planned_over_dense_time']:.2f}x (rank 30: "
          f"{emb['planned_rank30_over_dense_time']:.2f}x), naive / planned "
          f"{emb['naive_over_planned_time']:.1f}x, eager kernels / native {emb['eager_over_native_time']:.2f}x "
          f"({emb['native']}), parameter memory {emb['param_memory_ratio']:.0f}x smaller")
    print("  with the AdamW step of the table's parameters: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in emb["ms_with_adamw_step"].items())
          + f" -> TTM / nn.Embedding {emb['planned_over_dense_time_with_adamw']:.2f}x")


def _print_six(six: dict) -> None:
    print(f"\nsix-encoder train step, batch {six['batch']}x128 (ratio {six['ratio']:.4f}): "
          + ", ".join(f"{k} {v:.2f}s" for k, v in six["step_s"].items())
          + f" -> {six['speedup']:.2f}x ({six['speedup_torch_dropout']:.2f}x with torch's dropout, "
          f"{six['speedup_no_fuse_siblings']:.2f}x without fuse_siblings)")
    print("  where a profiled step's time goes (ms, mean of 3 steps; profiling slows memory-bound ops):")
    names = list(six["breakdown_ms"])
    print(f"    {'':28s}" + "".join(f"{n:>25s}" for n in names))
    for cat in six["breakdown_ms"]["dense"]:
        print(f"    {cat:28s}" + "".join(f"{six['breakdown_ms'][n][cat]:25.1f}" for n in names))


if __name__ == "__main__":
    main()
