"""``nn.TransformerEncoder`` (and ``nn.MultiheadAttention``) are traced into: every
projection compresses, and at full rank the compiled model equals the ORIGINAL."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.runtime import TTLinear
from tncompile.runtime.fused.attention import SelfAttention

from full_rank import compile_full_rank


class Classifier(nn.Module):
    def __init__(self, batch_first=True, norm_first=False, activation="relu", dropout=0.0, layers=2):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(1000, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=dropout, activation=activation,
                                           batch_first=batch_first, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(64), enable_nested_tensor=False)
        self.head = nn.Linear(64, 3)

    def forward(self, ids, padding, causal):
        x = self.emb(ids if self.batch_first else ids.t())
        x = self.encoder(x, mask=causal, src_key_padding_mask=padding)
        return self.head(x.mean(1 if self.batch_first else 0))


def _inputs(batch=4, length=12, bool_masks=True):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (batch, length), generator=g)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1:, -3:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(length)  # float, -inf above the diagonal
    if bool_masks:
        causal = torch.isinf(causal)
    else:
        padding = torch.zeros(batch, length).masked_fill(padding, float("-inf"))
    return ids, padding, causal


PROJECTIONS = ("self_attn.in_proj", "self_attn.out_proj", "linear1", "linear2")


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_full_rank_equals_the_original(batch_first, norm_first, activation):
    torch.manual_seed(0)
    model = Classifier(batch_first, norm_first, activation).double()
    names_before = list(model.state_dict())
    compiled = compile_full_rank(model, None)
    assert list(model.state_dict()) == names_before, "the user's model gained or lost state"
    layers = compiled.tensorized_modules()
    for k in range(2):
        for p in PROJECTIONS:
            assert isinstance(layers[f"encoder.layers.{k}.{p}"], TTLinear), p
    ids, padding, causal = _inputs(bool_masks=False)
    # float masks in the model's dtype: torch 2.13's own MultiheadAttention gives float32 masks
    # on a float64 model a different (wrong) result than the same masks as booleans or float64
    for masks in (_inputs(), (ids, padding.double(), causal.double())):
        torch.testing.assert_close(compiled(*masks), model(*masks), rtol=1e-9, atol=1e-9)
        model.eval(), compiled.eval()  # the fast path of the original, the same math here
        torch.testing.assert_close(compiled(*masks), model(*masks), rtol=1e-9, atol=1e-9)
        model.train(), compiled.train()


def test_compresses_trains_saves_and_densifies(tmp_path):
    torch.manual_seed(0)
    model = Classifier(dropout=0.1)
    compiled = tncompile.compile(model, target_ratio=0.3)
    report = str(compiled.report())
    assert "encoder.layers.1.self_attn.in_proj" in report and "encoder.layers.0.linear2" in report
    ids, padding, causal = _inputs()
    labels = torch.tensor([0, 1, 2, 1])
    opt = torch.optim.AdamW(compiled.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(compiled(ids, padding, causal), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    compiled.eval()
    attend = compiled.get_submodule("encoder.layers.0.self_attn.attend")
    assert isinstance(attend, SelfAttention) and not attend.training  # eval() reaches the attention dropout
    out = compiled(ids, padding, causal)
    torch.testing.assert_close(compiled(ids, padding, causal), out)  # no dropout in eval mode
    tncompile.save(compiled, tmp_path / "enc.tnc")
    again = tncompile.load(tmp_path / "enc.tnc", model=Classifier(dropout=0.1)).eval()
    assert torch.equal(again(ids, padding, causal), out)
    dense = compiled.to_dense().eval()
    torch.testing.assert_close(dense(ids, padding, causal), out, rtol=1e-5, atol=1e-5)


def test_inference_fast_path_zeros_at_padded_positions_are_kept():
    """In eval mode without autograd the original encoder runs on nested tensors and
    returns zeros at padded positions (then the final norm); the compiled one too."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    model = _PaddedEncoder(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(64))).eval()  # nested tensors on
    compiled = compile_full_rank(model, None).eval()
    x = torch.randn(3, 10, 64)
    padding = torch.zeros(3, 10, dtype=torch.bool)
    padding[1:, -3:] = True
    with torch.no_grad():
        want = model(x, padding)
        got = compiled(x, padding)
    assert torch.equal(want[1, -1], model.enc.norm.bias.detach())  # the fast path ran in the original
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled(x, padding), model(x, padding), rtol=1e-5, atol=1e-5)  # with autograd


class _PaddedEncoder(nn.Module):
    def __init__(self, enc):
        super().__init__()
        self.enc = enc

    def forward(self, x, padding):
        return self.enc(x, src_key_padding_mask=padding)


class SelfAttentionBlock(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=batch_first)
        self.cross = nn.MultiheadAttention(64, 4, batch_first=batch_first)

    def forward(self, x, memory):
        y, weights = self.attn(x, x, x)                 # need_weights=True by default
        z, _ = self.cross(y, memory, memory)            # cross-attention: left as one call
        return z, weights


@pytest.mark.parametrize("batch_first", [True, False])
def test_standalone_self_attention_with_weights(batch_first):
    torch.manual_seed(0)
    model = SelfAttentionBlock(batch_first).double()
    x = torch.randn(3, 10, 64, dtype=torch.float64)
    memory = torch.randn(3, 7, 64, dtype=torch.float64)
    if not batch_first:
        x, memory = x.transpose(0, 1), memory.transpose(0, 1)
    compiled = compile_full_rank(model, None)
    assert {"attn.in_proj", "attn.out_proj"} <= set(compiled.tensorized_modules())
    assert isinstance(compiled.get_submodule("cross"), nn.MultiheadAttention)  # opaque, still correct
    for got, want in zip(compiled(x, memory), model(x, memory)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_unbatched_self_attention():
    attend = SelfAttention(4, batch_first=False).double()
    mha = nn.MultiheadAttention(64, 4).double()
    x = torch.randn(9, 64, dtype=torch.float64)
    qkv = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
    out, weights = attend(qkv, need_weights=True)
    ref, ref_weights = mha(x, x, x)
    torch.testing.assert_close(F.linear(out, mha.out_proj.weight, mha.out_proj.bias), ref)
    torch.testing.assert_close(weights, ref_weights)
