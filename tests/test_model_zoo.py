"""Fifteen transformers 5.x families, as a user meets them: compiled from
``input_ids`` / ``pixel_values`` alone, trained 20 steps, saved and loaded,
and ``to_dense()`` equal to the compiled model (small configs, no downloads)."""
import pytest
import torch

import tncompile

transformers = pytest.importorskip("transformers")
T = transformers

V = 1000
_ENC = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64)
_DEC = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_VISION = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128)

# family -> (model factory, inputs: "text" | "image" | "text+image" | "seq2seq")
FAMILIES = {
    "bert": (lambda: T.BertForSequenceClassification(T.BertConfig(**_ENC, num_labels=3)), "text"),
    "roberta": (lambda: T.RobertaForMaskedLM(T.RobertaConfig(**_ENC, pad_token_id=1)), "text"),
    "deberta-v2": (lambda: T.DebertaV2ForSequenceClassification(T.DebertaV2Config(**_ENC, num_labels=3)), "text"),
    "modernbert": (lambda: T.ModernBertForMaskedLM(T.ModernBertConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0,
        sep_token_id=0)), "text"),
    "distilbert": (lambda: T.DistilBertForSequenceClassification(T.DistilBertConfig(
        vocab_size=V, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64)), "text"),
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(**_VISION, num_labels=3)), "image"),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                    bos_token_id=0, eos_token_id=0)), "text"),
    "llama-tied": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**_DEC, tie_word_embeddings=True)), "text"),
    "llama-untied": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**_DEC, tie_word_embeddings=False)), "text"),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**_DEC)), "text"),
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**_DEC)), "text"),
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(**_DEC, num_local_experts=4,
                                                             num_experts_per_tok=2)), "text"),
    "qwen2-moe": (lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **_DEC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128)), "text"),
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0)), "seq2seq"),
    "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)), "text"),
    "clip": (lambda: T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=2,
                         pad_token_id=1),
        vision_config=_VISION, projection_dim=32)), "text+image"),
}


def _inputs(kind: str) -> dict:
    ids = torch.randint(3, V, (2, 16))
    pixels = torch.randn(2, 3, 32, 32)
    return {"text": {"input_ids": ids}, "image": {"pixel_values": pixels},
            "text+image": {"input_ids": ids, "pixel_values": pixels},
            "seq2seq": {"input_ids": ids, "decoder_input_ids": ids[:, :8]}}[kind]


def _scores(out) -> torch.Tensor:
    return out.logits_per_image if getattr(out, "logits", None) is None else out.logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_compiles_trains_saves_and_densifies(family, tmp_path):
    torch.manual_seed(0)
    make, kind = FAMILIES[family]
    model = make().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = _inputs(kind)
    compiled = tncompile.compile(model, mode="graph", target_ratio=0.3, example_inputs=inputs)
    assert compiled.ratio <= 0.3
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the user's model is untouched

    compiled.train()
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        loss = _scores(compiled(**inputs)).float().logsumexp(-1).mean()  # any differentiable scalar
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]

    compiled.eval()
    path = tmp_path / f"{family}.tnc"
    tncompile.save(compiled, path)
    loaded = tncompile.load(path, model=make().eval())
    with torch.no_grad():
        got = _scores(compiled(**inputs))
        assert torch.equal(_scores(loaded(**inputs)), got)
        dense = _scores(compiled.to_dense().eval()(**inputs))
    assert ((got - dense).norm() / dense.norm()) < 1e-5
