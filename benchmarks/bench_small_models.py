"""Does a small model get slower when compiled? A 2-layer, 128-wide BERT, one training step.

    python benchmarks/bench_small_models.py [--ratio 0.3] [--batch 32] [--length 64] [--no-torch-compile]
                                            [--device cuda] [--mode graph|swap|auto] [--family bert|gpt2|llama]
                                            [--train-step eager|captured] [--no-slower-kept-dense]

Issue 28's first point: layers whose TT network costs fewer multiply-adds than the
dense layer but more kernels and Python calls can lose in time. The model
(``BertModel``, hidden 128, 2 layers, 2 heads, FFN 512, vocabulary 1,000) is compiled
with the defaults but ``mode="graph"`` (``--mode auto`` for the true default, swap mode for
an HF model; written to ``small_models_auto.json``) at
``--ratio``; each step is what a user's loop runs -- a forward over ``batch x length``
ids, a backward of a mean-square loss on the last hidden state, ``optimizer.step()`` and
``zero_grad`` -- timed interleaved against the dense model: eagerly with the AdamW a user
writes first (``AdamW(model.parameters())``, which steps CPU tensors one by one: a
compressed model has several times more of them), with ``foreach`` (the compressed
model's optimizer built from ``tncompile.param_groups``, its default; the dense one's
with ``foreach=True``) and fused (``param_groups(..., implementation="fused")``;
``fused=True``), and, unless ``--no-torch-compile``, the model under
``torch.compile`` with the default AdamW.
Where the report estimates some TT linears slower than their dense layers (its speed
line, ``report.speed``), the model it offers -- those kept dense, at the ratio it names --
is timed beside them (``--no-slower-kept-dense`` skips it). ``--train-step eager|captured``
adds whole training steps (``tncompile.TrainStep``, AdamW; ``captured``: CUDA graphs, as
``fit`` runs them on a GPU).
``--family gpt2`` (``GPT2LMHeadModel``, 256 wide, 4 layers, 4 heads, dropout 0.1
everywhere) and ``--family llama`` (``LlamaForCausalLM``, 256 wide, 4 layers, 4 query
and 2 key/value heads, FFN 688, attention dropout 0.1) train on their language-model
loss instead. Writes ``benchmarks/results/small_models.json`` (``small_models_<family>``
for the others; ``_<mode>`` unless graph mode) with the host's copy bandwidth and
GEMM throughput (``small_models_cuda.json`` on a GPU, where every timed step ends with a
synchronize).
"""
from __future__ import annotations

import argparse

import torch
import transformers

import tncompile
from tncompile.result.model_api import is_compressed
from tncompile.train import TrainStep

from common import interleaved_ms, machine, parser, write_json


def _bert(length: int):
    config = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=512, max_position_embeddings=length)
    return "BertModel hidden 128, 2 layers, FFN 512", transformers.BertModel(config)


def _gpt2(length: int):
    config = transformers.GPT2Config(vocab_size=1000, n_embd=256, n_layer=4, n_head=4, n_positions=length)
    return "GPT2LMHeadModel hidden 256, 4 layers, dropout 0.1", transformers.GPT2LMHeadModel(config)


def _llama(length: int):
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1,
                                      max_position_embeddings=length)
    return ("LlamaForCausalLM hidden 256, 4 layers, 4/2 heads, FFN 688, attention dropout 0.1",
            transformers.LlamaForCausalLM(config))


FAMILIES = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="graph", choices=["graph", "swap", "auto"],
                    help="compile mode (auto: what a user gets by default; swap for HF models)")
    ap.add_argument("--family", default="bert", choices=list(FAMILIES))
    ap.add_argument("--train-step", choices=["eager", "captured"], default=None,
                    help="also time full training steps (tncompile.TrainStep with AdamW) of every model: eagerly, "
                         "or captured as CUDA graphs (--device cuda)")
    ap.add_argument("--slower-kept-dense", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the model the report offers: its TT linears estimated slower than "
                         "dense kept dense (exclude_modules=report.speed.slower, at report.speed.ratio_without_slower)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    describe, dense = FAMILIES[args.family](args.length)
    dense = dense.train().to(device)
    ids = torch.randint(0, 1000, (args.batch, args.length), device=device)
    example = {"input_ids": ids} if args.family == "bert" else {"input_ids": ids, "labels": ids}
    compiled = tncompile.compile(dense, target_ratio=args.ratio, example_inputs=example, mode=args.mode).train()
    models = {"dense": dense, "compiled": compiled}
    estimate = compiled.report().speed
    if estimate is not None:
        print("\n".join(estimate.lines()), flush=True)
    if args.slower_kept_dense and estimate is not None and estimate.slower:
        # the report's offer: the slower layers kept dense, at the ratio it names
        models["no-slower"] = tncompile.compile(dense, target_ratio=estimate.ratio_without_slower,
                                                exclude_modules=list(estimate.slower), example_inputs=example,
                                                mode=args.mode).train()
    tensors = {name: sum(p.requires_grad for p in m.parameters()) for name, m in models.items()}
    print("parameter tensors: " + ", ".join(f"{k} {v}" for k, v in tensors.items()), flush=True)

    def loss_of(out):  # the encoder: a mean-square loss on its last hidden state; decoders: their LM loss
        return out.last_hidden_state.square().mean() if args.family == "bert" else out.loss

    def whole_step(model, run, optimizer):
        """What a user's loop does: forward, backward, ``optimizer.step()``, ``zero_grad``."""
        def go():
            loss_of(run(**example)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return go

    def default_adamw(model):  # what a user writes first
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def grouped_adamw(model, implementation: str):  # tncompile.param_groups; the dense model's alike
        if is_compressed(model):
            return torch.optim.AdamW(tncompile.param_groups(model, lr=1e-5, implementation=implementation))
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, **{implementation: True})

    def train_step(model, captured: bool):
        """A full step (forward, backward, AdamW) through tncompile.TrainStep."""
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        step = TrainStep(model, opt, lambda out, _: loss_of(out), cuda_graph=captured)
        return lambda: step(example, None)

    rows = []
    cases = [("eager, AdamW()", {name: whole_step(m, m, default_adamw(m)) for name, m in models.items()}),
             ("eager, AdamW foreach", {name: whole_step(m, m, grouped_adamw(m, "foreach"))
                                       for name, m in models.items()}),
             ("eager, AdamW fused", {name: whole_step(m, m, grouped_adamw(m, "fused")) for name, m in models.items()})]
    if args.torch_compile:
        cases.append(("torch.compile, AdamW()", {name: whole_step(m, torch.compile(m), default_adamw(m))
                                                 for name, m in models.items()}))
    if args.train_step == "captured" and device.type != "cuda":
        ap.error("--train-step captured needs --device cuda")
    if args.train_step:
        cases.append((f"TrainStep {args.train_step}", {name: train_step(model, args.train_step == "captured")
                                                       for name, model in models.items()}))
    for case, fns in cases:
        ms = interleaved_ms(fns, reps=args.reps, warmup=3, device=device)
        row = {"case": case, "dense_ms": round(ms["dense"], 2), "compiled_ms": round(ms["compiled"], 2),
               "speed_vs_dense": round(ms["dense"] / ms["compiled"], 3)}
        text = f"{case:22s} dense {ms['dense']:8.2f} ms  compiled {ms['compiled']:8.2f} ms  " \
               f"{ms['dense'] / ms['compiled']:5.2f}x dense"
        if "no-slower" in ms:
            row.update(no_slower_ms=round(ms["no-slower"], 2),
                       no_slower_speed_vs_dense=round(ms["dense"] / ms["no-slower"], 3))
            text += f"  |  slower layers dense {ms['no-slower']:8.2f} ms {ms['dense'] / ms['no-slower']:5.2f}x dense"
        rows.append(row)
        print(text, flush=True)
    name = "small_models" + ("" if args.family == "bert" else f"_{args.family}") + \
        ("" if device.type == "cpu" else f"_{device.type}") + ("" if args.mode == "graph" else f"_{args.mode}") + ".json"
    path = write_json(name, {
        "benchmark": "small_models", "model": describe, "ratio": compiled.ratio, "mode": args.mode,
        "estimate": None if estimate is None else {
            "device": estimate.device, "compressed_layers": estimate.layers,
            "speed_vs_dense": round(estimate.speedup, 3),
            "slower": len(estimate.slower), "ratio_without_slower": round(estimate.ratio_without_slower, 4)},
        "no_slower_ratio": models["no-slower"].ratio if "no-slower" in models else None,
        "parameter_tensors": tensors, "batch": args.batch, "length": args.length, "rows": rows, "device": str(device), **machine(device)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
