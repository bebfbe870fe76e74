"""Ops a training step dispatches on PyTorch's own kernels: what a GPU's host launches.

    python benchmarks/bench_dispatch.py [--model six-encoder|small-bert|llama|both] [--batch 2]

On a GPU a small model's step is bound by the kernels it launches, not by its arithmetic
(``bench_gpu_kernels.py`` shows it on one). This counts the ops without a GPU: the step's
forward and backward run under ``torch.profiler`` with tncompile's native CPU kernels off
(``TNCOMPILE_NATIVE=0``, set here), every GEMM as ``torch.mm`` and padded factor batches
packed through index scatters (:func:`ops_as_on_cuda`): the PyTorch ops each TT layer
runs on CUDA. Two counts per model: *dispatched* (top-level ATen ops, each a
Python-to-C++ dispatch on the host) and *kernel-like* (leaf ATen ops that are not views,
shape queries or allocations: roughly the kernels a GPU would launch). Models are
compiled for ``planning.REFERENCE`` (counts do not depend on the host). Variants: the
dense model; the compiled one with every batch merging into thin factors
(``tuning.WHOLE_MATRICES = False``: captured CUDA steps, and CPUs); the same on
tncompile's Triton kernels (``tuning.TRITON_KERNELS``: a thin pair per layer, a batched merge
per family and per TTM table, a gather and a scatter per lookup; a Triton op counts as the
launches it makes on a GPU, whatever its CPU fallback runs); the same deciding
whole matrices by an H100's measured speed (:data:`H100`: its batches then merge into
whole matrices, as eager steps there do); and the compiled one with each layer merging
its own cores (``tuning.GROUP_FACTORS = False``; see :mod:`tncompile.runtime.layers.factor_groups`);
then the same compiled model after rank cuts that leave every TT linear its own ranks
(each bond cut to a seeded random 60-100% of its rank, as rank-adaptive training leaves
them): batched with zero-padded cores (the default), batched only where ranks match
(``tuning.FACTOR_PAD_LIMIT = 1``), and merged per layer. Under bf16 autocast, dense and
compiled (thin products) also count their casts (``aten::_to_copy``): a compiled layer
merges its cores in fp32 and casts the merged factors once, so it adds none per core. The optimizer is left out (its
kernels depend on the device's implementation). Counts are deterministic: no timing, any
host. Writes ``benchmarks/results/dispatch.json``.
"""
from __future__ import annotations

import importlib
import os
from collections import Counter

os.environ["TNCOMPILE_NATIVE"] = "0"  # before tncompile loads: the PyTorch ops a GPU runs

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import tncompile  # noqa: E402
from tncompile import tuning  # noqa: E402
from tncompile.planning import REFERENCE, DeviceSpeed  # noqa: E402
from tncompile.runtime import TTLinear  # noqa: E402
from tncompile.testing import six_encoder  # noqa: E402

from common import cut_every_layer, machine, parser, write_json  # noqa: E402

#: ATen ops that launch no kernel of their own: views, shape and type queries, allocations,
#: host reads, and composite ops whose children are counted instead
NOT_KERNELS = frozenset(f"aten::{name}" for name in (
    "reshape", "view", "_unsafe_view", "_reshape_alias", "t", "transpose", "permute", "expand", "select",
    "slice", "narrow", "squeeze", "unsqueeze", "unbind", "split", "split_with_sizes", "chunk", "alias",
    "as_strided", "detach", "lift_fresh", "flatten", "unflatten", "empty", "empty_like", "empty_strided",
    "new_empty", "resize_", "item", "_local_scalar_dense", "to", "contiguous", "resolve_conj", "resolve_neg",
    "result_type", "promote_types", "is_nonzero", "size", "stride", "matmul", "linear", "dropout",
    "layer_norm"))

#: tncompile's Triton ops: the thin pair and a TTM gather or scatter are one launch each; a merge op launches one kernel per
#: task table it runs (counted as it runs them: :func:`ops_as_on_cuda`). On the CPU their
#: PyTorch fallback runs inside them, uncounted.
TRITON_OPS = frozenset({"tncompile::thin_pair", "tncompile::thin_pair_kept", "tncompile::thin_pair_activation_grad",
                        "tncompile::ttm_gather", "tncompile::ttm_scatter_"})
MERGE_OPS = frozenset({"tncompile::merge_factors_", "tncompile::merge_factors_backward_"})
MERGE_LAUNCHES = [0]

#: variant -> (GROUP_FACTORS, WHOLE_MATRICES, the speed whole matrices are decided by);
#: "Triton" variants set ``tuning.TRITON_KERNELS``
VARIANTS = {"dense": (True, False, None),
            "compiled, thin products": (True, False, None),
            "compiled, Triton kernels": (True, False, None),
            "compiled, whole matrices (H100's speed)": (True, True, "H100"),
            "compiled, per-layer merges": (False, False, None)}
#: the H100's speed as tncompile measured it there (torch 2.11; fixed costs timed eagerly):
#: what the whole-matrices variant decides with, as its eager steps would on that GPU
H100 = DeviceSpeed(device="cuda:NVIDIA H100 80GB HBM3 (measured 2026-11-27)", gemm_macs_per_s=2.564e13,
                   copy_bytes_per_s=2.913e12, kernel_seconds=8.73e-05, dense_call_seconds=2.19e-04)
#: variant -> (GROUP_FACTORS, FACTOR_PAD_LIMIT), run on the compiled model after the cuts
AFTER_CUTS = {"after cuts": (True, tuning.FACTOR_PAD_LIMIT),
              "after cuts, equal ranks only": (True, 1.0),
              "after cuts, per-layer merges": (False, tuning.FACTOR_PAD_LIMIT)}


def _six_encoder(batch: int):
    torch.manual_seed(0)
    model = six_encoder()
    x = torch.randint(1, 30522, (batch, 128))
    y = torch.randint(0, 3, (batch,))

    def compiled():
        return tncompile.compile(model, target_ratio=1 / 44.9, init="random", example_inputs=(x,))
    return model, compiled, (lambda m: F.cross_entropy(m(x), y))


def _small_bert(batch: int):
    import transformers  # noqa: PLC0415 - this model only

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=512, max_position_embeddings=64)
    model = transformers.BertModel(cfg).train()
    ids = {"input_ids": torch.randint(0, 1000, (batch, 64))}

    def compiled():
        return tncompile.compile(model, target_ratio=0.3, example_inputs=ids)
    return model, compiled, (lambda m: m(**ids).last_hidden_state.square().mean())


def _llama(batch: int):
    """A Llama-style decoder with the 350M point's layer shapes (hidden 1024, FFN 2816, 16
    heads, 32k vocabulary, SDPA), 4 layers, 64 ids a sample, at 0.1: on an H200 that model's
    eager step was host-bound (0.46x dense), so its ops per TT layer are the proxy here."""
    import transformers  # noqa: PLC0415 - this model only

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64,
                                   attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 32000, (batch, 64))
    example = {"input_ids": ids[:2, :16], "labels": ids[:2, :16]}

    def compiled():
        return tncompile.compile(model, target_ratio=0.1, init="random", example_inputs=example).train()
    return model, compiled, (lambda m: m(input_ids=ids, labels=ids).loss)


MODELS = {"six-encoder": _six_encoder, "small-bert": _small_bert, "llama": _llama}
#: what ``--model both`` counts (the Llama on its own: ``--model llama``, ``dispatch_llama.json``)
BOTH = ("six-encoder", "small-bert")


def _in_triton_op(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in TRITON_OPS or parent.name in MERGE_OPS:
            return True
        parent = parent.cpu_parent
    return False


def count_ops(model: torch.nn.Module, loss_of) -> dict:
    """Dispatched and kernel-like ops of one forward and backward (after one warm-up): a
    Triton op (:data:`TRITON_OPS`) is one of each, whatever the CPU runs inside it. By op:
    the twelve commonest and every Triton op."""
    model.zero_grad(set_to_none=True)
    loss_of(model).backward()
    model.zero_grad(set_to_none=True)
    MERGE_LAUNCHES[0] = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_of(model).backward()
    model.zero_grad(set_to_none=True)
    triton_ops = [e for e in prof.events() if e.name in TRITON_OPS]
    merges = MERGE_LAUNCHES[0]
    events = [e for e in prof.events() if e.name.startswith("aten::") and not _in_triton_op(e)]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    leaves = [e for e in events if e.name not in NOT_KERNELS
              and not any(c.name.startswith("aten::") and c.name not in NOT_KERNELS for c in e.cpu_children)]
    by_op = Counter(e.name for e in leaves + triton_ops)
    if merges:
        by_op["tncompile merge launches"] = merges
    dispatched = len(top) + len(triton_ops) + sum(e.name in MERGE_OPS for e in prof.events())
    return {"dispatched": dispatched, "kernel_like": len(leaves) + len(triton_ops) + merges,
            "casts": sum(e.name == "aten::_to_copy" for e in leaves),
            "kernel_like_by_op": dict(by_op.most_common(12)) | {e: by_op[e] for e in TRITON_OPS if by_op[e]}}


def count_batches(model: torch.nn.Module, loss_of) -> int:
    """Batched merges (:class:`~tncompile.runtime.layers.factor_groups.BatchedFactors` calls) in
    one forward."""
    from tncompile.runtime.layers.factor_groups import BatchedFactors  # noqa: PLC0415

    calls, real = [], BatchedFactors.apply
    BatchedFactors.apply = lambda *args: calls.append(1) or real(*args)
    try:
        loss_of(model)
    finally:
        BatchedFactors.apply = real
    return len(calls)


def ops_as_on_cuda(put=setattr) -> None:
    """Run the TT layers' ops as on CUDA: every GEMM as ``torch.mm`` (on CPU they go
    through ``cpu_gemm``, whose layout copies and padding a GPU never runs), padded
    factor batches through index scatters and gathers (on CPU: a copy per tensor), TTM
    lookups without host-side deduplication and with a device-side id check, and the
    Triton ops called where ``tuning.TRITON_KERNELS`` asks for them (their PyTorch fallback
    runs inside them; each merge launch is counted). ``put(module, name, value)`` patches
    (``monkeypatch.setattr`` in a test, to undo it)."""
    from tncompile.runtime.kernels import executor, gemms  # noqa: PLC0415
    from tncompile.runtime.kernels import factor_batch
    from tncompile.runtime.ways import backends, lookup as lookup_way
    from tncompile.runtime.triton import merge_factors, ttm_lookup
    thin_pair = importlib.import_module("tncompile.runtime.triton.thin_pair")  # the module (the package exports the op)

    for module in (executor, gemms):  # each holds its own name of gemm_for
        put(module, "gemm_for", lambda t: torch.mm)
    put(gemms, "cpu_gemm", torch.mm)
    put(factor_batch, "_by_index", lambda device: True)
    put(lookup_way, "distinct_ids", lambda flat: (flat, None))
    check = lookup_way.check_ids
    put(lookup_way, "check_ids", lambda ids, num, who="TTMEmbedding", host_read=True: check(ids, num, who, False))
    put(backends.get("triton"), "runs", lambda x: True)  # the ways take the Triton runners as on CUDA
    for module, name in ((thin_pair, "runs_triton"), (merge_factors, "_runs_triton"), (ttm_lookup, "_runs_triton")):
        put(module, name, lambda x: False)   # inside the ops: their PyTorch form, even under the interpreter
    for module in (thin_pair, merge_factors, ttm_lookup):   # through the dispatcher, where the profiler sees them
        put(module, "direct", lambda t: False)

    def counted(fn):
        return lambda *args: MERGE_LAUNCHES.__setitem__(0, MERGE_LAUNCHES[0] + 1) or fn(*args)
    put(merge_factors, "_launch_tasks", counted(merge_factors._launch_tasks))
    put(merge_factors, "_finish_torch", counted(merge_factors._finish_torch))


def _count_model(name: str, batch: int) -> list[dict]:
    """Each variant's counts of one model, then after cutting every layer's ranks."""
    rows = []
    dense, make_compiled, loss_of = MODELS[name](batch)
    compiled = make_compiled()
    for variant, (group, whole, decided_by) in VARIANTS.items():
        with tuning.override(GROUP_FACTORS=group, WHOLE_MATRICES=whole, TRITON_KERNELS="Triton" in variant,
                             DEVICE_SPEED=H100 if decided_by == "H100" else REFERENCE):  # decided at each forward
            got = count_ops(dense if variant == "dense" else compiled, loss_of)
        rows.append({"model": name, "variant": variant, **got})
        print(f"{name:12s} {variant:30s} {got['dispatched']:6d} dispatched  {got['kernel_like']:6d} kernel-like",
              flush=True)
    layers = sum(isinstance(m, TTLinear) for m in compiled.modules())
    dense_row = rows[0]
    for row in rows[1:]:   # what each TT linear adds to the step, against the dense model
        row["tt_layers"] = layers
        row["extra_dispatched_per_tt_layer"] = round((row["dispatched"] - dense_row["dispatched"]) / layers, 1)
        row["extra_kernel_like_per_tt_layer"] = round((row["kernel_like"] - dense_row["kernel_like"]) / layers, 1)

    def under_autocast(model):   # the forward and loss in bf16 autocast, the backward after it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_of(model)
    for variant, model in (("dense, bf16 autocast", dense), ("compiled, bf16 autocast", compiled)):
        got = count_ops(model, under_autocast)
        rows.append({"model": name, "variant": variant, **got})
        print(f"{name:12s} {variant:30s} {got['dispatched']:6d} dispatched  {got['kernel_like']:6d} kernel-like"
              f"  {got['casts']:4d} casts", flush=True)
    ranks = cut_every_layer(compiled)
    for variant, (group, pad_limit) in AFTER_CUTS.items():
        with tuning.override(GROUP_FACTORS=group, FACTOR_PAD_LIMIT=pad_limit):
            got = count_ops(compiled, loss_of)
            got["batched_merges"] = count_batches(compiled, loss_of) if group else 0
        rows.append({"model": name, "variant": variant, "distinct_ranks": len(set(ranks)), **got})
        print(f"{name:12s} {variant:30s} {got['dispatched']:6d} dispatched  {got['kernel_like']:6d} kernel-like"
              f"  ({got['batched_merges']} batched merges; {len(set(ranks))} distinct ranks in "
              f"{len(ranks)} layers)", flush=True)
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", choices=[*MODELS, "both"], default="both")
    ap.add_argument("--batch", type=int, default=2, help="samples per step (counts barely depend on it)")
    args = ap.parse_args()
    ops_as_on_cuda()
    # ranks planned for the reference CPU and thin products unless a variant says otherwise:
    # counts that do not depend on the host's measured speed -- nor on its timing of the ways
    # (runtime/ways/measured.py: on a GPU the ways are timed there; this host's timings of
    # ops forced to run as on CUDA would choose for neither), so the cost model's prior runs
    rows = []
    with tuning.override(DEVICE_SPEED=REFERENCE, WHOLE_MATRICES=False, MEASURE_WAYS=False):
        for name in (BOTH if args.model == "both" else [args.model]):
            rows += _count_model(name, args.batch)
    path = write_json("dispatch_llama.json" if args.model == "llama" else "dispatch.json", {"benchmark": "dispatch", "batch": args.batch, "native_kernels": False,
                                        "ops": "as on CUDA: GEMMs as torch.mm, padded batches by index",
                                        "rows": rows, **machine()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
