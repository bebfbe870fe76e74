"""Every GPU figure in one run: each model x training path x batch, compressed against dense.

    python benchmarks/bench_gpu.py [--budget-s 420] [--out benchmarks/results/gpu.json]
                                   [--models six-encoder small-bert gpt2] [--batches 1 8 32 128]
                                   [--paths eager captured ...]
    python benchmarks/bench_gpu.py --table benchmarks/results/gpu.json   # a run as markdown tables

Issue 42's one script. Models: the paper's six-encoder at CoMERA's 1/44.9 (sequence 128,
3-class cross-entropy), the hidden-128 2-layer ``BertModel`` at 0.3 (64 ids a sample, mean
square of the last hidden state) and the 256-wide 4-layer GPT-2 at 0.3 (64 ids, its LM
loss), all compiled with the defaults. Each is built dense and compiled once per batch and
every path is timed on that pair, dense and compressed interleaved (round-robin, one step of
each per round, up to a synchronize):

``eager``             the plain loop: forward, loss, backward, ``AdamW.step()``, ``zero_grad``
``captured``          ``tncompile.TrainStep(cuda_graph=True)`` (what ``fit`` runs on a GPU)
``bf16``              ``TrainStep(amp="bf16", cuda_graph=False)``: bf16 autocast, fp32 master weights
``bf16-captured``     the same, captured
``compile``           the plain loop over ``torch.compile(model)``
``compile-ro``        the plain loop over ``torch.compile(model, mode="reduce-overhead")``
``trainer``           ``transformers.Trainer`` (HF models), time between ``on_step_end`` calls
``trainer-compile``   the same with ``TrainingArguments(torch_compile=True)``
``amp-eager``         the plain loop with forward and loss under bf16 autocast (the Llamas)
``amp-graphed``       the same loop over ``tncompile.graph_calls(model)``: the model's calls
                      replayed from CUDA graphs per signature (dense and compressed alike)
``amp-compile``       the autocast loop over ``torch.compile(model)``
``amp-compile-captured`` ``TrainStep(amp="bf16", cuda_graph=True, compile=True)``: the compiled
                      model's step captured (the best compiled step a user gets)
``amp-autotune``      the autocast loop over ``torch.compile(model, mode="max-autotune-no-cudagraphs")``
``bf16w-*``           the model's weights in bf16 (no autocast): eager, captured, compiled

On a GPU, the rows of the first six paths also time ``triton``: the compressed model on
tncompile's Triton kernels (``tuning.TRITON_KERNELS``: the thin pair per layer with a
feed-forward block's activation in its epilogue, the batched merge per family, the TTM
gather and scatter; under ``torch.compile`` the thin pair only), interleaved with the other
two.

Beside each time: the host's time until a step call returns (CUDA runs asynchronously:
where it is near the step's time, the host's dispatch is the step). ``kernels`` rows profile
one eager step of each model (``torch.profiler``: kernels per step, their summed GPU time;
every kernel by name with calls, µs and achieved GB/s and TFLOP/s against the device's
measured copy bandwidth and GEMM peak, bytes and FLOPs attributed from the op that launched
it: ``bench_gpu_kernels.kernel_rows``).
The ``kernels`` rows of compressed models also carry ``compiled.report(inputs)``'s measured
mean per layer (``layer_host_us`` / ``dense_layer_host_us``: one layer's forward + backward
until the calls return, against a dense layer of its shape; ``*_wall_us`` to completion).
``memory`` rows build one model at a time at batch 1 and record the peak allocated while
building it, what stays allocated, and the peak over warm-up and training steps: dense,
compressed eager and captured, and dense with GaLore (when
``galore-torch`` is installed: ``common.galore_optimizer``).

Jobs run in priority order (the issue's targets first) while ``--budget-s`` lasts; a job
not started is written as ``skipped``, one that fails keeps its error and the run goes on.
``--jobs`` picks jobs by label and ``--merge`` adds their rows to an earlier run's JSON
(``merged_from`` records that run's device and speed: compare rows of one device only).
The JSON is rewritten after every row, so a run cut short keeps what it measured. It
records the GPU's name, torch/CUDA/Triton versions, clocks (``nvidia-smi``) and the
device's copy bandwidth and GEMM throughput. CPU runs (``--device cpu``) exercise the
script; captured paths are CUDA-only.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
from collections import Counter
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import tncompile
from tncompile import tuning
from tncompile.train import TrainStep
from tncompile.runtime import TTLinear
from tncompile.runtime.triton import runs_triton, thin_pair_train
from tncompile.testing import six_encoder

from common import RESULTS, galore_optimizer, interleaved_ms, machine, parser, write_result

PAPER_RATIO = 1 / 44.9
PATHS = ("eager", "captured", "bf16", "bf16-captured", "compile", "compile-ro", "trainer", "trainer-compile",
         "amp-eager", "amp-graphed", "amp-compile", "amp-compile-captured", "amp-autotune",
         "bf16w-eager", "bf16w-captured", "bf16w-compile")
CUDA_ONLY = {"captured", "bf16-captured", "compile-ro", "bf16w-captured", "amp-graphed", "amp-compile-captured"}
#: the wide workload's paths: bf16 autocast and pure bf16 weights, eager / captured first
LLAMA_FAST = ("amp-eager", "bf16-captured", "amp-graphed", "bf16w-eager", "bf16w-captured")
#: then torch.compile: the plain loop, the compiled TrainStep captured (the best compiled step
#: a user gets), pure bf16, and inductor's max-autotune (longest to compile: last)
LLAMA_COMPILING = ("amp-compile", "amp-compile-captured", "bf16w-compile", "amp-autotune")
#: paths also timed with tncompile's Triton kernels (``triton_ms``), every model
TRITON_PATHS = ("eager", "captured", "bf16", "bf16-captured", "compile", "compile-ro")


# ---------------------------------------------------------------- models
#: Llama-style decoders (``LlamaForCausalLM``, SDPA attention, 32k vocabulary, untied head):
#: name -> (hidden, layers, FFN, heads, sequence). ``llama-tiny`` exercises the script on a CPU.
LLAMA = {"llama-1b": (2048, 16, 5632, 16, 1024), "llama-350m": (1024, 24, 2816, 16, 1024),
         "llama-tiny": (128, 2, 344, 4, 64)}
MODELS = ("six-encoder", "small-bert", "gpt2", *LLAMA)


class Workload:
    """One model at one batch (and, for the Llamas, one ratio): inputs, targets, loss and a
    builder (dense or compiled)."""

    def __init__(self, name: str, batch: int, device: torch.device, ratio: float | None = None):
        self.name, self.batch, self.device = name, batch, device
        g = torch.Generator().manual_seed(0)
        if name == "six-encoder":
            self.hf, self.ratio = False, PAPER_RATIO
            self.x = torch.randint(1, 30522, (batch, 128), generator=g).to(device)
            self.y = torch.randint(0, 3, (batch,), generator=g).to(device)
            self.loss_fn = F.cross_entropy
        elif name in LLAMA:
            self.hf, self.ratio = True, 0.1 if ratio is None else ratio
            ids = torch.randint(0, 32000, (batch, LLAMA[name][4]), generator=g).to(device)
            self.x, self.y, self.loss_fn = {"input_ids": ids, "labels": ids}, None, _lm_loss
        else:
            self.hf, self.ratio = True, 0.3
            ids = torch.randint(0, 1000, (batch, 64), generator=g).to(device)
            self.x = {"input_ids": ids} if name == "small-bert" else {"input_ids": ids, "labels": ids}
            self.y = None
            self.loss_fn = _hidden_square if name == "small-bert" else _lm_loss

    def build(self, compiled: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        if self.name == "six-encoder":
            model = six_encoder().to(self.device)
            if compiled:
                model = tncompile.compile(model, target_ratio=PAPER_RATIO, init="random",
                                          batch_sizes=[self.batch * 128])
            return model.to(self.device).train()
        if self.name in LLAMA:
            return self._build_llama(compiled)
        from bench_small_models import FAMILIES  # noqa: PLC0415 - transformers, HF models only
        model = FAMILIES["bert" if self.name == "small-bert" else "gpt2"](64)[1].train().to(self.device)
        if compiled:
            model = tncompile.compile(model, target_ratio=0.3, example_inputs=self.x).train()
        return model

    def _build_llama(self, compiled: bool) -> torch.nn.Module:
        import transformers  # noqa: PLC0415
        transformers.logging.set_verbosity_error()
        hidden, layers, ffn, heads, sequence = LLAMA[self.name]
        config = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=sequence,
            attn_implementation="sdpa", use_cache=False)   # training: no KV cache in the outputs
        with torch.device(self.device):
            model = transformers.LlamaForCausalLM(config)
        if compiled:   # a short example: swap mode keeps every batch and length
            example = self.x["input_ids"][:2, :16].expand(2, 16).contiguous()
            model = tncompile.compile(model, target_ratio=self.ratio, init="random",
                                      example_inputs={"input_ids": example, "labels": example})
        return model.train()

    def forward_loss(self, model) -> torch.Tensor:
        out = model(**self.x) if self.hf else model(self.x)
        return self.loss_fn(out, self.y)


def _hidden_square(out, _targets):
    return out.last_hidden_state.square().mean()


def _lm_loss(out, _targets):
    return out.loss


# ---------------------------------------------------------------- paths
def _plain_loop(work: Workload, model, compile_mode: str | None, amp: bool = False) -> Callable[[], None]:
    """forward, loss, backward, AdamW step, zero_grad -- optionally over torch.compile(model),
    optionally with the forward and loss under bf16 autocast (what a user's own loop does)."""
    run = model if compile_mode is None else torch.compile(model, mode=compile_mode)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    device_type = work.device.type

    def step() -> None:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp):
            loss = work.forward_loss(run)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _train_step(work: Workload, model, captured: bool, amp: str | None,
                compile_model: bool = False) -> Callable[[], None]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    step = TrainStep(model, opt, work.loss_fn, cuda_graph=captured, amp=amp, compile=compile_model)
    return lambda: step(work.x, work.y)


def step_functions(work: Workload, path: str, model) -> Callable[[], None]:
    """``path``'s training step over ``model`` (``bf16w-*`` paths expect bf16 weights)."""
    if path in ("eager", "amp-eager", "bf16w-eager"):
        return _plain_loop(work, model, None, amp=path == "amp-eager")
    if path == "amp-graphed":   # the same plain loop, the model's calls replayed from CUDA graphs
        return _plain_loop(work, tncompile.graph_calls(model), None, amp=True)
    if path in ("compile", "amp-compile", "bf16w-compile"):
        return _plain_loop(work, model, "default", amp=path == "amp-compile")
    if path == "amp-autotune":   # inductor autotunes the GEMMs and fused kernels on this device
        return _plain_loop(work, model, "max-autotune-no-cudagraphs", amp=True)
    if path == "amp-compile-captured":
        return _train_step(work, model, captured=True, amp="bf16", compile_model=True)
    if path == "compile-ro":
        return _plain_loop(work, model, "reduce-overhead")
    if path == "bf16w-captured":
        return _train_step(work, model, captured=True, amp=None)
    return _train_step(work, model, captured=path.endswith("captured"), amp="bf16" if "bf16" in path else None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_ms(fn: Callable[[], None], device: torch.device, calls: int = 5) -> float:
    """Median time until a step call returns (the host's share; CUDA runs on behind it)."""
    times = []
    for _ in range(calls):
        _sync(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    _sync(device)
    return 1000 * statistics.median(times)


def trainer_ms(work: Workload, model, compile_model: bool, steps: int) -> tuple[float, str]:
    """Median ms between ``on_step_end`` calls of ``transformers.Trainer`` (after 3 steps),
    and the class of the module Trainer ran (``OptimizedModule`` when it compiled)."""
    import transformers  # noqa: PLC0415
    transformers.logging.set_verbosity_error()

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.stamps = []

        def on_step_end(self, args, state, control, **kwargs):
            _sync(work.device)
            self.stamps.append(time.perf_counter())

    ids = work.x["input_ids"].cpu()
    rows = [{"input_ids": ids[i], "labels": ids[i]} for i in range(ids.shape[0])] * (steps + 4)
    clock = Clock()
    saved_env = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_DYNAMO")}
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=work.batch, max_steps=steps + 4, learning_rate=1e-5,
            report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, torch_compile=compile_model, use_cpu=work.device.type == "cpu")
        loss = (lambda out, labels, num_items_in_batch=None: _hidden_square(out, None)) \
            if work.name == "small-bert" else None
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[clock],
                                       compute_loss_func=loss)
        trainer.train()
    for key in [k for k in os.environ if k.startswith("ACCELERATE_DYNAMO")]:  # torch_compile=True sets them
        del os.environ[key]
    os.environ.update(saved_env)
    gaps = [b - a for a, b in zip(clock.stamps[3:], clock.stamps[4:])]
    return 1000 * statistics.median(gaps), type(trainer.model_wrapped).__name__


# ---------------------------------------------------------------- jobs
def out_of_time() -> bool:
    return time.monotonic() > DEADLINE


def time_paths(work: Workload, paths: list[str], reps: int, emit) -> None:
    """Build dense and compiled once, then time each path on the pair (interleaved)."""
    models = {"dense": work.build(False), "compressed": work.build(True)}
    layers = sum(isinstance(m, TTLinear) for m in models["compressed"].modules())
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    in_bf16 = False
    for path in sorted(paths, key=lambda p: p.startswith("bf16w")):   # weights become bf16 once, last
        row = {"model": work.name, "batch": work.batch, "path": path, "ratio": round(work.ratio, 4),
               "tt_layers": layers, "dense_params": params["dense"], "compressed_params": params["compressed"]}
        if path.startswith("bf16w") and not in_bf16:
            for m in models.values():
                m.to(torch.bfloat16)
            in_bf16 = True
        if out_of_time():
            emit({**row, "skipped": "budget"})
            continue
        try:
            if path.startswith("trainer"):
                ms = {}
                for k, m in models.items():
                    ms[k], row[f"{k}_trainer_runs"] = trainer_ms(work, m, path == "trainer-compile", reps)
            else:
                fns = {k: step_functions(work, path, m) for k, m in models.items()}
                fns.update(_triton_variant(work, path, models["compressed"], row))
                ms = interleaved_ms(fns, reps=reps, warmup=3, device=work.device)
                row.update({f"{k}_host_ms": round(host_ms(fn, work.device), 3) for k, fn in fns.items()})
            row.update(dense_ms=round(ms["dense"], 3), compressed_ms=round(ms["compressed"], 3),
                       speed_vs_dense=round(ms["dense"] / ms["compressed"], 3))
            if "triton" in ms:
                row.update(triton_ms=round(ms["triton"], 3), triton_speed_vs_dense=round(ms["dense"] / ms["triton"], 3))
            if "compressed_host_ms" in row and layers:
                row["extra_host_ms_per_tt_layer"] = round(
                    (row["compressed_host_ms"] - row["dense_host_ms"]) / layers, 4)
            ran = Counter(getattr(getattr(m, "ran_as", None), "value", "not run")
                          for m in models["compressed"].modules() if isinstance(m, TTLinear))
            row["ran_as"] = dict(ran)   # the way each TT linear's last eager call ran
            if "triton_host_ms" in row and layers:
                row["triton_extra_host_ms_per_tt_layer"] = round(
                    (row["triton_host_ms"] - row["dense_host_ms"]) / layers, 4)
        except Exception as e:  # noqa: BLE001 - one failing path must not end the run
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        emit(row)
        for m in models.values():   # a graphed path's wrapping ends with it
            tncompile.ungraph_calls(m)
        torch._dynamo.reset()
        gc.collect()
        if work.device.type == "cuda":
            torch.cuda.empty_cache()


def _with_triton_kernels(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with ``tuning.TRITON_KERNELS`` on for its call (a captured step captures them)."""
    def call() -> None:
        with tuning.override(TRITON_KERNELS=True):
            step()
    return call


def _triton_variant(work: Workload, path: str, compressed, row: dict) -> dict[str, Callable[[], None]]:
    """``{"triton": step}``: the compressed model on tncompile's Triton kernels
    (``tuning.TRITON_KERNELS``), timed beside dense and the default path, where a GPU runs
    Triton; one trial call first (a failure is recorded in ``row`` and leaves the others)."""
    if path not in TRITON_PATHS or not runs_triton(torch.empty(0, device=work.device)):
        return {}
    try:
        step = _with_triton_kernels(step_functions(work, path, compressed))
        step()
        return {"triton": step}
    except Exception as e:  # noqa: BLE001 - the default path's figures still count
        row["triton_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        return {}


def profile_kernels(work: Workload, emit) -> None:
    """Kernels per eager step and their summed GPU time (torch.profiler), each model alone
    (the Llamas in bf16 autocast, the others in fp32): by kind; every kernel by name (Triton's
    too) with calls, µs, and achieved GB/s and TFLOP/s against the device's measured copy
    bandwidth and bf16 (Llamas) or fp32 GEMM peak; and each matrix-product op's TFLOP/s. The six-encoder and the small models also run on tncompile's Triton
    kernels."""
    from bench_gpu_kernels import profile_step  # noqa: PLC0415
    amp = work.name in LLAMA
    peak = PEAKS.get("bf16_gemm_tflop_per_s" if amp else "gemm_tflop_per_s")
    kinds = ("dense", "compressed") if amp else ("dense", "compressed", "compressed triton")
    for kind in kinds:
        row = {"model": work.name, "batch": work.batch, "ratio": round(work.ratio, 4), "path": "kernels",
               "variant": kind, "amp": amp}
        try:
            model = work.build(kind != "dense")
            step = _plain_loop(work, model, None, amp=amp)
            if kind == "compressed triton":
                step = _with_triton_kernels(step)
            for _ in range(3):
                step()
            result = profile_step(lambda _x, _y, step=step: step(), None, None, steps=3, peak_tflops=peak,
                                  peak_gb_s=PEAKS.get("copy_gb_per_s"))
            row.update(kernels_per_step=result["kernels_per_step"],
                       gpu_ms_per_step=round(result["gpu_ms_per_step"], 3), by_kind=result["by_kind"],
                       kernels=result["kernels"], matmul_ops=result["matmul_ops"])
            if kind != "dense" and not amp:   # compiled.report(inputs): a layer's fwd+bwd host time vs dense
                with tuning.override(TRITON_KERNELS=True if kind == "compressed triton" else None):
                    measured = model.report(work.x, steps=5).measured
                if measured is not None:
                    row.update(layer_host_us=round(1e6 * measured.host / measured.layers, 1),
                               dense_layer_host_us=round(1e6 * measured.dense_host / measured.layers, 1),
                               layer_wall_us=round(1e6 * measured.wall / measured.layers, 1),
                               dense_layer_wall_us=round(1e6 * measured.dense_wall / measured.layers, 1))
            del model, step
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        emit(row)
        gc.collect()
        if work.device.type == "cuda":
            torch.cuda.empty_cache()


#: memory variants -> (compiled, step path or "galore" / "galore-amp"): fp32 models, then
#: the Llamas in bf16 autocast
MEMORY_VARIANTS = {"dense eager": (False, "eager"), "compressed eager": (True, "eager"),
                   "compressed captured": (True, "captured"), "dense GaLore": (False, "galore")}
LLAMA_MEMORY_VARIANTS = {"dense amp-eager": (False, "amp-eager"), "compressed amp-eager": (True, "amp-eager"),
                         "compressed bf16-captured": (True, "bf16-captured"),
                         "dense GaLore amp": (False, "galore-amp")}


def memory_row(work: Workload, variant: str) -> dict:
    """One memory row, measured in a process that has done nothing else on the device:
    ``build_peak_mb`` is the peak while building (and compiling) the model, ``resident_mb``
    what stays allocated after, and ``peak_mb`` the peak over 3 warm-up and 3 more training
    steps (optimizer state and a capture included)."""
    compiled, how = {**MEMORY_VARIANTS, **LLAMA_MEMORY_VARIANTS}[variant]
    row = {"model": work.name, "batch": work.batch, "ratio": round(work.ratio, 4), "path": "memory",
           "variant": variant}
    torch.cuda.reset_peak_memory_stats()
    model = work.build(compiled)
    gc.collect()
    row.update(build_peak_mb=round(torch.cuda.max_memory_allocated() / 2**20, 1),
               resident_mb=round(torch.cuda.memory_allocated() / 2**20, 1))
    torch.cuda.reset_peak_memory_stats()
    if how.startswith("galore"):
        step = TrainStep(model, galore_optimizer(model), work.loss_fn, cuda_graph=False,
                         amp="bf16" if how == "galore-amp" else None)
        fn = lambda: step(work.x, work.y)  # noqa: E731
    else:
        fn = step_functions(work, how, model)
    for _ in range(6):
        fn()
    _sync(work.device)
    row["peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return row


def peak_memory(work: Workload, emit, parallel: int = 2) -> None:
    """Each memory variant in its own fresh process (GPU memory left by earlier jobs must not
    count), ``parallel`` at a time: a process's allocator counts only its own memory."""
    variants = LLAMA_MEMORY_VARIANTS if work.name in LLAMA else MEMORY_VARIANTS
    pending = list(variants)
    while pending:
        batch, pending = pending[:parallel], pending[parallel:]
        procs = {name: subprocess.Popen(
            [sys.executable, __file__, "--device", str(work.device), "--memory-row", work.name, str(work.batch),
             str(work.ratio), name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in batch}
        for name, proc in procs.items():
            row = {"model": work.name, "batch": work.batch, "ratio": round(work.ratio, 4), "path": "memory",
                   "variant": name}
            try:
                out, err = proc.communicate(timeout=300)
                lines = [line for line in out.splitlines() if line.startswith("{")]
                row = json.loads(lines[-1]) if proc.returncode == 0 and lines else \
                    {**row, "error": f"exit {proc.returncode}: {err[-400:]}"}
            except subprocess.TimeoutExpired:
                proc.kill()
                row["error"] = "timed out after 300 s"
            emit(row)


def thin_pair_kernel(batch: int, emit) -> None:
    """The Triton thin-pair kernel (``tncompile::thin_pair``) against the same product as two
    GEMMs and an add, per distinct TT linear of the compiled six-encoder at ``batch x 128``
    rows: forward, and forward + backward (``thin_pair_train``: what TTLinear runs with
    ``tuning.TRITON_KERNELS``)."""
    compiled = tncompile.compile(six_encoder(), target_ratio=PAPER_RATIO, init="random").to(DEV)
    seen = set()
    for name, layer in compiled.tensorized_modules().items():
        if not isinstance(layer, TTLinear) or layer.layout in seen:
            continue
        seen.add(layer.layout)
        with torch.no_grad():
            a, b = (t.detach().contiguous() for t in layer.merged_factors())
        x = torch.randn(batch * 128, a.shape[0], device=DEV, requires_grad=True)
        bias = torch.zeros(b.shape[1], device=DEV)
        dy = torch.randn(x.shape[0], b.shape[1], device=DEV)
        fns = {"triton": lambda: thin_pair_train(x, a, b, bias), "gemms": lambda: (x @ a) @ b + bias}
        fwd = interleaved_ms(fns, reps=REPS, warmup=3, device=DEV)
        both = interleaved_ms({k: (lambda f=f: f().backward(dy)) for k, f in fns.items()}, reps=REPS, warmup=3,
                              device=DEV)
        emit({"model": "six-encoder", "path": "thin-pair kernel", "variant": name, "batch": batch,
              "in": a.shape[0], "rank": a.shape[1], "out": b.shape[1], "triton_ran": runs_triton(x),
              "forward_ms": {k: round(v, 4) for k, v in fwd.items()},
              "forward_backward_ms": {k: round(v, 4) for k, v in both.items()}})


def linear_ways_at_rows(work: Workload, emit) -> None:
    """Each distinct TT linear of the compressed model at the workload's rows (the Llamas:
    bf16 autocast, fp32 rows in, as their norms hand them over): every row way timed alone
    as the measured choice times it (forward, then the parameters' backward by
    ``autograd.grad``: ``ways.linear._timer``), against the dense ``nn.Linear`` of its shape
    timed the same way; and the same layout with its bonds rounded up to a multiple of 16,
    where the tensor cores' tiles want them (a thin pair's middle bond is a GEMM's K or N)."""
    from tncompile.runtime.ways import linear as linear_ways  # noqa: PLC0415
    from tncompile.runtime.ways import measured  # noqa: PLC0415
    from tncompile.runtime.ways.linear import LinearWay  # noqa: PLC0415
    amp = work.name in LLAMA
    rows = work.x["input_ids"].numel() if work.hf else work.x.numel()
    compiled = work.build(True)
    seen = set()
    from tncompile.runtime.ways import backends  # noqa: PLC0415
    ways = (LinearWay.PLANNED, LinearWay.THIN_PAIR, LinearWay.WHOLE_MATRIX)
    if backends.candidate(torch.empty(0, device=work.device), "thin_pair") is not None:
        ways += (LinearWay.TRITON_PAIR,)   # Triton's thin pair, a measured candidate on a GPU
    for name, layer in compiled.named_modules():
        lay = getattr(layer, "layout", None)
        if not isinstance(layer, TTLinear) or (lay.in_modes, lay.out_modes, lay.ranks) in seen:
            continue
        seen.add((lay.in_modes, lay.out_modes, lay.ranks))
        aligned = TTLinear(lay.with_ranks(tuple(-(-r // 16) * 16 for r in lay.ranks)),
                           bias=layer.bias is not None).to(work.device)
        row = {"model": work.name, "batch": work.batch, "ratio": round(work.ratio, 4), "path": "linear ways",
               "variant": name, "rows": rows, "in": lay.in_features, "out": lay.out_features,
               "ranks": list(lay.ranks), "aligned_ranks": list(aligned.layout.ranks)}
        try:
            like = torch.empty(0, device=work.device)
            dense = torch.nn.Linear(lay.in_features, lay.out_features, bias=layer.bias is not None,
                                    device=work.device)
            x = torch.randn(rows, lay.in_features, device=work.device)
            with torch.autocast(work.device.type, dtype=torch.bfloat16, enabled=amp):
                for label, tt in (("ms", layer), ("aligned_ms", aligned)):
                    time_way = linear_ways._timer(tt, like, rows, None, True)
                    row[label] = {w.value: round(1e3 * time_way(w.value), 4) for w in ways}

                def dense_step() -> None:
                    out = dense(x)
                    torch.autograd.grad(out, list(dense.parameters()), torch.ones_like(out))
                row["dense_ms"] = round(1e3 * measured.time_call(dense_step, work.device), 4)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        emit(row)


def jobs(models: list[str], batches: list[int], paths: list[str], cuda: bool):
    """(label, callable(emit)) in priority order: the issue's targets first, torch.compile
    (tens of seconds of compiling per model) after every path that compiles nothing."""
    fast = [p for p in ("eager", "captured", "bf16", "bf16-captured") if p in paths]
    compiling = [p for p in ("compile", "compile-ro", "trainer-compile") if p in paths]
    small = [m for m in ("small-bert", "gpt2") if m in models]
    six = "six-encoder" in models
    order = [b for b in (1, 32, 128, 8) if b in batches] + [b for b in batches if b not in (1, 8, 32, 128)]
    first = 32 if 32 in batches else order[0]
    out = []

    def timed(model: str, batch: int, chosen: list[str], ratio: float | None = None) -> None:
        if chosen:
            at = "" if ratio is None else f" r{ratio}"
            out.append((f"{model}{at} b{batch} {chosen}", lambda emit: time_paths(
                Workload(model, batch, DEV, ratio), chosen, REPS, emit)))

    # the wide workload first: the first Llama named at 0.1 and 0.05, its memory, the others
    # at 0.1; then their torch.compile paths and a kernel profile
    llamas = [m for m in models if m in LLAMA]
    llama_fast = [p for p in LLAMA_FAST if p in paths]
    llama_compiling = [p for p in LLAMA_COMPILING if p in paths]
    for i, m in enumerate(llamas):
        if i == 0:   # what each way of each distinct layer costs at these rows (a few seconds)
            out.append((f"{m} linear ways b{LLAMA_BATCH}", lambda emit, m=m: linear_ways_at_rows(
                Workload(m, LLAMA_BATCH, DEV, 0.1), emit)))
        timed(m, LLAMA_BATCH, llama_fast, 0.1)
        if i == 0 and cuda:   # batch 1 is small: four processes at once
            for b, parallel in ((1, 4), (LLAMA_BATCH, 2)):
                out.append((f"{m} memory b{b}", lambda emit, m=m, b=b, parallel=parallel: peak_memory(
                    Workload(m, b, DEV, 0.1), emit, parallel)))
        if i == 0:
            timed(m, LLAMA_BATCH, llama_fast, 0.05)
    for m in llamas[:1]:
        if cuda:
            out.append((f"{m} kernels b{LLAMA_BATCH}",
                        lambda emit, m=m: profile_kernels(Workload(m, LLAMA_BATCH, DEV, 0.1), emit)))
        timed(m, LLAMA_BATCH, llama_compiling, 0.1)
    for m in llamas[1:]:
        timed(m, LLAMA_BATCH, llama_compiling, 0.1)
    for b in order[:3] if six else []:
        timed("six-encoder", b, fast)
    if six and cuda and 1 in batches:
        out.append(("six-encoder kernels b1", lambda emit: profile_kernels(Workload("six-encoder", 1, DEV), emit)))
        out.append(("six-encoder memory b1", lambda emit: peak_memory(Workload("six-encoder", 1, DEV), emit)))
    for m in small:
        timed(m, first, fast + (["trainer"] if "trainer" in paths else []))
    for m in small if cuda else []:
        out.append((f"{m} kernels b{first}", lambda emit, m=m: profile_kernels(Workload(m, first, DEV), emit)))
    for b in order[3:] if six else []:
        timed("six-encoder", b, fast)
    for m in small:
        timed(m, first, compiling)
    for b in [b for b in (1, 32) if b in batches] if six else []:
        timed("six-encoder", b, [p for p in compiling if p != "trainer-compile"])
    for m in small:
        for b in [b for b in order if b != first]:
            timed(m, b, fast)
    for b in [b for b in (1, 32) if b in batches] if six else []:
        out.append((f"thin-pair kernel b{b}", lambda emit, b=b: thin_pair_kernel(b, emit)))
    return out


def _cell(value) -> str:
    return "" if value is None else f"{value:g}"


def markdown_tables(report: dict) -> str:
    """The run as tables: speed against dense per model x ratio x batch x path (compressed /
    dense ms beneath), then kernels per eager step and memory."""
    timed = [r for r in report["rows"] if r.get("path") in PATHS]
    paths = [p for p in PATHS if any(r["path"] == p for r in timed)]
    lines = ["| model | ratio | batch | " + " | ".join(paths) + " |", "|---|---|---|" + "---|" * len(paths)]
    keys = sorted({(r["model"], r.get("ratio"), r["batch"]) for r in timed},
                  key=lambda k: (k[0] not in LLAMA, k[0] != "six-encoder", k[0], -(k[1] or 0), k[2]))
    for model, ratio, batch in keys:
        cells = []
        for path in paths:
            row = next((r for r in timed if (r["model"], r.get("ratio"), r["batch"], r["path"])
                        == (model, ratio, batch, path)), None)
            if row is None or "speed_vs_dense" not in row:
                cells.append("" if row is None else ("error" if "error" in row else row.get("skipped", "")))
            else:
                cells.append(f"**{row['speed_vs_dense']:.2f}x** {row['compressed_ms']:.1f}/{row['dense_ms']:.1f}")
        shown_ratio = "" if ratio is None else f"{ratio:.3g}"
        lines.append(f"| {model} | {shown_ratio} | {batch} | " + " | ".join(cells) + " |")
    kernels = [r for r in report["rows"] if r.get("path") == "kernels" and "kernels_per_step" in r]
    if kernels:
        lines += ["", "| model | batch | variant | kernels per eager step | GPU ms of kernels |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['variant']} | {r['kernels_per_step']:.0f} | "
                  f"{r['gpu_ms_per_step']:.2f} |" for r in kernels]
        for r in kernels:   # each kernel by name: what it achieved against the device's measured peaks
            lines += ["", f"{r['model']} b{r['batch']} {r['variant']}: the costliest kernels", "",
                      "| kernel | kind | calls | µs a call | ms a step | GB/s (est.) | of copy peak | TFLOP/s | of GEMM peak |",
                      "|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| `{k['kernel'][:60]}` | {k['kind']} | {k['calls']:.0f} | {k['us_per_call']:.1f} | {k['ms']:.3f} | "
                      f"{_cell(k.get('gb_per_s_est'))} | {_cell(k.get('of_peak_bw'))} | {_cell(k.get('tflop_per_s'))} | "
                      f"{_cell(k.get('of_peak_flops'))} |" for k in r.get("kernels", [])[:15]]
    memory = [r for r in report["rows"] if r.get("path") == "memory" and "peak_mb" in r]
    if memory:
        lines += ["", "| model | batch | variant | peak MB | resident MB | build peak MB |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['variant']} | {r['peak_mb']:.0f} | "
                  f"{r.get('resident_mb', float('nan')):.0f} | {r.get('build_peak_mb', float('nan')):.0f} |"
                  for r in memory]
    return "\n".join(lines)


def bf16_gemm_tflops(device: torch.device, n: int = 8192) -> float:
    """Best of 5 square bf16 ``mm`` of side ``n``, TFLOP/s: the peak bf16 kernels are held to."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    torch.mm(a, b)
    times = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        times.append(time.perf_counter() - start)
    return round(2 * n**3 / min(times) / 1e12, 1)


def gpu_facts() -> dict:
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton  # noqa: PLC0415
        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
        query = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit"
        try:
            text = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20).stdout.strip()
            facts["nvidia_smi"] = dict(zip(query.split(","), (v.strip() for v in text.split(","))))
        except (OSError, subprocess.SubprocessError) as e:
            facts["nvidia_smi"] = f"unavailable: {e}"
    return facts


DEV = torch.device("cpu")
REPS = 10
LLAMA_BATCH = 8
#: the device's measured GEMM peaks (``gemm_tflop_per_s`` fp32, ``bf16_gemm_tflop_per_s``)
PEAKS: dict[str, float] = {}
DEADLINE = float("inf")


def main() -> None:
    global DEV, REPS, DEADLINE, LLAMA_BATCH
    ap = parser(__doc__)
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no job after this many seconds")
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    ap.add_argument("--models", nargs="+", default=["llama-1b", "llama-350m", "six-encoder", "small-bert", "gpt2"],
                    choices=list(MODELS))
    ap.add_argument("--llama-batch", type=int, default=8, help="the Llamas' batch (sequences of 1024)")
    ap.add_argument("--memory-row", nargs=4, default=None, metavar=("MODEL", "BATCH", "RATIO", "VARIANT"),
                    help="measure one memory row in this fresh process, print it as JSON and stop")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--table", type=Path, default=None, help="print a run's JSON as markdown tables and stop")
    ap.add_argument("--jobs", nargs="+", default=None,
                    help="run only the jobs whose labels start with one of these (e.g. 'gpt2 b8' 'six-encoder memory')")
    ap.add_argument("--merge", type=Path, default=None,
                    help="start from this run's JSON: its rows stay unless a job here measures the same row again")
    args = ap.parse_args()
    if args.table is not None:
        print(markdown_tables(json.loads(args.table.read_text())))
        return
    DEV, REPS, LLAMA_BATCH = torch.device(args.device), args.reps, args.llama_batch
    if args.memory_row is not None:
        model, batch, ratio, variant = args.memory_row
        print(json.dumps(memory_row(Workload(model, int(batch), DEV, float(ratio)), variant)))
        return
    cuda = DEV.type == "cuda"
    paths = [p for p in args.paths if cuda or p not in CUDA_ONLY]
    start = time.monotonic()
    DEADLINE = start + args.budget_s
    report = {"benchmark": "gpu", "device": str(DEV), **gpu_facts(), **machine(DEV),
              "budget_s": args.budget_s, "rows": [], "skipped": []}
    PEAKS["gemm_tflop_per_s"] = report["gemm_gflop_per_s"] / 1e3
    PEAKS["copy_gb_per_s"] = report["copy_gb_per_s"]
    if cuda:
        report["bf16_gemm_tflop_per_s"] = PEAKS["bf16_gemm_tflop_per_s"] = bf16_gemm_tflops(DEV)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        write_result(args.out, report)

    def emit(row: dict) -> None:
        row["at_s"] = round(time.monotonic() - start, 1)
        key = [row.get(k) for k in ("model", "batch", "ratio", "path", "variant")]
        report["rows"] = [r for r in report["rows"]
                          if [r.get(k) for k in ("model", "batch", "ratio", "path", "variant")] != key] + [row]
        shown = {k: v for k, v in row.items() if k not in ("by_kind", "kernels", "matmul_ops")}
        print(json.dumps(shown), flush=True)
        write()

    if args.merge is not None:
        earlier = json.loads(args.merge.read_text())
        report["merged_from"] = {k: earlier.get(k) for k in ("gpu", "torch", "elapsed_s", "copy_gb_per_s",
                                                           "gemm_gflop_per_s")}
        report["rows"] = earlier["rows"]
    for label, job in jobs(args.models, args.batches, paths, cuda):
        if args.jobs is not None and not any(label.startswith(j) for j in args.jobs):
            continue
        if out_of_time():
            report["skipped"].append(label)
            continue
        print(f"== {label} ({time.monotonic() - start:.0f} s)", flush=True)
        try:
            job(emit)
        except Exception as e:  # noqa: BLE001 - a job that cannot build still leaves a row
            emit({"job": label, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        if cuda:
            torch.cuda.empty_cache()
    report["clocks_after"] = gpu_facts().get("nvidia_smi")
    from tncompile.runtime.ways import measured  # noqa: PLC0415
    report["measured_winners"] = measured.snapshot()   # what each TT linear shape measured fastest
    write()
    print(f"wrote {args.out} in {time.monotonic() - start:.0f} s; skipped: {report['skipped']}")


if __name__ == "__main__":
    main()
