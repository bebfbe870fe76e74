"""Every tuned threshold of tncompile, in one place.

These numbers decide *how* things run (which kernel, which contraction order,
which layers are worth compressing), never *what* is computed: changing one
changes speed or size, not results. They were measured on the 2-core x86 CPUs
this project is developed on; the benchmark named beside each re-measures it.

Readers look them up at call time (``tuning.CHAIN_ROWS``), so a value set here
-- ``tncompile.tuning.CHAIN_ROWS = 8`` -- applies from the next call on. For a while
only, scope it: ``with tuning.override(TRITON_KERNELS=True, CHAIN_ROWS=8): ...`` puts
every value back on the way out, whatever happens inside (tinygrad's ``Context``).

This module sits below every other part of the package (it imports nothing
from tncompile), so the runtime and the compile-time planner can both read it.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

# ---------------------------------------------------------------- planning: cost model
#: Multiply-add equivalents of writing one element (forward and backward) in the
#: contraction cost ``flops + WRITE_WEIGHT * written + OP_OVERHEAD * kernels``.
WRITE_WEIGHT = 32.0
#: Multiply-add equivalents of one eager kernel (a GEMM or a permuted copy):
#: ~8 us of Python and dispatch at ~50 GMAC/s. At 20k the planner took orders with
#: more copies that measured 5-25% slower at 1 and 32 tokens; at 400k it picks the
#: faster order at every such point (``benchmarks/bench_layers.py``).
OP_OVERHEAD = 400_000.0
#: Networks of at most this many tensors are planned by cotengra's exact search;
#: larger ones by its hyper-optimizer with ``HYPER_REPEATS`` trials.
EXACT_SEARCH_MAX_TENSORS = 12
HYPER_REPEATS = 32

#: A compile stage (calibration, sensitivity, decomposition, planning, the passes) shows a
#: progress bar once it has run this many seconds (``passes/infra/progress.py``).
PROGRESS_DELAY = 2.0
#: ``compile(calibration=...)`` holds out every this-many-th sample of each batch (or every
#: this-many-th batch, when a batch has fewer samples) from the fit, to report the fitted
#: networks' error on inputs they were not fit to (the report's held-out column).
CALIBRATION_HOLD_OUT = 5
#: A calibrated fit whose layer saw fewer rows than this many times its input features (the
#: input moment is then poorly determined: a fit matches those inputs, not new ones), or
#: whose held-out error is over twice its fit error, is warned about (CalibrationWarning).
CALIBRATION_ROWS_PER_FEATURE = 2

# ---------------------------------------------------------------- compile: what to compress
#: Layers with fewer weights than this stay dense (``tensorize``).
MIN_LAYER_PARAMS = 4096
#: ``tensorize`` leaves a layer dense when its rank-1 network keeps more than this
#: share of the dense weight (too little to gain).
MAX_RANK1_RATIO = 0.5
#: ``assign_ranks`` caps every network at this share of its dense weight: up to where
#: a network still saves parameters, so a gentle ``target_ratio`` (0.7, 0.8: pretrained
#: models) is reachable; beyond it a dense layer is as small, exact and cheaper to run.
MAX_LAYER_RATIO = 0.9
#: Allocation by sensitivity gives no layer less than this share of the rank uniform
#: allocation would give it: the first-order estimate assumes a layer's error is spread
#: evenly over its outputs, so a layer read by a nearly low-rank one looked almost free to
#: cut (rank 1), then lost exactly the directions its reader needed (tests/test_pretrained.py).
SENSITIVITY_RANK_FLOOR = 0.5
#: Mode factorization: a padded size is allowed up to this share above the true size ...
MAX_MODE_PADDING = 0.25
#: ... and each unit of padding share costs this much against balance when choosing.
PAD_PENALTY = 0.1

# ---------------------------------------------------------------- compile: ranks
#: ``compile(prefer="speed")`` compares a TT network's training step with its dense
#: layer's over a batch of this many samples (unless ``batch_sizes`` names larger
#: ones), each with the rows per sample the layer saw when traced: the rank never
#: depends on the batch size the example inputs happened to have.
ASSUMED_ROWS = 32
#: The device speed ``prefer="speed"`` plans with (a
#: :class:`tncompile.planning.DeviceSpeed`): ``None`` measures the model's device once
#: and caches it (:func:`tncompile.planning.device_speed`); set one to plan for another
#: machine or to make ranks independent of the host (the test suite uses ``REFERENCE``).
DEVICE_SPEED = None
#: ``prefer="speed"`` gives a TT linear only ranks at which its training step is estimated
#: to take at most this share of its dense layer's: the estimate of a TT step runs 10-30%
#: below timed steps on 2-core x86 (eager; dense's within about 10% where the choice is
#: close), so at 1.0 near-ties went to TT and measured 4-7% slower (``bench_device_speed``).
SPEED_MARGIN = 0.85
#: ``compile`` warns (:class:`~tncompile.errors.SlowerThanDenseWarning`) when the compressed
#: layers' estimated training step is below this share of their dense layers' speed: the
#: estimates run 0.6-1.14x the timed steps (``bench_device_speed``), so only a clear loss.
SLOWER_WARNING_BELOW = 0.8
#: A layer that rule would cut to less than this share of the rank the budget gives it (or
#: that is slower at every rank) is *slow*: capping the README MLP's 2048 -> 10 head at 32
#: rows took it from rank 7 to 1, and the model's loss after ``fit`` from 0.19 to 1.54 ...
DENSE_BELOW_RANK_SHARE = 0.5
#: ... so slow layers keep their budget rank while all their estimated losses together stay
#: under this share of the dense step time of every layer judged (that head: 0.23 ms of
#: ~7.6 ms): a model does not get measurably slower for them ...
SPEED_SLACK = 0.05
#: ... and the others stay dense while their weights take at most this share of the
#: parameter budget (the networks keep the rest) and ``target_ratio`` stays reachable.
DENSE_FOR_SPEED_SHARE = 0.25

# ---------------------------------------------------------------- runtime: inference
#: In inference a TT linear multiplies by its two merged factors (two GEMMs) unless that
#: costs more than this many times the planned contraction's multiply-adds: the plan's
#: chain of small products pays a call per step, the factors two calls in all.
INFERENCE_MERGE_SLACK = 1.25
#: Multiply-add equivalents of reading one element of a table too large for the cache. An
#: inference head tied to a TTM embedding multiplies a few rows through two half tables
#: (GPT-2 at ratio 0.1: ~120M multiply-adds a row) where that costs less than reading the
#: merged 50257 x 768 table (38.6M elements; ``runtime.tied_head``). Measured at ~133 GMAC/s
#: (2-core x86, MKL): one row through the merged table 3.7 ms (~12 per element), 2-16 rows
#: 6.3-10.8 ms (~21: the GEMM packs the table), through the halves 0.9 ms a row. At 20 the
#: choice matched the faster form at 1-16 rows for bond ranks 124 and 305.
TABLE_READ_WEIGHT = 20.0

# ---------------------------------------------------------------- runtime: TT linear over few rows
#: Up to this many rows one native chain call beats the planned executor (chain time
#: over plan time, interleaved: 0.59-0.76 at 4 rows, 0.70-0.90 at 6, 0.78-1.04 at 8).
CHAIN_ROWS = 6
#: ... unless walking the cores in mode order costs this many times the plan's
#: multiply-adds (high ranks), plus a floor below which everything is overhead anyway.
CHAIN_FLOP_SLACK = 4
CHAIN_FLOP_FLOOR = 1 << 20

# ---------------------------------------------------------------- runtime: fused feed-forward
#: Below this many rows the hidden activation fits in cache anyway and the planned
#: orders (which need not merge the cores) win.
FUSE_MIN_ROWS = 256
#: Fuse only while merging the cores costs at most this many times the planned multiply-adds.
FUSE_FLOP_SLACK = 1.25

#: Budget left after growing ranks class by class (layers of the same modes together) is
#: spent on layers without a same-shaped peer, and then on single layers of a class (two
#: ranks for one shape) only while more than this share of it is left: within it, layers of
#: one shape keep one rank and merge their cores in one batch at run time. 0.1 is the
#: most ``target_ratio``'s contract allows ("within 10% below").
UNIFORM_RANK_SLACK = 0.1
#: Ranks of this many and more are multiples of :data:`RANK_ALIGNMENT` where the budget
#: allows it within :data:`UNIFORM_RANK_SLACK`: a TT linear's middle bond is the inner size
#: of the GEMMs its rows go through (``x A``, ``(x A) B``), and a bf16 GEMM whose inner or
#: outer size is not a multiple of 8 (16 bytes) misses the tensor cores' fast kernels
#: (an H200 run measured rank-155 layers slower as thin pairs than as whole matrices).
#: 1 turns alignment off.
RANK_ALIGNMENT = 8
ALIGN_RANKS_FROM = 32

# ---------------------------------------------------------------- runtime: merged factors
#: TT linears of one model that share their modes merge their cores into factors in one
#: batched pass per forward (:mod:`tncompile.runtime.layers.factor_groups`): a few kernels per
#: batch instead of a dozen per layer, forward and backward ...
GROUP_FACTORS = True
#: ... ranks aside: layers of the same modes and different ranks are batched with their
#: cores zero-padded to the largest rank at each bond while a batch's stacked cores hold at
#: most this many times the elements of its members' own (the padding's extra multiply-adds
#: are a few per cent of the layers' step at most: merging is weight-only work).
FACTOR_PAD_LIMIT = 3.0
#: A batch may merge into whole matrices instead (``W = A B``, one batched product): its
#: layers then run one GEMM over the rows each way, as a dense layer does, instead of two
#: thin ones -- where :func:`tncompile.planning.speed_model.whole_matrix_saving` estimates
#: that faster on the layers' device (kernels dearer than the extra multiply-adds: small
#: layers on a GPU). ``False``: never.
WHOLE_MATRICES = True
#: TT layers run on tncompile's Triton kernels: each TT linear as its merged factors through
#: one thin-pair launch forward and three backward (a dense linear's count; any row count:
#: :func:`tncompile.runtime.triton.thin_pair_train`), each family's merged factors in 3
#: kernels forward and 4 backward (:mod:`tncompile.runtime.triton.merge_factors`), each TTM
#: lookup from its merged halves in one launch each way (:mod:`~tncompile.runtime.triton.ttm_lookup`).
#: ``True``: all of that, on CUDA and on the CPU under ``TRITON_INTERPRET=1`` (how tests run
#: them). ``None`` (the default): on a GPU the Triton thin pair is one more candidate of each
#: TT linear's measured choice (:mod:`tncompile.runtime.ways.measured`), timed there against
#: the cuBLAS ways and kept only for the shapes where it wins (an H100 run found it slower on
#: the six-encoder's). ``False``: never.
TRITON_KERNELS = None

# ---------------------------------------------------------------- runtime: TTM lookup
#: Look up only the distinct ids when they are under this share of the batch ...
DEDUP_BELOW = 0.8
#: ... and only for batches of at least this many ids (``torch.unique`` costs more below).
DEDUP_MIN_IDS = 64

# ---------------------------------------------------------------- runtime: the CPU allocator
#: At the first CPU forward of a TT/TTM layer, make glibc keep freed memory for reuse
#: (``mallopt``: no ``mmap`` blocks, no trimming) -- process-wide and for the rest of the
#: process: big activations are not page-faulted back in every step (a 768->3072 layer over
#: 4,096 tokens: ~105 ms -> ~50 ms a step on 2 cores), but the process keeps its peak heap.
#: False (or ``TNCOMPILE_RETAIN_FREED_MEMORY=0``), set before that forward, leaves glibc as
#: it is. ``compiled.report(inputs)`` says which applies (runtime/kernels/cpu_allocator.py).
RETAIN_FREED_MEMORY = True

# ---------------------------------------------------------------- runtime: measured ways
#: Flush subnormal floats to zero on every intra-op thread while a compressed model's
#: forward and backward run on the CPU (runtime/kernels/denormals.py): x86 cores compute
#: subnormals 10-100x slower; the caller's own state is put back after each.
FLUSH_DENORMALS = True
#: Choose among a layer's correct ways by timing them, once per shape, bucket of rows,
#: dtype and device (runtime/ways/measured.py); off: the cost model's prior alone.
MEASURE_WAYS = True
#: Timed runs per candidate (after one warm-up); the fastest run counts. A race: after each
#: round only candidates within ``MEASURE_RACE_SLACK`` of the fastest so far run again.
MEASURE_REPEATS = 3
#: A candidate slower than the fastest by more than this factor drops out of the race
#: (after the warm-up, by ``MEASURE_WARMUP_SLACK``: first calls carry one-time costs).
MEASURE_RACE_SLACK = 1.3
MEASURE_WARMUP_SLACK = 4.0
#: The race stops once the ways still in it are within this factor of the fastest: which of
#: them wins changes that op's time by less than the timing's own noise.
MEASURE_TIE = 1.05
#: A candidate whose warm-up run takes longer than this many seconds is timed by that run
#: alone (a vocabulary-wide head: its time is not noise-sized, and repeating it would cost
#: the first step many seconds).
MEASURE_LONG_S = 0.25
#: When measuring ways has taken this many seconds in a process, one line on stderr says
#: what the first steps are spending their time on, and how to keep it for later runs.
MEASURE_NOTICE_S = 2.0
#: ``compile(linear_cores="measured")``: timed forward + backward runs per candidate layout
#: (after one warm-up; the median counts), and how much slower than the fastest a candidate
#: may be and still win on a better held-out fit (with calibration data)
CORE_CHOICE_REPEATS = 5
CORE_CHOICE_TIME_SLACK = 1.1
#: ``compile(batch_sizes=...)`` times a layer's ways ahead only where the timing's tensors
#: (input and output rows, and their gradients) take at most this many bytes; larger
#: batches are timed on first use, on the user's own input.
MEASURE_AHEAD_BYTES = 256 << 20
#: ``tncompile.compile`` hands back a model whose calls replay CUDA graphs in the user's own
#: loop (``tncompile.graph_calls``: each input signature dry-run on fake tensors before its
#: capture, eager off the GPU and wherever a graph cannot serve). Off until a GPU run has
#: passed its CUDA tests and measured it faster. Env: ``TNCOMPILE_GRAPH_CALLS=1``.
GRAPH_CALLS = os.environ.get("TNCOMPILE_GRAPH_CALLS", "0").strip().lower() not in ("0", "", "false", "no", "off")
#: ``TrainStep(compile="auto")``: whole training steps timed per way (the model as it is,
#: and through ``torch.compile``) once each way has settled; the lower median serves.
STEP_MEASURE_STEPS = 3
#: A TTM lookup's whole merged table is a candidate way (one product, then an index) only
#: while the table has at most this many times the rows the call looks up: beyond that,
#: merging rows nobody asked for costs more than the gathers it saves.
WHOLE_TABLE_SLACK = 4
#: A folder for the measured winners (one JSON file per torch and tncompile version),
#: read by later processes; ``None``: this process only. Env: ``TNCOMPILE_WAY_CACHE``.
WAY_CACHE_DIR = os.environ.get("TNCOMPILE_WAY_CACHE") or None

# ---------------------------------------------------------------- runtime: CPU GEMM layouts
#: Multiply-adds below which a GEMM is all call overhead: no layout tricks.
GEMM_TINY = 1 << 18
#: An output this narrow (or narrower) makes CPU GEMM kernels layout-sensitive:
#: a row-major right operand is copied column-major (2x faster).
GEMM_SKINNY = 16
#: Up to this many output columns, ``x.T @ g`` runs faster as ``(g.T @ x).T``.
GEMM_THIN = 64
#: fp32 lanes of a 512-bit register: MKL's column blocking on AVX-512.
GEMM_VECTOR = 16
#: A contracted (expand) or output (project) size up to this goes to the native thin kernels ...
THIN_RANK = 64
#: ... when the wide matrix has at least this many elements
#: (``benchmarks/bench_gemm_shapes.py``: 1.03-2.9x over MKL at 47 of 48 points).
THIN_OUTPUT = 1 << 18
#: A weight gradient ``t.T @ x`` with at most this many output rows (a core block's rank)
#: and a contraction over at least ``WEIGHT_GRAD_MIN_K`` rows runs the native kernel: 4096
#: rows into 768 / 3072 columns, MKL over native 1.30x / 1.25x at r = 35, 1.65x at r = 8;
#: at r = 64 ``(x.T @ t).T`` is faster still (2.9 ms against 3.8 native, 4.4 ``mm``).
WEIGHT_GRAD_ROWS = 48
WEIGHT_GRAD_MIN_K = 1024
#: Output elements from which a bias riding in the GEMM beats a separate pass (4 MB).
BIG_OUTPUT = 1 << 20
#: A weight gradient's few output rows: these counts run as the next size up
#: (9-11 rows: 11-12 ms vs 7-9 ms as 12, at K = 4096, N = 3072) ...
GEMM_ROW_PADDING = {5: 8, 6: 8, 7: 8, 9: 12, 10: 12, 11: 12}
#: ... when ``K * N`` is at least this.
GEMM_ROW_PADDING_MIN_KN = 1 << 20
#: Thin outputs are padded to a multiple of 8 columns (16 below 16) for matrices
#: of at least this many rows and contracted size (``gemm_columns.json``: 1.1-2.0x).
GEMM_COLUMN_PADDING_MIN = 256


# ---------------------------------------------------------------- scoped values
@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set tuned values for the body, then put the previous ones back (also on an error).

    ``with tuning.override(GROUP_FACTORS=False, WHOLE_MATRICES=False): compile(...)``.
    A name that is not one of this module's values is a ``KeyError`` naming the known ones
    like it; nested overrides restore in order."""
    module = sys.modules[__name__]
    unknown = [name for name in values if not (name.isupper() and hasattr(module, name))]
    if unknown:
        close = sorted(n for n in dir(module) if n.isupper() and n.split("_")[0] == unknown[0].split("_")[0])
        raise KeyError(f"tuning.override: {unknown[0]!r} is not a tuned value of tncompile.tuning"
                       + (f" (like it: {close[:6]})" if close else ""))
    previous = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)
