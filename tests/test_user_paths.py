"""Issue 64 item 7: what users do next with real clients keeps working, on small models.

``generate`` with beam search and with seeded sampling gives what ``to_dense()`` gives; PEFT's
``all-linear`` wraps GPT-2's ``Conv1D`` networks; ``SentenceTransformerTrainer`` trains a
compressed encoder; gradient checkpointing and ``Trainer(bf16=True)`` train one."""
from __future__ import annotations

import warnings

import pytest
import torch

import tncompile
from tncompile.runtime import TTLinear

transformers = pytest.importorskip("transformers")


def _gpt2(ratio=0.4):
    cfg = transformers.GPT2Config(vocab_size=200, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0,
                                  pad_token_id=0)
    torch.manual_seed(0)
    ids = torch.randint(1, 200, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tncompile.compile(transformers.GPT2LMHeadModel(cfg), ratio, example_inputs={"input_ids": ids},
                                  mode="swap")
    with torch.no_grad():   # trained-looking gates: a network that is not its own TT-SVD start
        for m in model.tensorized_modules().values():
            for g in m.gates:
                g.mul_(torch.rand(g.shape, generator=torch.Generator().manual_seed(1)) + 0.5)
    return model.eval(), ids


@pytest.mark.parametrize("how", [dict(num_beams=3, do_sample=False), dict(do_sample=True, top_k=20)])
def test_generate_equals_the_dense_models(how):
    model, ids = _gpt2()
    dense = model.to_dense().eval()
    outs = []
    for m in (model, dense):
        torch.manual_seed(7)
        outs.append(m.generate(ids, max_new_tokens=8, min_new_tokens=8, attention_mask=torch.ones_like(ids), **how))
    assert torch.equal(outs[0], outs[1])


def _trains(model, ids, steps=8):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses[-1] < losses[0]


def test_peft_all_linear_wraps_a_compressed_gpt2s_networks_and_trains():
    peft = pytest.importorskip("peft")
    model, ids = _gpt2()
    pm = peft.get_peft_model(model.train(), peft.LoraConfig(target_modules="all-linear", r=2, lora_alpha=4))
    wrapped = {n: m for n, m in pm.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert {n.rsplit(".", 1)[-1] for n in wrapped} >= {"c_attn", "c_fc", "c_proj"}
    assert all(isinstance(m.get_base_layer(), TTLinear) for m in wrapped.values())
    assert not any("lm_head" in n for n in wrapped)          # the output layer stays out, as PEFT does
    assert _trains(pm, ids)


def test_peft_all_linear_on_dense_conv1d_layers_is_kept_through_compile():
    peft = pytest.importorskip("peft")
    cfg = transformers.GPT2Config(vocab_size=200, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    ids = torch.randint(1, 200, (2, 8))
    pm = peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), peft.LoraConfig(target_modules="all-linear", r=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = tncompile.compile(pm.base_model.model, 0.5, example_inputs={"input_ids": ids}, mode="swap")
    kept = [m for m in compiled.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert kept and all(isinstance(m.get_base_layer(), TTLinear) for m in kept)
    assert _trains(compiled, ids)


def test_gradient_checkpointing_gives_the_same_gradients():
    model, ids = _gpt2()
    model.train()
    plain = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, list(model.parameters()), allow_unused=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    again = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, list(model.parameters()), allow_unused=True)
    for a, b in zip(plain, again):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_trainer_in_bf16_trains_a_compressed_model(tmp_path):
    pytest.importorskip("accelerate")
    model, _ = _gpt2()
    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": x, "labels": x} for x in torch.randint(1, 200, (64, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=8,
                                          learning_rate=3e-3, logging_steps=4, report_to=[], use_cpu=True, seed=0,
                                          disable_tqdm=True, bf16=True, save_strategy="no")
    trainer = transformers.Trainer(model=model.train(), args=args, train_dataset=rows)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(l == l for l in losses) and losses[-1] < losses[0]


@pytest.mark.slow
def test_sentence_transformer_trainer_trains_a_compressed_encoder(tmp_path):
    st_lib = pytest.importorskip("sentence_transformers")
    pytest.importorskip("accelerate")
    datasets = pytest.importorskip("datasets")
    from sentence_transformers import losses, models
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(115)]
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "vocab.txt").write_text("\n".join(words))
    tok = transformers.BertTokenizerFast(vocab_file=str(tmp_path / "dense" / "vocab.txt"))
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "dense")
    tok.save_pretrained(tmp_path / "dense")
    st = st_lib.SentenceTransformer(modules=[models.Transformer(str(tmp_path / "dense"), max_seq_length=16),
                                             models.Pooling(64)], device="cpu")
    enc = tok(["w1 w2 w3"] * 2, padding="max_length", max_length=16, return_tensors="pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st[0].auto_model = tncompile.compile(st[0].auto_model, target_ratio=0.3, mode="swap",
                                             example_inputs={"input_ids": enc["input_ids"],
                                                             "attention_mask": enc["attention_mask"]})
    g = torch.Generator().manual_seed(3)
    anchors = [" ".join(f"w{int(i)}" for i in torch.randint(0, 115, (5,), generator=g)) for _ in range(32)]
    pairs = datasets.Dataset.from_dict({"anchor": anchors, "positive": [a + " w1" for a in anchors]})
    before = st.encode(anchors[:4], convert_to_tensor=True).clone()
    args = st_lib.SentenceTransformerTrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4,
                                                       per_device_train_batch_size=8, report_to=[], use_cpu=True,
                                                       disable_tqdm=True, save_strategy="no")
    trainer = st_lib.SentenceTransformerTrainer(model=st, args=args, train_dataset=pairs,
                                                loss=losses.MultipleNegativesRankingLoss(st))
    trainer.train()
    assert any(isinstance(m, TTLinear) for m in st.modules())
    after = st.encode(anchors[:4], convert_to_tensor=True)
    assert torch.isfinite(after).all() and not torch.allclose(after, before)
