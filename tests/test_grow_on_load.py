"""Issue 64 item 1: a best checkpoint saved before later rank cuts loads onto the cut model.

``Trainer(load_best_model_at_end=True)`` with ``RankControlCallback`` ends by loading its best
checkpoint -- often one saved before the last cuts -- with ``model.load_state_dict(state,
strict=False)``. Every compressed kind must grow back to the checkpoint's ranks: TT linears
(sibling groups too), TTM embeddings and the heads tied to them (whose tensors the checkpoint
holds under one name only), experts and bags. First at the ``load_state_dict`` level, kind by
kind (outputs and gradients equal to the checkpointed model's), then through a real Trainer."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import tncompile
from tncompile.passes import Replan, TruncateRanks
from tncompile.runtime import TTMEmbeddingBag
from tncompile.runtime.layers import owning_layers

transformers = pytest.importorskip("transformers")


def _compile(model, ratio, example, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tncompile.compile(model, ratio, example_inputs=example, mode=mode)


class Bags(nn.Module):
    """Two bags of ids and a head: a recommender's shapes, returning HF-style outputs."""

    def __init__(self):
        super().__init__()
        self.users = nn.EmbeddingBag(900, 32, mode="sum")
        self.items = nn.EmbeddingBag(700, 32, mode="mean")
        self.head = nn.Linear(64, 2)

    def forward(self, users, items, labels=None):
        logits = self.head(torch.cat([self.users(users), self.items(items)], dim=-1))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


_DEC = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _model(kind: str):
    """``(compiled model, one batch as keyword inputs)``."""
    torch.manual_seed(0)
    ids = torch.randint(0, 400, (4, 16))
    if kind == "gpt2-tied":
        cfg = transformers.GPT2Config(vocab_size=400, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
        return _compile(transformers.GPT2LMHeadModel(cfg), 0.4, {"input_ids": ids}, "swap"), \
            {"input_ids": ids, "labels": ids}
    if kind == "bert-untied":
        cfg = transformers.BertConfig(vocab_size=400, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=32, num_labels=3,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        labels = ids[:, 0] % 3
        return _compile(transformers.BertForSequenceClassification(cfg), 0.4, {"input_ids": ids}, "swap"), \
            {"input_ids": ids, "labels": labels}
    if kind == "mixtral-experts":
        cfg = transformers.MixtralConfig(**_DEC, num_local_experts=4, num_experts_per_tok=2)
        return _compile(transformers.MixtralForCausalLM(cfg), 0.3, {"input_ids": ids}, "swap"), \
            {"input_ids": ids, "labels": ids}
    assert kind == "bags"
    users, items = torch.randint(0, 900, (4, 3)), torch.randint(0, 700, (4, 5))
    batch = {"users": users, "items": items, "labels": torch.tensor([0, 1, 1, 0])}   # traced with its loss
    compiled = _compile(Bags(), 0.3, batch, "graph")
    assert any(isinstance(m, TTMEmbeddingBag) for m in compiled.tensorized_modules().values())
    return compiled, batch


KINDS = ["gpt2-tied", "bert-untied", "mixtral-experts", "bags"]


def _loss(model, batch):
    out = model(**batch)
    return out["loss"] if isinstance(out, dict) else out.loss


def _cut_every_layer(model) -> None:
    """Each layer that owns its cores cut to about half its ranks (its leading ones)."""
    keep = {name: [torch.arange(max(1, r // 2)) for r in m.layout.ranks]
            for name, m in owning_layers(model.tensorized_modules()).items()}
    model._run_passes([TruncateRanks(keep), Replan()])


def _as_a_checkpoint_holds_it(state: dict) -> dict:
    """A state as ``save_pretrained`` / safetensors write it: a tensor two names share, once."""
    seen, out = set(), {}
    for name, t in state.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t.clone()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_saved_before_cuts_grows_every_kind_back(kind):
    model, batch = _model(kind)
    best = copy.deepcopy(model)
    state = _as_a_checkpoint_holds_it(best.state_dict())
    _cut_every_layer(model)
    ranks = {n: m.layout.ranks for n, m in model.tensorized_modules().items()}
    assert ranks != {n: m.layout.ranks for n, m in best.tensorized_modules().items()}
    result = model.load_state_dict(state, strict=False)                  # what Trainer calls
    assert not result.unexpected_keys and not result.missing_keys, result
    assert {n: m.layout.ranks for n, m in model.tensorized_modules().items()} == \
        {n: m.layout.ranks for n, m in best.tensorized_modules().items()}
    model.eval(), best.eval()
    with torch.no_grad():
        got, want = model(**batch), best(**batch)
    got, want = (got["logits"], want["logits"]) if isinstance(got, dict) else (got.logits, want.logits)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    model.train(), best.train()                                          # and it trains as the best model did
    grads = torch.autograd.grad(_loss(model, batch), list(model.parameters()))
    want_grads = torch.autograd.grad(_loss(best, batch), list(best.parameters()))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _rows(kind, n=64):
    g = torch.Generator().manual_seed(1)
    if kind == "bags":
        return [{"users": torch.randint(0, 900, (3,), generator=g), "items": torch.randint(0, 700, (5,), generator=g),
                 "labels": int(i % 2)} for i in range(n)]
    ids = torch.randint(0, 400, (n, 16), generator=g)
    if kind == "bert-untied":
        return [{"input_ids": x, "labels": int(x[0]) % 3} for x in ids]
    return [{"input_ids": x, "labels": x} for x in ids]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_trainer_loads_the_best_checkpoint_saved_before_later_cuts(kind, tmp_path):
    """A plain ``transformers.Trainer`` with ``load_best_model_at_end``: the first of two
    evaluations wins (a metric made to fall), so the best checkpoint predates the later cuts."""
    pytest.importorskip("accelerate")
    from tncompile.integrations.hf import RankControlCallback
    model, _ = _model(kind)
    evaluations = []

    def falling(_):
        evaluations.append(1)
        return {"marker": -float(len(evaluations))}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=16, per_device_train_batch_size=4, learning_rate=2e-3, logging_steps=4,
        save_steps=4, eval_strategy="steps", eval_steps=4, load_best_model_at_end=True, metric_for_best_model="marker",
        greater_is_better=True, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        label_names=["labels"])
    callback = RankControlCallback(target_ratio=0.15, early_fraction=0.25, truncate_every=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows(kind), eval_dataset=_rows(kind, 8),
                                   compute_metrics=falling, callbacks=[callback])
    at_best: dict = {}

    class Remember(transformers.TrainerCallback):
        def on_evaluate(self, args, state, control, model=None, **kwargs):
            if not at_best:
                at_best.update({n: m.layout.ranks for n, m in model.tensorized_modules().items()})
    trainer.add_callback(Remember())
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-4")
    assert any(e.get("tncompile_event") == "cut" for e in callback.events)
    loaded = {n: m.layout.ranks for n, m in trainer.model.tensorized_modules().items()}
    assert loaded == at_best


def _mlp_model():
    from tncompile.testing import mlp
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tncompile.compile(mlp((256, 256, 256, 256, 10)), 0.1)


def test_gates_alone_do_not_grow_a_layer():
    """Issue 65 item 6: a state holding only longer gates (a few KB), loaded with
    ``strict=False`` as Trainer does, is refused naming the layer -- it used to grow every
    layer to those ranks, past twice its dense size."""
    model = _mlp_model()
    before = sum(p.numel() for p in model.parameters())
    layer, m = next(iter(owning_layers(model.tensorized_modules()).items()))
    names = {id(t): n for n, t in model.state_dict(keep_vars=True).items()}
    gates = {names[id(g)]: torch.ones(min(b, r + 4)) for g, r, b in
             zip(m.gates, m.layout.ranks, m.layout.rank_bounds())}
    with pytest.raises(ValueError, match=rf"{layer!r}.*no core 0 there.*grows only to ranks whose cores the state"):
        model.load_state_dict(gates, strict=False)
    assert sum(p.numel() for p in model.parameters()) == before          # nothing half-applied


def test_growth_past_the_dense_size_is_refused():
    model = _mlp_model()
    layer, m = next(iter(owning_layers(model.tensorized_modules()).items()))
    names = {id(t): n for n, t in model.state_dict(keep_vars=True).items()}
    big = m.layout.with_ranks(m.layout.rank_bounds())
    assert big.num_params() > big.dense_params
    state = {names[id(g)]: torch.ones(r) for g, r in zip(m.gates, big.ranks)}
    state.update({names[id(c)]: torch.zeros(shape) for c, shape in zip(m.cores, big.core_shapes())})
    with pytest.raises(ValueError, match=rf"{layer!r} would grow to ranks .* more than its dense form"):
        model.load_state_dict(state, strict=False)
