"""Attention with dropout on the native kernel wherever a model calls PyTorch's:
``lower_dropout``'s ``attention-function`` rule (graph mode: ``F.scaled_dot_product_attention``
calls), swap mode's dropout (``tncompile.swap.lowering``) and HF's ``"tncompile_sdpa"``
attention (``tncompile.swap.hf_attention``): the same numbers as PyTorch's in
eval, the native kernel with the mask PyTorch would apply in training, everything
undone by ``to_dense()``, kept by save / load and pickling."""
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.passes import default_pipeline
from tncompile.runtime.ways.attention import native_attention, scaled_dot_product_attention
from tncompile.runtime.fused.dropout import FastDropout
from tncompile.runtime.native import watch

transformers = pytest.importorskip("transformers")
swap_attention = pytest.importorskip("tncompile.swap.hf_attention")
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402


def _bert():
    cfg = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32, num_labels=3,
                                  attention_probs_dropout_prob=0.2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _inputs():
    ids = torch.randint(1, 500, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


def _compile(model, passes=None):
    return tncompile.compile(model, target_ratio=0.5, example_inputs=_inputs(), passes=passes)


def _dropouts(model) -> list[type]:
    return sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.Dropout)})


def test_swap_mode_runs_tncompiles_dropout_and_attention_leaving_the_user_model_alone(ops):
    model = _bert()
    c = _compile(model)
    assert _dropouts(c) == ["FastDropout"] and c.config._attn_implementation == swap_attention.NAME
    assert _dropouts(model) == ["Dropout"] and model.config._attn_implementation == "sdpa"
    assert set(model.state_dict()) == set(c.to_dense().state_dict())
    # eval: the same numbers as the model compiled without the pass (PyTorch's dropout and sdpa)
    plain = _compile(_bert(), passes=default_pipeline().remove("lower_dropout"))
    assert _dropouts(plain) == ["Dropout"] and plain.config._attn_implementation == "sdpa"
    plain.load_state_dict(c.state_dict())
    x = _inputs()
    c.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(c(**x).logits, plain(**x).logits, rtol=1e-5, atol=1e-6)
    # training on CPU: every dropout and attention call on the native kernels, and it learns
    c.train()
    called = []
    with watch(called.append):
        loss = c(**x, labels=torch.tensor([0, 1, 2])).loss
        loss.backward()
    assert called.count("tncompile::attention_forward") == 2 and called.count("tncompile::attention_backward") == 2
    assert called.count("tncompile::dropout_forward") >= 5  # embeddings + 2 per layer (+ the classifier's)
    assert all(p.grad is not None for p in c.parameters() if p.requires_grad)


def test_swapped_dropouts_keep_the_users_hooks():
    model = _bert()
    seen = []
    handle = model.bert.embeddings.dropout.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    c = _compile(model)
    seen.clear()
    c.train()(**_inputs())
    assert seen == ["FastDropout"]
    c.to_dense().train()(**_inputs())
    assert seen == ["FastDropout", "Dropout"]
    handle.remove()  # the user's handle on the original removes nothing from the copies: their own dicts
    c(**_inputs())
    assert len(seen) == 3


def test_to_dense_gives_back_pytorch_dropout_and_sdpa(tmp_path):
    c = _compile(_bert())
    dense = c.to_dense()
    assert type(dense) is transformers.BertForSequenceClassification
    assert _dropouts(dense) == ["Dropout"] and dense.config._attn_implementation == "sdpa"
    assert _dropouts(c) == ["FastDropout"]  # the swapped model keeps its own
    dense.save_pretrained(tmp_path / "dense")
    again = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "dense")
    assert again.config._attn_implementation == "sdpa"


def test_save_load_and_pickle_keep_native_dropout(tmp_path):
    c = _compile(_bert())
    c.save_pretrained(tmp_path / "c")
    loaded = tncompile.load(tmp_path / "c", model=transformers.BertForSequenceClassification)
    assert _dropouts(loaded) == ["FastDropout"] and loaded.config._attn_implementation == swap_attention.NAME
    plain = _compile(_bert(), passes=default_pipeline().remove("lower_dropout"))
    plain.save_pretrained(tmp_path / "plain")
    loaded = tncompile.load(tmp_path / "plain", model=transformers.BertForSequenceClassification)
    assert _dropouts(loaded) == ["Dropout"] and loaded.config._attn_implementation == "sdpa"
    # unpickling registers the attention again (as in a fresh process)
    blob = pickle.dumps(c)
    for interface in (transformers.AttentionInterface, transformers.masking_utils.AttentionMaskInterface):
        interface._global_mapping.pop(swap_attention.NAME)
    back = pickle.loads(blob).eval()
    x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(back(**x).logits, c.eval()(**x).logits)


class _Heads(nn.Module):
    is_causal = False


def _qkv(heads=4, kv_heads=4, length=6, keys=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, heads, length, 8, generator=g, dtype=dtype)
    k = torch.randn(2, kv_heads, keys, 8, generator=g, dtype=dtype)
    v = torch.randn(2, kv_heads, keys, 5, generator=g, dtype=dtype)
    return q, k, v


def _same_seed(f, g):
    torch.manual_seed(7)
    a = f()
    torch.manual_seed(7)
    return a, g()


def test_attention_function_passes_the_kernel_the_mask_sdpa_would_apply(ops):
    q, k, v = _qkv()
    module = _Heads()
    # a padding mask (True = attend) as sdpa_mask gives it
    pad = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    pad[1, ..., 4:] = False
    additive = torch.zeros(2, 1, 6, 6, dtype=q.dtype).masked_fill(~pad, float("-inf"))
    got, want = _same_seed(lambda: swap_attention.attention_forward(module, q, k, v, pad, dropout=0.3)[0],
                           lambda: native_attention(q, k, v, additive, 8 ** -0.5, 0.3).transpose(1, 2))
    assert got.is_contiguous() and got.shape == (2, 6, 4, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # causal, no mask: sdpa's is_causal (query i sees keys 0..i)
    module.is_causal = True
    causal = torch.zeros(6, 6, dtype=q.dtype).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    got, want = _same_seed(lambda: swap_attention.attention_forward(module, q, k, v, None, dropout=0.3, scaling=0.5)[0],
                           lambda: native_attention(q, k, v, causal, 0.5, 0.3).transpose(1, 2))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # grouped-query attention: each key/value head serves two query heads
    q, k, v = _qkv(heads=4, kv_heads=2)
    got, want = _same_seed(
        lambda: swap_attention.attention_forward(module, q, k, v, None, dropout=0.3)[0],
        lambda: native_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal, 8 ** -0.5,
                                 0.3).transpose(1, 2))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_attention_function_is_sdpa_wherever_the_kernel_does_not_apply(ops):
    q, k, v = _qkv(dtype=torch.float32)
    module = _Heads()
    bias = torch.zeros(2, 4, 6, 6, requires_grad=True)  # a learned bias: the kernel takes no mask gradient
    cases = [dict(attention_mask=None, dropout=0.0),  # eval / no dropout
             dict(attention_mask=bias, dropout=0.3)]
    for case in cases:
        called = []
        with watch(called.append):
            got, want = _same_seed(lambda: swap_attention.attention_forward(module, q, k, v, **case)[0],
                                   lambda: sdpa_attention_forward(module, q, k, v, **case)[0])
        assert not called, case
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the dropout the kernel draws: each weight kept with probability 1 - p, scaled by 1 / (1 - p)
    ones = torch.ones(1, 1, 400, 4)
    out = swap_attention.attention_forward(module, ones, ones, torch.eye(400).reshape(1, 1, 400, 400),
                                         None, dropout=0.25, scaling=0.0)[0]
    weights = out.reshape(400, 400) * 400  # uniform softmax: every weight 1/400 before dropout
    kept = weights != 0
    assert abs(kept.double().mean().item() - 0.75) < 0.01
    torch.testing.assert_close(weights[kept], torch.full_like(weights[kept], 1 / 0.75))
    with pytest.raises(ValueError, match="softcap"):  # what sdpa refuses, this refuses too
        swap_attention.attention_forward(module, q, k, v, None, dropout=0.3, softcap=30.0)


class _CausalSelfAttention(nn.Module):
    """nanoGPT's attention: ``F.scaled_dot_product_attention`` with ``dropout_p`` by mode."""

    def __init__(self, dim=64, heads=4, kv_heads=4, p=0.2):
        super().__init__()
        self.heads, self.kv_heads, self.p = heads, kv_heads, p
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim * kv_heads // heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2 * self.kv_heads, -1).transpose(1, 2).chunk(2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def _lowered(compiled) -> int:
    return sum(n.target is scaled_dot_product_attention for n in compiled.program.graph.nodes)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_graph_mode_sdpa_with_dropout_runs_the_native_kernel(ops, kv_heads, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(_CausalSelfAttention(kv_heads=kv_heads), nn.LayerNorm(64),
                          _CausalSelfAttention(kv_heads=kv_heads)).train()
    x = torch.randn(3, 10, 64)
    c = tncompile.compile(model, target_ratio=0.9, mode="graph", example_inputs=(x,))
    counts = next(r.matches for r in c.program.history if r.name == "lower_dropout")
    assert counts["attention-function"] == 2 and _lowered(c) == 2
    assert next(r.matches for r in c.program.history if r.name == "fuse_attention")["already-fused"] == 2
    plain = tncompile.compile(model, target_ratio=0.9, mode="graph", example_inputs=(x,),
                              passes=default_pipeline().remove("lower_dropout"))
    assert _lowered(plain) == 0
    plain.load_state_dict(c.state_dict())
    c.eval(), plain.eval()
    torch.testing.assert_close(c(x), plain(x), rtol=1e-5, atol=1e-6)
    c.train()
    called = []
    with watch(called.append):
        c(x).square().sum().backward()
    assert called.count("tncompile::attention_forward") == 2 and called.count("tncompile::attention_backward") == 2
    path = tmp_path / "m.tnc"
    tncompile.save(c, path)
    back = tncompile.load(path, model=nn.Sequential(_CausalSelfAttention(kv_heads=kv_heads), nn.LayerNorm(64),
                                                    _CausalSelfAttention(kv_heads=kv_heads))).eval()
    assert _lowered(back) == 2
    torch.testing.assert_close(back(x), c.eval()(x))
    assert _lowered(pickle.loads(pickle.dumps(c))) == 2


def test_drop_in_sdpa_equals_pytorchs_where_the_kernel_does_not_apply_and_masks_like_it(ops):
    q, k, v = _qkv()
    # no dropout, or a causal flag with a mask (PyTorch refuses it): PyTorch's own call
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        scaled_dot_product_attention(q, k, v, torch.ones(6, 6, dtype=torch.bool), 0.3, is_causal=True)
    # a float mask and a broadcast boolean one reach the kernel as PyTorch would apply them
    bias = torch.randn(1, 4, 6, 6, dtype=q.dtype)
    got, want = _same_seed(lambda: scaled_dot_product_attention(q, k, v, bias, 0.3, scale=0.3),
                           lambda: native_attention(q, k, v, bias, 0.3, 0.3))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    keep = torch.rand(6, 6) > 0.3
    keep[:, 0] = True
    additive = torch.zeros(6, 6, dtype=q.dtype).masked_fill(~keep, float("-inf"))
    got, want = _same_seed(lambda: scaled_dot_product_attention(q, k, v, keep, 0.3),
                           lambda: native_attention(q, k, v, additive, 8 ** -0.5, 0.3))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # float64 gradients of the lowered call against PyTorch's math at p -> 0 are covered by the kernel's own
    # gradcheck (test_attention_kernel.py); here: the same call gradchecks through the mask conversion
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    torch.autograd.gradcheck(lambda a, b, c: _seeded(lambda: scaled_dot_product_attention(a, b, c, keep, 0.3)),
                             (q, k, v))


def _seeded(f):
    torch.manual_seed(3)
    return f()


def test_models_whose_code_names_sdpa_keep_it():
    """Falcon's code branches on ``_attn_implementation == "sdpa"``: under another name it
    would take its other path, so its attention stays ``"sdpa"`` (its dropout modules still
    lower -- transformers 5.25's Falcon has none left: its dropouts are functional)."""
    cfg = transformers.FalconConfig(vocab_size=300, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    attention_dropout=0.1, hidden_dropout=0.1)
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(cfg)
    assert model.config._attn_implementation == "sdpa"
    had_dropouts = bool(_dropouts(model))
    ids = torch.randint(0, 300, (2, 8))
    c = tncompile.compile(model, target_ratio=0.9, example_inputs={"input_ids": ids})
    assert c.config._attn_implementation == "sdpa"
    assert _dropouts(c) == (["FastDropout"] if had_dropouts else [])
    assert c(ids).logits.shape == (2, 8, 300)


def test_a_query_with_no_key_gets_zeros_as_from_sdpa(ops):
    """A mask leaving a query no key: zeros there (PyTorch's answer; the written softmax's
    NaN stays FusedAttention's), the kernel still runs, the other rows as with the kernel,
    gradients finite -- so no call reads the mask's values, under torch.compile too."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[0, :, 2] = False  # query 2 of sequence 0 sees no key
    called = []
    with watch(called.append):
        got = _seeded(lambda: scaled_dot_product_attention(q, k, v, keep, 0.3))
        got.sum().backward()
    assert "tncompile::attention_forward" in called and "tncompile::attention_backward" in called
    assert torch.equal(got[0, :, 2], torch.zeros_like(got[0, :, 2]))
    additive = torch.zeros(2, 1, 6, 6, dtype=q.dtype).masked_fill(~keep, float("-inf"))
    plain = _seeded(lambda: native_attention(q, k, v, additive, 8 ** -0.5, 0.3))
    assert torch.isnan(plain[0, :, 2]).all()  # without empty_rows_zero: the written softmax's NaN
    rows = torch.ones(6, dtype=torch.bool)
    rows[2] = False
    torch.testing.assert_close(got[0][:, rows], plain[0][:, rows], rtol=0, atol=0)
    torch.testing.assert_close(got[1], plain[1], rtol=0, atol=0)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, keep)[0, :, 2],
                               torch.zeros_like(got[0, :, 2]))  # what PyTorch gives there
