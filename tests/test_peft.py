"""PEFT LoRA on a compressed model (QLoRA's recipe with TT in place of 4-bit): adapters wrap
the TT linears, train while the networks stay frozen, save and reload onto a compressed
model loaded with from_pretrained, and merge back into the networks -- exactly where the
merged matrix fits the ranks, else as a refit the result reports (fit to calibration
outputs when given) -- and unmerge exactly."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import tncompile
from tncompile.runtime import TTLinear

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from tncompile.integrations.peft_lora import TTLoraLinear, merge_and_unload, tt_lora  # noqa: E402


def _compressed(**options):
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    ids = torch.randint(0, 120, (4, 16))
    return tncompile.compile(transformers.BertForSequenceClassification(cfg), target_ratio=0.3,
                             example_inputs={"input_ids": ids}, mode="swap", **options)


def _task(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 120, (n, 16), generator=g)
    return ids, ids[:, 0] % 3


def _trained(model, steps=30):
    pm = peft.get_peft_model(model, tt_lora(peft.LoraConfig(target_modules=["query", "value"], r=4,
                                                            lora_alpha=8, modules_to_save=["classifier"])))
    ids, labels = _task()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(pm(input_ids=ids).logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return pm.eval(), losses


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_wraps_trains_saves_and_reloads_on_a_compressed_model(tmp_path):
    c = _compressed()
    c.save_pretrained(tmp_path / "base")
    frozen = {n: p.detach().clone() for n, p in c.named_parameters() if "cores" in n or "gates" in n}
    pm, losses = _trained(c)
    query = pm.base_model.model.bert.encoder.layer[0].attention.self.query
    assert isinstance(query, TTLoraLinear) and isinstance(query.get_base_layer(), TTLinear)
    assert losses[-1] < 0.85 * losses[0]
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "classifier" in n for n in trainable)
    assert all(torch.equal(p, frozen[n]) for n, p in c.named_parameters() if n in frozen)  # networks frozen
    ids, _ = _task(8, seed=1)
    want = _logits(pm, ids)
    pm.save_pretrained(tmp_path / "adapters")
    base = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "base")
    again = peft.PeftModel.from_pretrained(base, tmp_path / "adapters",
                                           config=tt_lora(peft.LoraConfig.from_pretrained(tmp_path / "adapters")))
    torch.testing.assert_close(_logits(again.eval(), ids), want, rtol=0, atol=0)


def test_merge_is_exact_where_the_ranks_hold_it_and_unmerge_restores():
    """Two cores per side: the side bonds sit at their bounds, the middle one is the matrix
    rank and grows by at most the adapter's rank -- the adapter becomes extra rank."""
    pm, _ = _trained(_compressed(linear_cores=2), steps=10)
    ids, _ = _task(8, seed=1)
    want = _logits(pm, ids)
    before = {n: m.get_base_layer().layout.ranks for n, m in pm.named_modules() if isinstance(m, TTLoraLinear)}
    unmerged = copy.deepcopy(pm)
    unmerged.merge_adapter()
    unmerged.unmerge_adapter()
    torch.testing.assert_close(_logits(unmerged, ids), want, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an exact merge does not warn
        merged, results = merge_and_unload(pm)
    assert len(results) == 4 and all(r.exact and r.weight_error < 1e-6 for r in results)
    assert any(sum(r.ranks_after) > sum(r.ranks_before) for r in results)
    assert all(r.ranks_after[0] == r.ranks_before[0] for r in results)  # a side bond at its bound
    assert type(merged) is type(pm.base_model.model) and isinstance(merged.bert.encoder.layer[0].attention.self.query,
                                                                    TTLinear)
    torch.testing.assert_close(_logits(merged, ids), want, rtol=1e-4, atol=1e-5)
    assert before  # every wrapped layer was reported


def test_an_inexact_merge_warns_and_a_calibrated_one_fits_the_outputs():
    pm, _ = _trained(_compressed())
    ids, _ = _task(16, seed=1)
    want = _logits(pm, ids)
    plain_copy, calibrated_copy, exact_copy = copy.deepcopy(pm), copy.deepcopy(pm), copy.deepcopy(pm)
    with pytest.warns(RuntimeWarning, match="not exact"):
        plain, plain_results = merge_and_unload(plain_copy)
    assert not all(r.exact for r in plain_results) and all(r.output_error is None for r in plain_results)
    with pytest.warns(RuntimeWarning, match="not exact"):
        calibrated, results = merge_and_unload(calibrated_copy, calibration=[{"input_ids": ids}])
    assert all(r.output_error is not None for r in results if not r.exact)
    assert [r.ranks_after for r in results] == [r.ranks_after for r in plain_results]
    plain_gap = (_logits(plain, ids) - want).abs().max()
    calibrated_gap = (_logits(calibrated, ids) - want).abs().max()
    assert calibrated_gap <= plain_gap
    exact, exact_results = merge_and_unload(exact_copy, exact=True)
    assert all(r.exact for r in exact_results)
    torch.testing.assert_close(_logits(exact, ids), want, rtol=1e-4, atol=1e-5)


def test_tt_lora_refuses_what_a_tt_layer_cannot_take():
    with pytest.raises(ValueError, match="DoRA"):
        tt_lora(peft.LoraConfig(target_modules=["query"], use_dora=True))
    with pytest.raises(ValueError, match="fan_in_fan_out"):
        tt_lora(peft.LoraConfig(target_modules=["query"], fan_in_fan_out=True))
    with pytest.raises(TypeError, match="LoraConfig"):
        tt_lora({"target_modules": ["query"]})


def test_compiling_a_model_that_carries_adapters_says_what_to_do():
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32)
    adapted = peft.get_peft_model(transformers.BertModel(cfg), peft.LoraConfig(target_modules=["query"], r=2))
    with pytest.raises(TypeError, match="LoRA adapters.*Compress first.*tt_lora.*merge_and_unload"):
        tncompile.compile(adapted, target_ratio=0.3, example_inputs={"input_ids": torch.randint(0, 120, (2, 8))})
