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
        plain, plain_results = merge_and_unload(plain_copy, exact=False)
    assert not all(r.exact for r in plain_results) and all(r.output_error is None for r in plain_results)
    with pytest.warns(RuntimeWarning, match="not exact"):
        calibrated, results = merge_and_unload(calibrated_copy, calibration=[{"input_ids": ids}], exact=False)
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


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_compiling_a_model_that_carries_adapters_keeps_them(family, tmp_path):
    """compile(peft_model): the layers under the adapters are compressed, the adapters kept as
    they were (dense, trainable, same values) and acting on the networks; merging folds them
    into the networks; the user's model is untouched."""
    torch.manual_seed(0)
    ids = torch.randint(0, 120, (4, 16))
    if family == "bert":
        cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=32)
        base, targets, example = transformers.BertModel(cfg), ["query", "value"], {"input_ids": ids}
    else:
        cfg = transformers.GPT2Config(vocab_size=120, n_embd=64, n_layer=1, n_head=4, n_positions=32)
        base, targets = transformers.GPT2LMHeadModel(cfg), ["c_attn"]
        example = {"input_ids": ids, "use_cache": False}
    adapted = peft.get_peft_model(base, peft.LoraConfig(target_modules=targets, r=2, init_lora_weights=False))
    before = {n: p.detach().clone() for n, p in adapted.named_parameters() if "lora_" in n}
    compiled = tncompile.compile(adapted, target_ratio=0.99, prefer="size", example_inputs=example)
    assert type(compiled) is type(adapted) and compiled is not adapted
    wrappers = {n: m for n, m in compiled.named_modules() if isinstance(m, TTLoraLinear)}
    assert wrappers and all(isinstance(m.get_base_layer(), TTLinear) for m in wrappers.values())
    assert not any(isinstance(m, TTLinear) for n, m in compiled.named_modules() if "lora_" in n)
    got = {n: p for n, p in compiled.named_parameters() if "lora_" in n}
    assert got.keys() == before.keys() and all(torch.equal(got[n], before[n]) for n in before)
    assert all(p.requires_grad for p in got.values())
    assert not any(isinstance(m, TTLinear) for m in adapted.modules())  # the user's model is untouched
    inner = compiled.base_model.model
    assert inner.ratio > 0.5 and inner.tensorized_modules()
    compiled.eval()
    x = torch.randn(3, 64)
    with torch.no_grad():
        for w in wrappers.values():  # each layer: the network plus the very adapter it had
            a, b = w.lora_A["default"], w.lora_B["default"]
            torch.testing.assert_close(w(x), w.get_base_layer()(x) + b(a(x)) * w.scaling["default"])
        got_out = compiled(**example)
        with compiled.disable_adapter():
            without = compiled(**example)
    key = "last_hidden_state" if family == "bert" else "logits"
    assert not torch.allclose(without[key], got_out[key])  # the adapters act
    merged, results = merge_and_unload(compiled, exact=True)
    assert results and all(r.exact for r in results)
    with torch.no_grad():
        torch.testing.assert_close(merged(**example)[key], got_out[key], rtol=1e-4, atol=1e-5)


def test_compiling_adapters_tncompile_cannot_keep_is_refused_before_anything_changes():
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32)
    dora = peft.get_peft_model(transformers.BertModel(cfg), peft.LoraConfig(target_modules=["query"], r=2,
                                                                            use_dora=True))
    example = {"input_ids": torch.randint(0, 120, (2, 8))}
    with pytest.raises(TypeError, match="DoRA.*merge_and_unload"):
        tncompile.compile(dora, target_ratio=0.3, example_inputs=example)
    with pytest.raises(ValueError, match="swap mode"):
        tncompile.compile(dora, target_ratio=0.3, example_inputs=example, mode="graph")


@pytest.mark.parametrize("first", ["tncompile", "peft"])
def test_importing_peft_is_enough_to_compile_a_model_with_adapters(first):
    """tncompile's LoRA support registers itself when PEFT is imported, in either order."""
    import subprocess
    import sys
    imports = "import tncompile, peft" if first == "tncompile" else "import peft, tncompile"
    script = f"""{imports}
import sys, torch, transformers
assert 'tncompile.integrations.peft_lora' in sys.modules
cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=128, max_position_embeddings=32)
adapted = peft.get_peft_model(transformers.BertModel(cfg), peft.LoraConfig(target_modules=["query"], r=2))
c = tncompile.compile(adapted, target_ratio=0.5, example_inputs={{"input_ids": torch.randint(0, 120, (2, 8))}})
print(type(c.base_model.model.encoder.layer[0].attention.self.query).__name__)"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "TTLoraLinear", run.stderr[-2000:]


def test_peft_s_ordinary_calls_work_on_a_compressed_model(tmp_path):
    """Issue 52: get_peft_model with a plain LoraConfig (no tt_lora), PeftModel.from_pretrained
    without config=, and PEFT's own merge_and_unload with every linear targeted: the merged
    model gives the adapted model's logits (exact merges), not a 1% refit."""
    c = _compressed()
    c.save_pretrained(tmp_path / "base")
    targets = ["query", "key", "value", "dense"]
    pm = peft.get_peft_model(c, peft.LoraConfig(target_modules=targets, r=4, lora_alpha=8, init_lora_weights=False))
    wrapped = [m for m in pm.modules() if isinstance(m, TTLoraLinear)]
    assert len(wrapped) == sum(isinstance(m, TTLinear) for m in c.modules() if not isinstance(m, TTLoraLinear)) > 4
    ids, _ = _task(8, seed=1)
    want = _logits(pm.eval(), ids)
    pm.save_pretrained(tmp_path / "adapters")
    base = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "base")
    again = peft.PeftModel.from_pretrained(base, tmp_path / "adapters")
    torch.testing.assert_close(_logits(again.eval(), ids), want, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # exact: no refit warning
        merged = again.merge_and_unload()
    assert not any(isinstance(m, TTLoraLinear) for m in merged.modules())
    torch.testing.assert_close(_logits(merged, ids), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(tncompile.ModelFileError, match="regular expression"):  # configs are checked on the way
        peft.get_peft_model(_compressed(), peft.LoraConfig(target_modules=["query", "(a+)+$"], r=4))


def test_an_adapter_targeting_a_core_parameter_is_refused_when_it_loads(tmp_path):
    """Issue 65 item 5: ``target_parameters`` naming a TT core (``...query.cores.0``) used to
    load and then fail at the first forward with a raw ``IndexError``; it is refused when the
    adapter is made or loaded, naming the parameter and the fix."""
    c = _compressed()
    name = next(n for n in dict(c.named_parameters()) if n.endswith("query.cores.0"))
    config = peft.LoraConfig(target_modules=[], target_parameters=[name], r=2)
    with pytest.raises(tncompile.ModelFileError, match=r"query\.cores\.0.*core or gate of a compressed layer"):
        peft.get_peft_model(c, config)
    plain = peft.get_peft_model(_compressed(), peft.LoraConfig(target_modules=["query"], r=2))   # an adapter folder,
    plain.save_pretrained(tmp_path / "adapter")                                                # then edited by hand
    import json
    path = tmp_path / "adapter" / "adapter_config.json"
    data = json.loads(path.read_text())
    data.update(target_modules=[], target_parameters=[name])
    path.write_text(json.dumps(data))
    with pytest.raises(tncompile.ModelFileError, match="core or gate of a compressed layer"):
        peft.PeftModel.from_pretrained(_compressed(), tmp_path / "adapter")
