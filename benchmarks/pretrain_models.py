"""The pretraining study's models and their training set-ups (issue 66).

The models a user would build from a ``transformers`` config -- a Llama-style causal LM
(``objective="clm"``), or a RoBERTa-style masked LM (``"mlm"``, CodeBERT's objective) --
and the variants the study compares, each a :class:`Run` (model, optimizer, rank
controller or ``None``):

* ``dense``: AdamW over every parameter;
* ``tt<r>`` (``tt0.25``, ``tt0.1``): ``tncompile.compile(init="random", seed=seed)`` at
  ``1.5 r`` of dense's parameters, then tncompile's default rank-adaptive schedule
  (``RankController(schedule="budget")``, early and late stages a third of the run each)
  down to ``r``; AdamW over ``tncompile.param_groups``;
* ``lowrank<r>``: tncompile's 2-core form (``linear_cores=1``: each linear ``W = A B``; the
  embedding a 2-core TTM) compiled at ``r`` with the same variance-matched init as dense's
  layers, no rank adaptation;
* ``galore``: the dense model with GaLore's AdamW at the paper's settings (rank a quarter
  of the width, update gap 200, scale 0.25) on the decoder layers' matrices;
* ``tt<r>-measured``: ``tt<r>`` with ``linear_cores="measured"``: each linear's 2-, 4- or
  6-core network chosen by timing it on the device within its parameter share.

Ablations of ``tt<r>`` (what TT's quality from scratch depends on):

* ``tt<r>+torchinit``: the cores drawn at PyTorch's default scales (a linear ``1/(3 in)``,
  an embedding ``1``) instead of the dense model's own (its ``initializer_range``): what
  ``init="random"`` did before issue 66;
* ``tt<r>+direct``: compiled at ``r`` itself, no rank adaptation;
* ``tt<r>+dense-embedding``: as ``+direct``, but the tied embedding (and so the head) kept
  dense and the linears at ``r`` of their own parameters -- a larger model than ``tt<r>``
  (at 0.25, about 0.55 of dense's parameters in the study's shape): against ``+direct`` it
  shows how much of TT's gap is the embedding's compression.

Every variant of a seed draws its initialization from that seed (TT's cores included).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

#: AdamW's settings for every variant (GaLore's AdamW takes the same)
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.0
#: TT variants are compiled at this multiple of their target, then cut to it in training
TT_HEADROOM = 1.5
GALORE_GAP, GALORE_SCALE = 200, 0.25
OBJECTIVES = ("clm", "mlm")
#: the masked LM's tokenizer reserves ids 0 and 1 (no text encodes to them)
MLM_SPECIAL_TOKENS = ("<pad>", "<mask>")
PAD_ID, MASK_ID = 0, 1


@dataclass(frozen=True)
class ModelShape:
    """The Llama-style model: ``hidden`` wide, ``layers`` deep, SwiGLU FFN ``ffn``, ``heads``
    attention heads, a tied ``vocab`` x ``hidden`` embedding, context ``seq`` tokens."""
    hidden: int = 256
    layers: int = 4
    ffn: int = 688
    heads: int = 4
    vocab: int = 8192
    seq: int = 256

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def model_for(objective: str, shape: ModelShape, seed: int, device: str = "cpu") -> nn.Module:
    """The dense model of ``objective``, drawn from ``seed``."""
    if objective == "clm":
        return llama(shape, seed, device)
    if objective == "mlm":
        return roberta(shape, seed, device)
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")


def roberta(shape: ModelShape, seed: int, device: str = "cpu") -> nn.Module:
    """A fresh ``RobertaForMaskedLM`` of ``shape`` (GELU FFN ``shape.ffn``, its decoder tied to
    the word embedding, no dropout: one epoch of data, as the causal model), from ``seed``."""
    from transformers import RobertaConfig, RobertaForMaskedLM
    config = RobertaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                           num_attention_heads=shape.heads, intermediate_size=shape.ffn,
                           max_position_embeddings=shape.seq + 2, pad_token_id=PAD_ID, type_vocab_size=1,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = RobertaForMaskedLM(config)
    return model.to(device)


def llama(shape: ModelShape, seed: int, device: str = "cpu") -> nn.Module:
    """A fresh ``LlamaForCausalLM`` of ``shape``, its weights drawn from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.heads, vocab_size=shape.vocab,
                         max_position_embeddings=shape.seq, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device)


MEASURED_SUFFIX = "-measured"
ABLATIONS = ("+torchinit", "+direct", "+dense-embedding")
#: the modules ``+dense-embedding`` keeps dense (a tied Llama's table and its head)
EMBEDDING_MODULES = ["embed_tokens", "lm_head"]


def variant_kind(variant: str) -> tuple[str, float | None]:
    """``("dense" | "tt" | "lowrank" | "galore", ratio or None)``; ``ValueError`` naming the
    accepted spellings otherwise."""
    for suffix in (MEASURED_SUFFIX, *ABLATIONS):
        if variant.startswith("tt") and variant.endswith(suffix):
            variant = variant[: -len(suffix)]
            break
    for kind in ("tt", "lowrank"):
        if variant.startswith(kind):
            try:
                ratio = float(variant[len(kind):])
            except ValueError:
                ratio = -1.0
            if not 0 < ratio < 1:
                raise ValueError(f"variant {variant!r}: write {kind}<ratio> with a ratio in (0, 1), e.g. {kind}0.25")
            return kind, ratio
    if variant in ("dense", "galore"):
        return variant, None
    raise ValueError(f"unknown variant {variant!r}: dense, galore, tt<ratio>, tt<ratio>{MEASURED_SUFFIX} or "
                     "lowrank<ratio>")


@dataclass
class Run:
    """What one training run updates: the model, its optimizer (every group's ``"base_lr"``
    is what the schedule scales) and the rank controller (TT only)."""
    variant: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    controller: Any = None

    @property
    def compressed(self) -> bool:
        from tncompile.result.model_api import is_compressed
        return is_compressed(self.model)

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def set_lr(self, factor: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor


def example_inputs(shape: ModelShape, device: str) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(2, shape.seq, dtype=torch.long, device=device)}   # batch stays dynamic


def compile_variant(variant: str, shape: ModelShape, seed: int, device: str = "cpu",
                    objective: str = "clm") -> nn.Module:
    """The compressed model a ``tt`` or ``lowrank`` variant starts from (seeded init)."""
    import tncompile
    kind, ratio = variant_kind(variant)
    dense_embedding = variant.endswith("+dense-embedding")
    headroom = 1.0 if variant.endswith(("+direct", "+dense-embedding")) else TT_HEADROOM
    options = {"tt": dict(target_ratio=min(1.0, headroom * ratio)),
               "lowrank": dict(target_ratio=ratio, linear_cores=1, embedding_cores=2)}[kind]
    if variant.endswith(MEASURED_SUFFIX):
        options["linear_cores"] = "measured"
    dense = model_for(objective, shape, seed, device)
    if dense_embedding:   # the linears at ``ratio`` of theirs; the table dense: the whole model's ratio
        table = dense.get_input_embeddings().weight.numel()
        total = sum(p.numel() for p in dense.parameters())
        options.update(target_ratio=(table + ratio * (total - table)) / total, exclude_modules=EMBEDDING_MODULES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the report's notes on the embedding's lookup speed
        model = tncompile.compile(dense, init="random", seed=seed, example_inputs=example_inputs(shape, device),
                                  **options)
    if variant.endswith("+torchinit"):
        from tncompile.runtime.layers.tn_module import TNModule
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for module in model.modules():
                if isinstance(module, TNModule):
                    module.reset_parameters()   # its init_variance(): PyTorch's default for the dense layer
    return model


def optimizer_for(variant: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The variant's optimizer over ``model`` at peak learning rate ``lr``."""
    import tncompile
    kind, _ = variant_kind(variant)
    if kind == "galore":
        hidden = model.config.hidden_size
        opt = galore_adamw(model, lr, rank=max(1, hidden // 4))
    elif kind in ("tt", "lowrank"):
        opt = torch.optim.AdamW(tncompile.param_groups(model, lr=lr, weight_decay=WEIGHT_DECAY), lr=lr,
                                betas=BETAS, weight_decay=WEIGHT_DECAY)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    for group in opt.param_groups:
        group["base_lr"] = group["lr"]
    return opt


def controller_for(variant: str, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int):
    """TT's rank controller (tncompile's default budget schedule: early and late stages a
    third of ``steps`` each, cuts every ``steps / 20``); ``None`` for the other variants."""
    import tncompile
    kind, ratio = variant_kind(variant)
    if kind != "tt" or variant.endswith(("+direct", "+dense-embedding")):
        return None
    return tncompile.RankController(model, optimizer, target_ratio=ratio, early_steps=steps // 3,
                                    late_steps=steps // 3, truncate_every=max(10, round(steps / 20)))


def build(variant: str, shape: ModelShape, lr: float, seed: int, steps: int, device: str = "cpu",
          objective: str = "clm") -> Run:
    """A fresh run of ``variant``: model drawn from ``seed``, optimizer at ``lr``, controller
    scheduled over ``steps``."""
    kind, _ = variant_kind(variant)
    model = (compile_variant(variant, shape, seed, device, objective) if kind in ("tt", "lowrank")
             else model_for(objective, shape, seed, device))
    optimizer = optimizer_for(variant, model, lr)
    return Run(variant, model, optimizer, controller_for(variant, model, optimizer, steps))


def galore_adamw(model: nn.Module, lr: float, rank: int) -> torch.optim.Optimizer:
    """GaLore's AdamW (``galore-torch``) projecting the decoder layers' matrices at ``rank``
    (update gap 200, scale 0.25), the rest (embedding, norms) plain AdamW."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import galore_optimizer
    opt = galore_optimizer(model, lr=lr, rank=rank, select=lambda n, p: p.dim() == 2 and ".layers." in n)
    for group in opt.param_groups:
        group["betas"], group["weight_decay"] = BETAS, WEIGHT_DECAY
        if "rank" in group:
            group["update_proj_gap"], group["scale"] = GALORE_GAP, GALORE_SCALE
    return opt


def lr_factor(step: int, steps: int, warmup: float = 0.1, floor: float = 0.1) -> float:
    """The schedule every variant shares: linear warm-up over ``warmup`` of the run, then
    cosine decay to ``floor`` of the peak at the last step. ``step`` counts from 0."""
    warm = max(1, round(warmup * steps))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, steps - warm))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
