"""HuggingFace transformers 5.x models built from configs (no downloads), via torch.export."""
import pytest
import torch

import tncompile
from tncompile.runtime import TTLinear, TTMEmbedding, TTMTiedLinear

transformers = pytest.importorskip("transformers")


@pytest.fixture
def bert():
    cfg = transformers.BertConfig(vocab_size=2000, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=256,
                                  max_position_embeddings=64, num_labels=3)
    return transformers.BertForSequenceClassification(cfg).eval()


@pytest.fixture
def gpt2():
    cfg = transformers.GPT2Config(vocab_size=2000, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_bert_compile_forward_backward(bert):
    ids = torch.randint(0, 2000, (2, 16))
    snap = {k: v.clone() for k, v in bert.state_dict().items()}
    c = tncompile.compile(bert, target_ratio=0.3, example_inputs={"input_ids": ids})
    assert c.program.inputs.frontend == "export"
    assert c.ratio <= 0.3
    tn = c.tensorized_modules()
    assert isinstance(tn["bert.embeddings.word_embeddings"], TTMEmbedding)
    assert isinstance(tn["bert.encoder.layer.0.attention.self.query"], TTLinear)
    out = c(input_ids=torch.randint(0, 2000, (3, 10)))  # other batch and sequence sizes
    assert type(out).__name__ == "SequenceClassifierOutput" and out.logits.shape == (3, 3)
    c.train()
    loss = torch.nn.functional.cross_entropy(c(input_ids=ids).logits, torch.tensor([0, 1]))
    loss.backward()
    assert tn["bert.encoder.layer.0.intermediate.dense"].cores[0].grad is not None
    assert all(torch.equal(v, snap[k]) for k, v in bert.state_dict().items())


def test_bert_full_rank_matches_original(bert):
    bert = bert.double()
    ids = torch.randint(0, 2000, (2, 12))
    c = tncompile.compile(bert, target_ratio=1.0, example_inputs={"input_ids": ids},
                          target_modules=["query", "key", "value"])
    ref = bert(input_ids=ids).logits
    # at the break-even rank the error is TT-SVD's truncation error, small but not zero
    rel = (c(input_ids=ids).logits - ref).norm() / ref.norm()
    assert rel < 0.5
    dense = c.to_dense()
    assert torch.allclose(dense(input_ids=ids).logits, c(input_ids=ids).logits, atol=1e-10)


def test_gpt2_tied_weights_stay_tied_through_compile_save_load(gpt2, tmp_path):
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    ids = torch.randint(0, 2000, (2, 16))
    c = tncompile.compile(gpt2, mode="graph", target_ratio=0.3, example_inputs={"input_ids": ids, "use_cache": False})
    head, wte = c.model.lm_head, c.model.transformer.wte
    assert isinstance(head, TTMTiedLinear) and head.embedding is wte
    assert {id(p) for p in head.parameters()} <= {id(p) for p in wte.parameters()}
    assert isinstance(c.model.get_submodule("transformer.h.0.attn.c_attn"), TTLinear)  # HF Conv1D
    out = c(input_ids=ids)  # use_cache was specialized: callers may omit it
    assert out.logits.shape == (2, 16, 2000)
    c.train()
    out = c(input_ids=ids)
    out.logits.logsumexp(-1).mean().backward()
    assert wte.cores[1].grad is not None
    c.eval()
    path = tmp_path / "gpt2.tnc"
    tncompile.save(c, path)
    loaded = tncompile.load(path, model=transformers.GPT2LMHeadModel(gpt2.config))
    assert loaded.model.lm_head.embedding is loaded.model.transformer.wte
    assert torch.equal(loaded(input_ids=ids).logits, c(input_ids=ids).logits)
    dense = c.to_dense()
    assert dense.lm_head.weight is dense.transformer.wte.weight
    with pytest.raises(ValueError, match="specialized to False"):
        c(input_ids=ids, use_cache=True)


def test_hf_missing_example_inputs_explains(bert):
    with pytest.raises(tncompile.TraceError, match="Pass example_inputs"):
        tncompile.compile(bert, target_ratio=0.3)


def test_dropout_follows_train_eval_after_export(gpt2):
    ids = torch.randint(0, 2000, (2, 16))
    c = tncompile.compile(gpt2, target_ratio=0.5, example_inputs={"input_ids": ids, "use_cache": False})
    c.eval()
    assert torch.equal(c(input_ids=ids).logits, c(input_ids=ids).logits)
    c.train()
    assert not torch.equal(c(input_ids=ids).logits, c(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["bert-mlm", "roberta-mlm"])
def test_tied_head_with_padding_to_dense_matches_compiled(family):
    """A head tied to an embedding with a padding row (BertForMaskedLM, RoBERTa):
    to_dense() equals the compiled model to float rounding, padding ids included."""
    torch.manual_seed(0)
    common = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=64)
    if family == "bert-mlm":
        model = transformers.BertForMaskedLM(transformers.BertConfig(**common)).eval()
    else:
        model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**common, pad_token_id=1)).eval()
    ids = torch.randint(3, 1000, (2, 16))
    ids[:, -3:] = model.config.pad_token_id
    c = tncompile.compile(model, mode="graph", target_ratio=0.3, example_inputs={"input_ids": ids}).eval()
    assert any(isinstance(m, TTMTiedLinear) for m in c.tensorized_modules().values())
    dense = c.to_dense().eval()
    with torch.no_grad():
        got, want = c(input_ids=ids).logits, dense(input_ids=ids).logits
    assert ((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decoders_compile_from_input_ids_alone(family):
    """No use_cache=False needed: the trace fixes it (a training graph returns no
    key/value cache), the compiled model and to_dense() both take input_ids alone."""
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=2000, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    model.eval()
    ids = torch.randint(0, 2000, (2, 16))
    c = tncompile.compile(model, mode="graph", target_ratio=0.3, example_inputs={"input_ids": ids}).eval()
    assert c.program.inputs.constants == {"use_cache": False}
    with torch.no_grad():
        out = c(input_ids=ids)
        assert out.past_key_values is None
        dense = c.to_dense()(input_ids=ids).logits
    assert ((out.logits - dense).norm() / dense.norm()) < 1e-5
    with pytest.raises(ValueError, match="use_cache=True"):
        tncompile.compile(model, target_ratio=0.3, example_inputs={"input_ids": ids, "use_cache": True})
