"""torch.compile as a second witness: compiled models trace whole, forward and backward."""
import pytest
import torch
import torch.nn.functional as F

import tncompile
from tncompile.testing import six_encoder, small_encoder


def _bert():
    import transformers as tf
    cfg = tf.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, num_labels=3)
    ids = torch.randint(0, 1000, (2, 16))
    return tncompile.compile(tf.BertForSequenceClassification(cfg).eval(), target_ratio=0.3,
                             example_inputs={"input_ids": ids}), {"input_ids": ids}, (lambda out: out.logits)


def _six():
    """The paper's six-encoder, two of its layers (every layer is traced alike; six only
    take three times as long to trace and compile)."""
    ids = torch.randint(1, 30522, (2, 32))
    return tncompile.compile(six_encoder(n_layers=2).eval(), target_ratio=0.022271, init="random",
                             example_inputs=(ids,)), {"ids": ids}, (lambda out: out)


def _decoder(family):
    """A small GPT-2 or Llama (SDPA attention) in swap mode, its logits (issue 55: the models
    users train with ``torch.compile`` compile whole)."""
    def build():
        import transformers as tf
        if family == "gpt2":
            model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
        else:
            model = tf.LlamaForCausalLM(tf.LlamaConfig(
                vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa"))
        ids = torch.randint(0, 1000, (2, 16))
        compiled = tncompile.compile(model.eval(), target_ratio=0.3, example_inputs={"input_ids": ids})
        return compiled, {"input_ids": ids}, (lambda out: out.logits[:, -1, :2])
    return build


@pytest.mark.parametrize("build", [_six, _bert, _decoder("gpt2"), _decoder("llama")],
                         ids=["six-encoder", "bert", "gpt2", "llama"])
def test_no_graph_breaks_and_same_gradients(build):
    torch.manual_seed(0)
    compiled, inputs, logits = build()
    explained = torch._dynamo.explain(compiled)(**inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    traced = torch.compile(compiled, fullgraph=True, backend="aot_eager")  # forward and backward graphs
    loss_t = F.cross_entropy(logits(traced(**inputs)), torch.tensor([0, 1]))
    loss_t.backward()
    grads_t = [p.grad.clone() for p in compiled.parameters()]
    compiled.zero_grad()
    loss_e = F.cross_entropy(logits(compiled(**inputs)), torch.tensor([0, 1]))
    loss_e.backward()
    torch.testing.assert_close(loss_t, loss_e, rtol=1e-4, atol=1e-5)
    for gt, p in zip(grads_t, compiled.parameters()):
        torch.testing.assert_close(gt, p.grad, rtol=1e-3, atol=1e-5)
    torch._dynamo.reset()


def test_first_compiled_call_plans_new_row_counts_without_a_graph_break():
    """torch.compile(compiled) before any eager call, at row counts nobody planned:
    the plan is searched while tracing and becomes a constant of the graph."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                              torch.nn.ReLU(), torch.nn.Linear(512, 8))
    compiled = tncompile.compile(mlp, target_ratio=0.2)  # fx trace, no example inputs: nothing planned
    assert not any(m.plans for m in compiled.tensorized_modules().values())
    fast = torch.compile(compiled, fullgraph=True)
    x = torch.randn(32, 256, requires_grad=True)
    fast(x).sum().backward()
    got = x.grad.clone()
    x.grad = None
    compiled(x).sum().backward()
    torch.testing.assert_close(got, x.grad)
    for rows in (100, 7):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(fast(x), compiled(x))


def test_layers_tell_torch_export_from_torch_compile():
    """The exported forms are for torch.export only: torch 2.11's Dynamo folds
    ``torch.compiler.is_exporting()`` to True in every trace, so the layers read the flag
    torch.export sets (``runtime.tracing.exporting``), which is False under torch.compile."""
    from tncompile.runtime.kernels.tracing import exporting

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if exporting() else x - 1

    x = torch.zeros(2)
    assert not exporting()
    assert torch.equal(torch.compile(Probe(), fullgraph=True)(x), x - 1)
    assert torch.equal(torch.export.export(Probe(), (x,)).module()(x), x + 1)
    assert torch.equal(torch.export.export(Probe(), (x,), strict=True).module()(x), x + 1)


@pytest.mark.parametrize("rows", [1024, 40])
def test_traced_steps_take_the_eager_gradient_gemms(rows):
    """Under torch.compile the planned steps' gradients are cpu_gemm products too
    (gemms._CpuGemm: native thin kernels, transposed layouts), traced whole, and
    equal eager's in float64 (at 1024 rows the thin kernels run)."""
    from tncompile.formats import TTLayout
    from tncompile.runtime import TTLinear
    torch.manual_seed(0)
    layer = TTLinear(TTLayout.for_shape(256, 512, 3).with_ranks(8)).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(rows, 256, dtype=torch.float64, requires_grad=True)
    traced = torch.compile(layer, fullgraph=True, backend="aot_eager")
    traced(x).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    layer(x).square().sum().backward()
    for g, want in zip(got, [x.grad] + [p.grad for p in layer.parameters()]):
        assert want.abs().max() > 0
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-9)
    torch._dynamo.reset()


def _bert_train():
    import transformers as tf
    cfg = tf.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, num_labels=3)
    ids = torch.randint(0, 1000, (2, 16))
    model = tncompile.compile(tf.BertForSequenceClassification(cfg).train(), target_ratio=0.3,
                              example_inputs={"input_ids": ids})
    assert model.config._attn_implementation == "tncompile_sdpa"  # swap mode, lower_dropout's attention
    return model, {"input_ids": ids}, (lambda out: out.logits)


def _encoder_train():
    ids = torch.randint(1, 1000, (2, 32))
    return tncompile.compile(small_encoder(d_model=64, d_ff=256, max_len=64).train(), target_ratio=0.2,
                             example_inputs=(ids,)), {"ids": ids}, (lambda out: out)


def _bert_padded_train():
    model, inputs, logits = _bert_train()
    mask = torch.ones_like(inputs["input_ids"])
    mask[1, 10:] = 0  # a padded sequence: a boolean mask reaches the attention op
    return model, {**inputs, "attention_mask": mask}, logits


@pytest.mark.parametrize("build", [_encoder_train, _bert_train, _bert_padded_train],
                         ids=["encoder-graph", "bert-swap", "bert-swap-padded"])
def test_training_with_dropout_runs_the_native_kernels_as_ops(ops, build):
    """In training, dropout and attention with dropout trace as tncompile's ops (no graph
    break), draw their seeds in the graph, and -- with the generator left to PyTorch
    (aot_eager) -- give exactly the eager model's outputs and gradients."""
    torch.manual_seed(0)
    compiled, inputs, logits = build()
    explained = torch._dynamo.explain(compiled)(**inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    code = explained.graphs[0].code
    assert "traced_dropout" in code and "traced_attention" in code
    torch._dynamo.reset()
    traced = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    results = []
    for run in (traced, compiled):
        torch.manual_seed(1)
        loss = F.cross_entropy(logits(run(**inputs)), torch.tensor([0, 1]))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in compiled.parameters()]))
        compiled.zero_grad()
    (loss_t, grads_t), (loss_e, grads_e) = results
    torch.testing.assert_close(loss_t, loss_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_t, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
