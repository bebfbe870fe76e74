"""Thin-GEMM shapes on this CPU: the measurements behind the executor's padding rules.

    python benchmarks/bench_gemm_shapes.py [--quick]

A TT layer's big GEMMs have one thin side of rank size (8-64). MKL runs some
of those sizes much slower than a slightly larger one, so the executor pads
them with zeros and crops the result (``tncompile.runtime.kernels.cpu_gemm``):

* columns: ``G @ B.T`` with ``G (4096, K)``, ``B (n, K)`` (an input gradient
  ``g @ B.T``), for n = 8..64, as is and padded to a multiple of 8 (16 below 16);
* rows: ``H.T @ G`` with ``H (4096, m)``, ``G (4096, 3072)`` (a core gradient),
  for m = 2..20, as is and padded as ``padded_rows`` does.

* native thin kernels (``tncompile.runtime.native``) against the MKL path the
  executor would take otherwise, for M = 512, 4096 rows, N = 768, 3072,
  r = 8, 16, 30, 64: ``t @ B + bias`` (expand), ``x @ A`` (project) and the
  expand's backward (``dt, dB, dbias`` in one pass over ``dy``).

Shapes are timed interleaved in shuffled order (medians); the JSON gives,
per size, both times and the executor's choice, so a rule that stopped paying
(a new MKL, another CPU) shows up as a ratio below 1. Writes
``benchmarks/results/gemm_columns.json``.
"""
from __future__ import annotations


import torch

from common import interleaved_ms, machine, parser, write_json
from tncompile.runtime.kernels.cpu_allocator import retain_freed_memory
from tncompile.runtime.kernels.cpu_gemm import cpu_gemm, padded_columns, padded_rows
from tncompile.runtime.kernels.gemms import gemm_bias
from tncompile.runtime.native import native_kernels, native_ops, native_status


def _columns(k: int, sizes: list[int], reps: int) -> list[dict]:
    g = torch.randn(4096, k)
    fns, chosen = {}, {}
    for n in sizes:
        b = torch.randn(n, k)
        wide = chosen[n] = padded_columns(4096, k, n)
        padded = torch.zeros(wide, k)
        padded[:n] = b
        fns[f"{n}"] = lambda b=b: g @ b.t()
        fns[f"{n}->{wide}"] = lambda p=padded, n=n: (g @ p.t())[:, :n]
    ms = interleaved_ms(fns, reps)
    return [{"K": k, "n": n, "padded_to": chosen[n], "ms": ms[f"{n}"], "ms_padded": ms[f"{n}->{chosen[n]}"],
             "speedup": ms[f"{n}"] / ms[f"{n}->{chosen[n]}"]} for n in sizes if chosen[n] != n]


def _rows(sizes: list[int], reps: int) -> list[dict]:
    g = torch.randn(4096, 3072)
    fns, chosen = {}, {}
    for m in sizes:
        h = torch.randn(4096, m)
        rows = chosen[m] = padded_rows(m, 4096, 3072)
        padded = torch.zeros(4096, rows)
        padded[:, :m] = h
        fns[f"{m}"] = lambda h=h: h.t() @ g
        fns[f"{m}->{rows}"] = lambda p=padded, m=m: (p.t() @ g)[:m]
    ms = interleaved_ms(fns, reps)
    return [{"m": m, "padded_to": chosen[m], "ms": ms[f"{m}"], "ms_padded": ms[f"{m}->{chosen[m]}"],
             "speedup": ms[f"{m}"] / ms[f"{m}->{chosen[m]}"]} for m in sizes if chosen[m] != m]


def _thin(rows: list[int], widths: list[int], ranks: list[int], reps: int) -> list[dict]:
    """Native thin kernels vs the MKL calls they replace, per shape."""
    ops = native_ops()
    if ops is None:
        return []
    results = []
    for m in rows:
        for n in widths:
            for r in ranks:
                t, w, bias = torch.randn(m, r), torch.randn(r, n), torch.randn(n)
                x, a, dy = torch.randn(m, n), torch.randn(n, r), torch.randn(m, n)

                def mkl_expand():
                    with native_kernels(False):
                        gemm_bias(t, w, bias)

                def mkl_project():
                    with native_kernels(False):
                        cpu_gemm(x, a)

                def mkl_backward():  # what runs without the kernel: dy @ B.T, then [t, 1].T @ dy
                    with native_kernels(False):
                        cpu_gemm(dy, w.t())
                        cpu_gemm(torch.cat([t, t.new_ones(m, 1)], 1).t(), dy)

                ms = interleaved_ms({
                    "expand native": lambda: ops.thin_expand(t, w, bias), "expand mkl": mkl_expand,
                    "project native": lambda: ops.thin_project(x, a), "project mkl": mkl_project,
                    "backward native": lambda: ops.thin_expand_backward(dy, t, w, True, True, True),
                    "backward mkl": mkl_backward}, reps)
                results.append({"M": m, "N": n, "r": r, "ms": ms, **{
                    f"{k}_speedup": ms[f"{k} mkl"] / ms[f"{k} native"] for k in ("expand", "project", "backward")}})
    return results


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a few sizes, fewer repetitions")
    args = ap.parse_args()
    retain_freed_memory()
    reps = 3 if args.quick else 7
    cols = [10, 30, 35] if args.quick else list(range(8, 65))
    rows = [9] if args.quick else list(range(2, 21))
    columns = [r for k in (768, 3072) for r in _columns(k, cols, reps)]
    row_results = _rows(rows, reps)
    thin = _thin([4096] if args.quick else [512, 4096], [3072] if args.quick else [768, 3072],
                 [8, 30] if args.quick else [8, 16, 30, 64], reps)
    path = write_json("gemm_columns.json", {**machine(), "columns": columns, "rows": row_results,
                                            "thin_native": thin, "native": native_status()})
    for name, rs, key in (("columns", columns, "n"), ("rows", row_results, "m")):
        gains = [r["speedup"] for r in rs]
        print(f"{name}: padded faster at {sum(g > 1 for g in gains)}/{len(gains)} sizes, "
              f"median {sorted(gains)[len(gains) // 2]:.2f}x, worst {min(gains):.2f}x")
        for r in rs:
            print(f"  {key}={r[key]:>2d}{' K=' + str(r['K']) if 'K' in r else '':>7s} -> {r['padded_to']:>2d}: "
                  f"{r['ms']:6.2f} ms -> {r['ms_padded']:6.2f} ms ({r['speedup']:.2f}x)")
    print(f"native thin kernels vs MKL ({native_status()}):")
    for r in thin:
        print(f"  M={r['M']:>4d} N={r['N']:>4d} r={r['r']:>2d}: expand {r['expand_speedup']:.2f}x, "
              f"project {r['project_speedup']:.2f}x, backward {r['backward_speedup']:.2f}x")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
