"""Pretraining at scale on this machine: never build the dense model, train where dense cannot.

    python benchmarks/bench_scale.py [--batch 2] [--seq 64] [--steps 3] [--no-dense] [--configs 1b,1b-tied,7b]

For each Llama configuration (the issue's 1B: hidden 2048, FFN 8192, 16 layers, 32 heads,
8 KV heads, 128,256 words, at ratio 0.05 -- with transformers' default untied head, 1.50B
parameters, and ``1b-tied``, its head tied to the embedding, 1.24B; a 7B: Llama-2-7B's
shape, 32,000 words, at 0.02), each job runs in a fresh process:

* ``compile``: the model built on the meta device and compiled (``init="random"``): seconds
  and the process's peak host memory (``VmHWM``);
* ``train``: the same, then ``tncompile.materialize`` on the CPU and ``--steps`` + 1 AdamW
  training steps over ``batch x seq`` tokens (next-token loss): the median step after the
  first (which makes the optimizer state and measures each shape's ways), the steps' peak
  memory above what the process held after the first (model, gradients, AdamW states),
  the process's peak, the loss;
* ``dense-parts`` (1B configurations): the dense step from its parts, each timed for real --
  one decoder layer, and the embedding, final norm and head -- with AdamW: layers x one
  layer + the rest; the compressed step against it in wall and in CPU time (``speedup``);
* ``dense`` (1B only, unless ``--no-dense``): the dense model built for real with AdamW, under
  an address-space limit of this machine's available memory: its step time and peak memory,
  or the allocation that failed.

Writes ``benchmarks/results/scale.json`` (with the host's copy bandwidth and GEMM throughput)
and prints a table: dense parameters, compressed parameters, compile seconds, peak host
memory, one training step's time and peak memory. A profile of one compressed step (its
top operators by self CPU time) goes beside it with ``--profile``.
"""
from __future__ import annotations

import multiprocessing as mp
import resource
import statistics
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

from common import machine, parser, write_json

CONFIGS = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, ratio=0.05),
    "1b-tied": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, ratio=0.05),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, ratio=0.02),
}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _reset_peak() -> None:
    """Start ``VmHWM`` afresh at the current resident size (Linux: ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _config(name: str):
    from transformers import LlamaConfig
    spec = dict(CONFIGS[name])
    spec.pop("ratio")
    return LlamaConfig(**spec, max_position_embeddings=4096)


def _meta_compiled(name: str, ratio: float):
    import tncompile
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(name))
    dense = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(model, target_ratio=ratio, init="random",
                                     example_inputs={"input_ids": torch.zeros(1, 16, dtype=torch.long, device="meta")})
    return compiled, dense, time.perf_counter() - start


def _steps(model, batch: int, seq: int, steps: int, vocab: int, profile: bool) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    times, losses = [], []

    def step():
        out = model(input_ids=ids, labels=ids)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())

    start = time.perf_counter()
    step()                  # the first step: optimizer state made, each shape's ways measured
    first = time.perf_counter() - start
    first_peak = _status_kb("VmHWM") / 1024
    base = _status_kb("VmRSS")
    _reset_peak()
    cpu_times = []
    for _ in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    result = {"step_s": statistics.median(times) if steps else first,
              "step_cpu_s": statistics.median(cpu_times) if steps else None, "first_step_s": first,
              "first_step_peak_mb": first_peak, "rss_before_steps_mb": base / 1024,
              "step_peak_mb": (_status_kb("VmHWM") - base) / 1024, "loss": losses}
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        result["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return result


def _dense_by_parts(name: str, args) -> dict:
    """The dense step from its parts, each timed for real (the whole model does not fit):
    one decoder layer, and the embedding with the final norm and head, each forward,
    backward and AdamW step over ``batch x seq`` tokens; the step = layers x one layer +
    the rest (attention masks and rotary tables, made once a step, are left out)."""
    from transformers import LlamaForCausalLM
    config = _config(name)
    layers, config.num_hidden_layers = config.num_hidden_layers, 1
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
    layer = model.model.layers[0]
    hidden = torch.randn(args.batch, args.seq, config.hidden_size, generator=g, requires_grad=True)
    rotary = model.model.rotary_emb(hidden, torch.arange(args.seq).unsqueeze(0))
    rest = [p for n, p in model.named_parameters() if ".layers." not in n]
    opt_layer = torch.optim.AdamW(layer.parameters(), lr=1e-4)
    opt_rest = torch.optim.AdamW(rest, lr=1e-4)

    def layer_step():
        out = layer(hidden, position_embeddings=rotary)
        out = out[0] if isinstance(out, tuple) else out
        opt_layer.zero_grad(set_to_none=True)
        out.square().mean().backward()
        opt_layer.step()

    def rest_step():
        h = model.model.embed_tokens(ids)
        logits = model.lm_head(model.model.norm(h))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
        opt_rest.zero_grad(set_to_none=True)
        loss.backward()
        opt_rest.step()

    times, cpu_times = {}, {}
    for label, fn in (("layer", layer_step), ("embedding_norm_head", rest_step)):
        fn()
        runs, cpu_runs = [], []
        for _ in range(max(args.steps, 1)):
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            runs.append(time.perf_counter() - start)
            cpu_runs.append(time.process_time() - cpu)
        times[label], cpu_times[label] = statistics.median(runs), statistics.median(cpu_runs)
    return {"layer_s": times["layer"], "layers": layers, "embedding_norm_head_s": times["embedding_norm_head"],
            "step_s": layers * times["layer"] + times["embedding_norm_head"],
            "step_cpu_s": layers * cpu_times["layer"] + cpu_times["embedding_norm_head"]}


def _job(kind: str, name: str, args, queue) -> None:
    torch.set_num_threads(args.threads)
    try:
        if kind == "dense-parts":
            out = _dense_by_parts(name, args)
        elif kind == "dense":
            limit = int(_available_bytes())
            resource.setrlimit(resource.RLIMIT_AS, (limit + _status_kb("VmSize") * 1024, resource.RLIM_INFINITY))
            from transformers import LlamaForCausalLM
            start = time.perf_counter()
            model = LlamaForCausalLM(_config(name))
            out = {"dense_params": sum(p.numel() for p in model.parameters()),
                   "build_s": time.perf_counter() - start, "address_limit_gb": limit / 2**30,
                   "model_rss_mb": _status_kb("VmRSS") / 1024}
            out.update(_steps(model, args.batch, args.seq, args.steps, model.config.vocab_size, False))
        else:
            import tncompile
            compiled, dense, seconds = _meta_compiled(name, CONFIGS[name]["ratio"])
            out = {"dense_params": dense, "params": sum(p.numel() for p in compiled.parameters()),
                   "compile_s": seconds, "compile_peak_mb": _status_kb("VmHWM") / 1024}
            if kind == "train":
                start = time.perf_counter()
                tncompile.materialize(compiled, "cpu", seed=0)
                out["materialize_s"] = time.perf_counter() - start
                out["model_rss_mb"] = _status_kb("VmRSS") / 1024
                out.update(_steps(compiled, args.batch, args.seq, args.steps, CONFIGS[name]["vocab_size"],
                                  args.profile))
                out["process_peak_mb"] = _status_kb("VmHWM") / 1024
        queue.put({"ok": True, **out})
    except (MemoryError, RuntimeError) as e:
        queue.put({"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}",
                   "peak_mb": _status_kb("VmHWM") / 1024, "trace": traceback.format_exc()[-1500:]})


def _available_bytes() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def _run(kind: str, name: str, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_job, args=(kind, name, args, queue))
    start = time.perf_counter()
    proc.start()
    proc.join(args.timeout)
    if proc.is_alive():
        proc.kill()
        return {"ok": False, "error": f"did not finish in {args.timeout} s"}
    if queue.empty():
        return {"ok": False, "error": f"the process died (exit {proc.exitcode}: killed for memory?)"}
    got = queue.get()
    got["wall_s"] = time.perf_counter() - start
    return got


def _table(results: dict) -> str:
    head = ("config", "dense params", "compressed", "compile s", "compile peak", "step s", "held + step peak",
            "dense step (by parts)", "dense whole")
    rows = [head]
    for name, jobs in results.items():
        comp, train, dense = jobs.get("compile", {}), jobs.get("train", {}), jobs.get("dense")
        parts = jobs.get("dense-parts", {})
        dense_cell = "-" if dense is None else (f"{dense['step_s']:.1f} s, {dense['step_peak_mb'] / 1024:.1f} GB"
                                                if dense.get("ok") else
                                                f"out of memory at {dense['peak_mb'] / 1024:.1f} GB"
                                                if "allocate" in dense.get("error", "") else
                                                f"failed: {dense['error'][:60]}")
        rows.append((name, f"{comp.get('dense_params', 0) / 1e9:.2f}B", f"{comp.get('params', 0) / 1e6:.1f}M",
                     f"{comp.get('compile_s', float('nan')):.0f}", f"{comp.get('compile_peak_mb', 0) / 1024:.2f} GB",
                     f"{train['step_s']:.2f}" if train.get("ok") else "-",
                     (f"{train['rss_before_steps_mb'] / 1024:.2f} + {train['step_peak_mb'] / 1024:.2f} GB"
                      if train.get("ok") else "-"),
                     f"{parts['step_s']:.2f} s" if parts.get("ok") else "-", dense_cell))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--configs", default="1b,1b-tied,7b")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    results = {}
    from tncompile.testing import HostLoad
    load = HostLoad().__enter__()
    for name in args.configs.split(","):
        jobs = results[name] = {}
        jobs["compile"] = _run("compile", name, args)
        print(name, "compile", {k: v for k, v in jobs["compile"].items() if k != "trace"}, flush=True)
        if name.startswith("1b"):
            jobs["train"] = _run("train", name, args)
            print(name, "train", {k: v for k, v in jobs["train"].items() if k not in ("trace", "profile")},
                  flush=True)
            if args.profile and "profile" in jobs["train"]:
                print(jobs["train"]["profile"])
            jobs["dense-parts"] = _run("dense-parts", name, args)
            print(name, "dense by parts", jobs["dense-parts"], flush=True)
            train, parts = jobs["train"], jobs["dense-parts"]
            if train.get("ok") and parts.get("ok"):   # both measured in this run, one after the other
                jobs["speedup"] = {"wall": parts["step_s"] / train["step_s"],
                                   "cpu": parts["step_cpu_s"] / train["step_cpu_s"]}
                print(f"{name}: the compressed step against dense's by parts, measured side by side: "
                      f"{jobs['speedup']['wall']:.1f}x in wall time, {jobs['speedup']['cpu']:.1f}x in CPU time",
                      flush=True)
            if not args.no_dense and name == "1b":
                jobs["dense"] = _run("dense", name, args)
                print(name, "dense", {k: v for k, v in jobs["dense"].items() if k != "trace"}, flush=True)
    load.__exit__(None, None, None)
    table = _table(results)
    print(table)
    if load.busy:
        print(f"WARNING: the host was busy while measuring ({load.describe()}): the times are not reliable")
    path = write_json("scale.json", {"machine": machine(), "host_load": load.as_dict(), "batch": args.batch, "seq": args.seq, "steps": args.steps,
                                "configs": {k: {kk: vv for kk, vv in v.items() if kk != "ratio"} | {"ratio": v["ratio"]}
                                            for k, v in CONFIGS.items()},
                                "results": results, "table": table})
    print("wrote", path)


if __name__ == "__main__":
    main()
