"""Compiled models against the ORIGINAL model at full rank (every network exact):
embedding subclasses keep their own operations (BART's +2 positions,
``embed_scale``), shared tables stay shared, MoE experts are outlined exactly."""
import pytest
import torch
from torch import nn

from full_rank import compile_full_rank
from tncompile.runtime.layers.module_kinds import replaces_forward
from tncompile.swap.subclass import network_of
from tncompile.runtime import TTMEmbedding

transformers = pytest.importorskip("transformers")
T = transformers

_DEC = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_BART = dict(vocab_size=1000, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
             pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)

MODELS = {
    "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(**_BART, scale_embedding=False)),
    "bart-scaled": lambda: T.BartForConditionalGeneration(T.BartConfig(**_BART, scale_embedding=True)),
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**_DEC, head_dim=16, sliding_window=8)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                          num_heads=4, decoder_start_token_id=0, pad_token_id=0)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**_DEC)),
    "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**_DEC, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("mode", ["graph", "swap"])
@pytest.mark.parametrize("family", list(MODELS))
def test_full_rank_compiled_model_equals_the_original(family, mode):
    torch.manual_seed(0)
    model = MODELS[family]().eval()
    # MoE: HF's grouped GEMM has no float64 kernel on CPU
    model = model.float() if family == "mixtral" else model.double()
    ids = torch.randint(3, 1000, (2, 16))
    inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :8]} if family == "t5" else {"input_ids": ids}
    compiled = compile_full_rank(model, inputs, mode=mode).eval()
    with torch.no_grad():
        want = model(**inputs).logits
        got = compiled(**inputs).logits
    assert ((got - want).norm() / want.norm()) < 1e-5
    if mode == "swap":  # subclasses with a forward of their own (BART's positions, Gemma's scaled table)
        assert isinstance(compiled, type(model)) and compiled.tensorized_modules()
        own = [path for path, layer in model.named_modules() if replaces_forward(layer)]
        swapped = [p for p in own if p in compiled.tensorized_modules()]
        assert bool(swapped) == (family in ("bart", "bart-scaled", "gemma3")), (own, swapped)
        for p in swapped:  # the user's own class runs the network: same name, isinstance holds
            layer = compiled.get_submodule(p)
            assert isinstance(layer, type(model.get_submodule(p))) and type(layer).__name__ == type(
                model.get_submodule(p)).__name__
            assert network_of(layer) is compiled.tensorized_modules()[p]
        dense = compiled.to_dense()
        assert all(type(dense.get_submodule(p)) is type(model.get_submodule(p)) for p in own)
        with torch.no_grad():
            again = dense(**inputs).logits
        assert ((again - want).norm() / want.norm()) < 1e-5
        return
    if family.startswith("bart") or family == "t5":  # the shared table is one TTM network for every lookup
        enc, dec = compiled.model.model.encoder if family != "t5" else compiled.model.encoder, \
            compiled.model.model.decoder if family != "t5" else compiled.model.decoder
        assert isinstance(enc.embed_tokens, TTMEmbedding) and enc.embed_tokens is dec.embed_tokens
        dense = compiled.to_dense()
        prefix = "model." if family != "t5" else ""
        assert (dense.get_submodule(f"{prefix}encoder.embed_tokens").weight
                is dense.get_submodule(f"{prefix}decoder.embed_tokens").weight)


class _ShiftedScaled(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids + 2) * 3.0


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = _ShiftedScaled(1000, 64)
        self.out = nn.Linear(64, 64)

    def forward(self, ids):
        return self.out(self.emb(ids))


def test_embedding_subclass_traced_by_fx_keeps_its_operations():
    torch.manual_seed(0)
    model = _Model().double().eval()
    ids = torch.randint(0, 998, (2, 16))
    compiled = compile_full_rank(model, (ids,))
    assert compiled.program.inputs.frontend == "fx"
    assert isinstance(compiled.tensorized_modules()["emb"], TTMEmbedding)
    with torch.no_grad():
        assert torch.allclose(compiled(ids), model(ids), atol=1e-10)
