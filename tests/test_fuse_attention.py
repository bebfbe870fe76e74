"""The fuse_attention pass: hand-written attention -> one scaled_dot_product_attention call."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.runtime.fused.attention import FusedAttention
from tncompile.runtime.fused.dropout import FastDropout
from tncompile.testing import SixEncoder

f64 = torch.float64


def _fuse_counts(compiled) -> dict:
    return next(r.matches for r in compiled.program.history if r.name == "fuse_attention")


def _fused_modules(compiled) -> list[FusedAttention]:
    return [m for m in compiled.modules() if isinstance(m, FusedAttention)]


class _Written(nn.Module):
    """Attention spelled one of several ways (the scale, the mask operand order, softmax's form)."""

    def __init__(self, form: str, dim: int = 16, heads: int = 2, p: float = 0.0):
        super().__init__()
        self.form, self.heads = form, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.drop = nn.Dropout(p)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        s = torch.matmul(q, k.transpose(-2, -1))
        if self.form == "mul-mask-first":
            w = F.softmax(mask + s * (1 / math.sqrt(d // self.heads)), dim=-1)
        elif self.form == "no-scale":
            w = torch.softmax(s + mask, -1)
        elif self.form == "no-mask":
            w = (s / math.sqrt(d // self.heads)).softmax(dim=-1)
        else:  # "div-mask"
            w = (s / math.sqrt(d // self.heads) + mask).softmax(-1)
        return (self.drop(w) @ v).transpose(1, 2).reshape(b, t, d)


@pytest.mark.parametrize("form", ["div-mask", "mul-mask-first", "no-scale", "no-mask"])
def test_each_spelling_fuses_and_equals_the_written_steps(form):
    torch.manual_seed(0)
    model = _Written(form).double().eval()
    x = torch.randn(3, 8, 16, dtype=f64)
    mask = torch.zeros(3, 1, 1, 8, dtype=f64)
    mask[0, ..., 5:] = -1e9
    compiled = tncompile.compile(model, target_ratio=1.0, mode="graph", example_inputs=(x, mask))
    assert _fuse_counts(compiled)["attention"] == 1 and len(_fused_modules(compiled)) == 1
    assert not any(n.target == "softmax" or n.target in (torch.softmax, F.softmax)
                   for n in compiled.model.graph.nodes), "the softmax was left in the graph"
    x.requires_grad_()
    got, want = compiled(x, mask), model(x, mask)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.square().sum(), [x, *compiled.parameters()])
    g_want = torch.autograd.grad(want.square().sum(), [x, *model.parameters()])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)


def test_fused_call_gradchecks_against_the_written_steps():
    """float64: the fused call's gradients (q, k, v) are the written steps' (gradcheck), and
    its values equal them."""
    torch.manual_seed(0)
    fused = FusedAttention("div", nn.Dropout(0.2).eval())
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=f64, requires_grad=True) for _ in range(3))
    mask = torch.randn(2, 1, 1, 5, dtype=f64)
    torch.testing.assert_close(fused.fused(q, k, v, mask, 2.0), fused.unfused(q, k, v, mask, 2.0))
    assert torch.autograd.gradcheck(lambda q, k, v: fused.fused(q, k, v, mask, 2.0), (q, k, v))


@pytest.mark.parametrize("scaling", ["div", "mul", "none"])
@pytest.mark.parametrize("mask_shape", [None, (2, 1, 1, 5), (2, 2, 5, 5), (5,)])
def test_unfused_steps_equal_the_written_ones_and_gradcheck(scaling, mask_shape):
    """float64: the unfused path (scale folded into q, mask added in place) computes
    ``softmax(scale(q @ k.T) + mask) @ v`` as written, values and gradients -- also for
    a mask that needs a gradient."""
    torch.manual_seed(0)
    fused = FusedAttention(scaling, None)
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=f64, requires_grad=True) for _ in range(3))
    mask = None if mask_shape is None else torch.randn(*mask_shape, dtype=f64, requires_grad=True)

    def written(q, k, v, mask):
        s = q @ k.transpose(-2, -1)
        s = s / 2.0 if scaling == "div" else s * 2.0 if scaling == "mul" else s
        return (s if mask is None else s + mask).softmax(-1) @ v
    torch.testing.assert_close(fused.unfused(q, k, v, mask, 2.0), written(q, k, v, mask))
    inputs = (q, k, v) if mask is None else (q, k, v, mask)
    assert torch.autograd.gradcheck(lambda *t: fused.unfused(*t[:3], t[3] if len(t) > 3 else None, 2.0), inputs)


def test_six_encoder_fuses_every_layer_matches_the_original_and_reloads(tmp_path):
    torch.manual_seed(0)
    model = SixEncoder(vocab_size=100, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=16,
                       num_classes=2).eval()
    ids = torch.randint(1, 100, (3, 16))
    ids[0, 10:] = 0                                           # padding: the additive mask matters
    compiled = tncompile.compile(model, target_ratio=1.0, mode="graph", example_inputs=(ids,))
    assert _fuse_counts(compiled) == {"attention": 2, "already-fused": 0}
    fused = _fused_modules(compiled)
    assert fused[0].dropout is compiled.model.get_submodule("layers.0.attention.fused_attention.dropout")
    assert isinstance(fused[0].dropout, FastDropout) and fused[0].dropout.p == 0.1     # lowered, then absorbed
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    compiled.train()
    assert fused[0].dropout_p() == 0.1
    tncompile.save(compiled, tmp_path / "fused.tnc")
    loaded = tncompile.load(tmp_path / "fused.tnc", model=SixEncoder(vocab_size=100, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                                                                    max_len=16, num_classes=2)).eval()
    compiled.eval()
    assert sorted(n for n, _ in loaded.named_modules()) == sorted(n for n, _ in compiled.named_modules())
    with torch.no_grad():
        assert torch.equal(loaded(ids), compiled(ids))
    assert "-fuse_attention: attention 2, already-fused 0" in compiled.program.dump()
    assert "attention.fused_attention(" in compiled.program.dump()


def test_dropout_follows_train_and_eval_and_keeps_its_distribution():
    """Uniform weights (q = k = 0) times the identity show the dropped weights themselves: in
    training each is 0 with probability p and 1/(S(1-p)) otherwise, through the fused kernel
    and through the written steps alike; in eval none is dropped."""
    S, p = 64, 0.3
    drop = nn.Dropout(p)
    fused = FusedAttention("none", drop)
    q = k = torch.zeros(4, 8, S, 16)
    v = torch.eye(S).expand(4, 8, S, S).contiguous()
    torch.manual_seed(0)
    outputs = {"written": fused(q, k, v),                     # CPU + dropout: the written steps
               "fused": fused.fused(q, k, v)}                 # the kernel call (CUDA runs this one)
    for name, out in outputs.items():
        zeros = float((out == 0).double().mean())
        assert abs(zeros - p) < 0.01, f"{name}: {zeros:.4f} of the weights dropped, expected {p}"
        kept = out[out != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / (S * (1 - p))), msg=name)
    fused.eval()
    assert fused.dropout_p() == 0.0
    torch.testing.assert_close(fused(q, k, v), torch.full((4, 8, S, S), 1 / S))


def test_attention_whose_weights_are_read_elsewhere_is_left_as_written():
    class ReturnsWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.value = nn.Linear(16, 16)  # small: stays dense

        def forward(self, q, k, x):
            w = (q @ k.transpose(-1, -2) / 2.0).softmax(-1)
            return w @ self.value(x), w

    model = ReturnsWeights()
    q, k, x = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 16)
    compiled = tncompile.compile(model, target_ratio=1.0, mode="graph", example_inputs=(q, k, x))
    assert _fuse_counts(compiled)["attention"] == 0
    for a, b in zip(compiled(q, k, x), model(q, k, x)):
        torch.testing.assert_close(a, b)


def test_inputs_the_kernel_does_not_take_run_the_written_steps():
    """A boolean mask adds 0/1 to the scores as written (the kernel would read it as
    'attend'); broadcasting matmuls and masks that widen the scores: the written steps."""
    fused = FusedAttention("div")
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    bool_mask = torch.rand(2, 1, 5, 5) > 0.5
    torch.testing.assert_close(fused(q, k, v, bool_mask, 2.0), fused.unfused(q, k, v, bool_mask, 2.0))
    wide = torch.randn(4, 2, 3, 5, 5)
    assert fused(q, k, v, wide, 2.0).shape == (4, 2, 3, 5, 4)
    k2, v2 = torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)            # the matmul broadcasts k
    torch.testing.assert_close(fused(q, k2, v2, None, 2.0), fused.unfused(q, k2, v2, None, 2.0))
    temperature = torch.tensor(2.0)                                      # a tensor scale
    torch.testing.assert_close(fused(q, k, v, None, temperature), fused.unfused(q, k, v, None, 2.0))


def test_modules_that_already_run_fused_attention_are_counted():
    """nn.TransformerEncoder (the frontend's SelfAttention) and HF BERT (its sdpa calls)."""
    import transformers
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    compiled = tncompile.compile(encoder, target_ratio=0.5, mode="graph", example_inputs=(torch.randn(2, 8, 64),))
    assert _fuse_counts(compiled) == {"attention": 0, "already-fused": 2}
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32))
    compiled = tncompile.compile(bert, target_ratio=0.5, mode="graph",
                                 example_inputs={"input_ids": torch.randint(0, 300, (2, 8))})
    assert _fuse_counts(compiled) == {"attention": 0, "already-fused": 2}


def test_hf_eager_attention_fuses_and_the_model_equals_the_original():
    """HF BERT with attn_implementation="eager" (matmul, scale, mask, softmax, dropout, matmul;
    traced by torch.export, so the aten spellings) at full rank: one fused call per layer,
    outputs equal to the original's with a padding mask, in eval."""
    import transformers
    from full_rank import compile_full_rank
    config = transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    bert = transformers.BertModel(config).eval()
    ids = torch.randint(1, 300, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    compiled = compile_full_rank(bert, {"input_ids": ids, "attention_mask": mask}, mode="graph").eval()
    assert _fuse_counts(compiled)["attention"] == 2
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   bert(input_ids=ids, attention_mask=mask).last_hidden_state, rtol=1e-5, atol=1e-5)
