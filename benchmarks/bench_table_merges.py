"""Where a compressed DLRM's fixed cost per step goes, and whether batching its tables pays.

A TTM table looks ids up from two half tables merged from its cores every training step
(``docs/recommender.md``, "Why TT is slower here"): DLRM's 26 tables pay 26 merges a step
whatever the batch. TorchRec's TBE batches a model's tables into one kernel each way;
the same idea here is to merge all 26 tables' half tables in one batched pass
(:class:`tncompile.runtime.kernels.factor_batch.BatchedFactors`, which already batches
TT linears' factors: a TTM core ``(r, m, n, r')`` is a TT core ``(r, m n, r')``, and each
half table one permuted factor). This measures, forward and backward, on the benchmark's
table layout (1,000,000 x 16 rows as ``(25, 25, 40, 40) x (2, 2, 2, 2)``, the ranks the
1/99 compile ends at, split where the plan splits it):

* ``merge, table by table``: each table's gated cores merged into its two half tables
  (what a training step runs now);
* ``merge, all tables batched``: the same half tables from one ``BatchedFactors`` pass over
  all tables, then each table's two factors permuted into half tables;
* ``lookup only``: the gathered product of ``--ids`` ids per table from half tables
  merged beforehand (forward and backward into the half tables): the per-id part.

All three are timed round-robin in one process (``common.interleaved_ms``) with the
host's copy bandwidth and GEMM throughput. Results: ``benchmarks/results/table_merges.json``.

    python benchmarks/bench_table_merges.py [--tables 26] [--rank 32] [--ids 2048] [--threads 2]
"""
from __future__ import annotations

import math

import torch

import common
from tncompile.runtime.kernels.factor_batch import BatchedFactors, FactorBatch
from tncompile.runtime.kernels.traced_lookup import half_tables, split_ids
from tncompile.runtime.ways.lookup import GatheredProduct
from tncompile.runtime.ways.network import scaled_cores

ROWS, COLS, SPLIT = (25, 25, 40, 40), (2, 2, 2, 2), 2


def make_tables(n: int, rank: int, seed: int = 0) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """``n`` tables' cores ``(r, m, n, r')`` and gates ``(r,)``, trainable."""
    g = torch.Generator().manual_seed(seed)
    ranks = (1, rank, rank, rank, 1)
    cores = [[(0.3 * torch.randn(ranks[k], ROWS[k], COLS[k], ranks[k + 1], generator=g)).requires_grad_()
              for k in range(4)] for _ in range(n)]
    gates = [[(0.5 + torch.rand(rank, generator=g)).requires_grad_() for _ in range(3)] for _ in range(n)]
    return cores, gates


def merged_one_by_one(cores, gates) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each table's ``L (M_L, N_L, r)`` and ``R (M_R, r, N_R)``, merged alone."""
    return [half_tables(scaled_cores(c, g), SPLIT) for c, g in zip(cores, gates)]


def merged_batched(batch: FactorBatch, cores, gates) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same half tables from one batched pass over every table."""
    tensors = [t for cs, gs in zip(cores, gates) for t in (*(c.view(c.shape[0], -1, c.shape[-1]) for c in cs), *gs)]
    out = BatchedFactors.apply(batch, False, *tensors)
    n = len(cores)
    m_l, n_l = math.prod(ROWS[:SPLIT]), math.prod(COLS[:SPLIT])
    m_r, n_r = math.prod(ROWS[SPLIT:]), math.prod(COLS[SPLIT:])
    halves = []
    for a, b in zip(out[:n], out[n:]):   # A (m0 n0 m1 n1, r), B (r, m2 n2 m3 n3)
        left = a.reshape(ROWS[0], COLS[0], ROWS[1], COLS[1], -1).permute(0, 2, 1, 3, 4).reshape(m_l, n_l, -1)
        right = b.reshape(-1, ROWS[2], COLS[2], ROWS[3], COLS[3]).permute(1, 3, 0, 2, 4).reshape(m_r, -1, n_r)
        halves.append((left, right))
    return halves


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--ids", type=int, default=2048, help="ids looked up per table (a DLRM batch: one per sample)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cores, gates = make_tables(args.tables, args.rank)
    batch = FactorBatch(SPLIT, [[(c.shape[0], c.shape[1] * c.shape[2], c.shape[3]) for c in cs] for cs in cores],
                        [[tuple(g.shape) for g in gs] for gs in gates])
    alone, together = merged_one_by_one(cores, gates), merged_batched(batch, cores, gates)
    gap = max(float((x - y).abs().max()) for pair, other in zip(alone, together) for x, y in zip(pair, other))
    assert gap < 1e-4, f"the batched half tables differ from the table-by-table ones by {gap}"

    leaves = [t for group in (cores, gates) for ts in group for t in ts]
    fixed = [(l.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()) for l, r in alone]
    ids = torch.randint(0, math.prod(ROWS), (args.tables, args.ids), generator=torch.Generator().manual_seed(1))
    digits = [split_ids(row, math.prod(ROWS[SPLIT:])) for row in ids]

    def backward_of(halves) -> None:
        sum(left.sum() + 2 * right.sum() for left, right in halves).backward()

    def lookups() -> None:
        sum(GatheredProduct.apply(l, r, i, j).sum() for (l, r), (i, j) in zip(fixed, digits)).backward()
    ways = {"merge, table by table": lambda: backward_of(merged_one_by_one(cores, gates)),
            "merge, all tables batched": lambda: backward_of(merged_batched(batch, cores, gates)),
            "lookup only": lookups}
    ms = common.interleaved_ms(ways, reps=args.reps, warmup=3,
                               setup=common.clear_grads(*leaves, *(t for pair in fixed for t in pair)))
    half_elements = args.rank * (math.prod(ROWS[:SPLIT]) * math.prod(COLS[:SPLIT])
                                 + math.prod(ROWS[SPLIT:]) * math.prod(COLS[SPLIT:]))
    payload = {"protocol": {"tables": args.tables, "rows": ROWS, "cols": COLS, "ranks": [args.rank] * 3,
                            "split": SPLIT, "ids_per_table": args.ids, "reps": args.reps},
               "host": common.machine(), "half_table_elements_per_table": half_elements,
               "ms_forward_backward_all_tables": {k: round(v, 2) for k, v in ms.items()},
               "batched_over_table_by_table": round(ms["merge, all tables batched"] / ms["merge, table by table"], 2)}
    path = common.write_json("table_merges.json", payload)
    print(f"{args.tables} tables, ranks {args.rank}, {args.ids} ids each ({path}):")
    for k, v in ms.items():
        print(f"  {k:28s} {v:8.2f} ms  ({v / args.tables:.2f} ms a table)")


if __name__ == "__main__":
    main()
