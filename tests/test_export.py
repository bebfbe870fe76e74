"""Inference export: ``torch.export.export`` of compressed models with dynamic batch and
sequence dims (the exported module runs at other sizes and matches eager), and ONNX
export (dynamo exporter) run in onnxruntime within 1e-4 of eager. Under export every TT /
TTM layer runs one plain-op form (``_exported_forward``): no row-count branch, no
tncompile custom op in the exported graph."""
import pytest
import torch
from torch import nn

import tncompile
from tncompile.runtime import TTLinear, TTMEmbedding, TTMEmbeddingBag, TTMTiedLinear
from tncompile.testing import mlp

transformers = pytest.importorskip("transformers")
BATCH = torch.export.Dim("batch", min=1, max=64)
SEQ = torch.export.Dim("seq", min=2, max=32)


def _op_names(ep) -> set[str]:
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


def _mlp():
    torch.manual_seed(0)
    return mlp((64, 256, 256, 10))


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=256, max_position_embeddings=32)
    return transformers.BertModel(cfg).eval()


def _bert_inputs(batch, seq, pad=0):
    ids = torch.randint(0, 1000, (batch, seq))
    mask = torch.ones_like(ids)
    if pad:
        mask[0, -pad:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _compressed_bert():
    return tncompile.compile(_bert(), target_ratio=0.4, example_inputs=_bert_inputs(2, 16)).eval()


BERT_DIMS = {"input_ids": {0: BATCH, 1: SEQ}, "attention_mask": {0: BATCH, 1: SEQ}}


@pytest.mark.parametrize("mode", ["graph", "swap"])
def test_mlp_exports_with_a_dynamic_batch(mode):
    compiled = tncompile.compile(_mlp(), target_ratio=0.3, mode=mode).eval()
    assert len(compiled.tensorized_modules()) >= 2
    # the ordinary call, in both modes: a graph-mode model shows its traced model's own signature
    programs = [torch.export.export(compiled, (torch.randn(4, 64),), dynamic_shapes=({0: BATCH},))]
    if mode == "graph":
        programs.append(torch.export.export(compiled.model, (torch.randn(4, 64),), dynamic_shapes=({0: BATCH},)))
    for ep in programs:
        assert not any("tncompile" in op for op in _op_names(ep))
        exported = ep.module()
        with torch.no_grad():
            for rows in (1, 7, 33):
                x = torch.randn(rows, 64)
                torch.testing.assert_close(exported(x), compiled(x), rtol=1e-5, atol=1e-5)


def test_bert_exports_with_dynamic_batch_and_sequence_and_takes_a_padding_mask():
    compressed = _compressed_bert()
    assert isinstance(compressed, transformers.BertModel)
    kinds = {type(m) for m in compressed.tensorized_modules().values()}
    assert kinds == {TTLinear, TTMEmbedding}
    ep = torch.export.export(compressed, (), _bert_inputs(2, 16), dynamic_shapes=BERT_DIMS)
    assert not any("tncompile" in op for op in _op_names(ep))
    exported = ep.module()
    with torch.no_grad():
        for batch, seq, pad in ((1, 5, 0), (3, 9, 4), (5, 32, 10)):
            inputs = _bert_inputs(batch, seq, pad)
            want = compressed(**inputs).last_hidden_state
            got = exported(**inputs).last_hidden_state
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gpt2_with_a_tied_ttm_head_exports():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=4,
                                                               n_positions=64)).eval()
    ids = torch.randint(0, 500, (2, 8))
    compressed = tncompile.compile(gpt2, target_ratio=0.4, example_inputs={"input_ids": ids}).eval()
    assert isinstance(compressed.lm_head, TTMTiedLinear)
    ep = torch.export.export(compressed, (), {"input_ids": ids, "use_cache": False},
                             dynamic_shapes={"input_ids": {0: BATCH, 1: SEQ}, "use_cache": None})
    other = torch.randint(0, 500, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(input_ids=other, use_cache=False).logits,
                                   compressed(input_ids=other, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_export_forms_are_the_layers_dense_matrices():
    """Each layer's export form against the dense matrix it stands for (padded modes included)."""
    torch.manual_seed(0)
    linear = TTLinear.from_linear(nn.Linear(100, 90), rank=6)  # 100, 90 pad to factorable sizes
    embedding = TTMEmbedding.from_embedding(nn.Embedding(1000, 70), rank=5)
    head = TTMTiedLinear(embedding, bias=None)

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding, self.linear, self.head = embedding, linear, head

        def forward(self, ids, x):
            return self.embedding(ids), self.linear(x), self.head(self.embedding(ids))

    ids, x = torch.randint(0, 1000, (3, 5)), torch.randn(4, 100)
    ep = torch.export.export(Both(), (ids, x), dynamic_shapes=({0: BATCH, 1: SEQ}, {0: torch.export.Dim("rows")}))
    other_ids, other_x = torch.randint(0, 1000, (2, 7)), torch.randn(9, 100)
    rows, out, logits = ep.module()(other_ids, other_x)
    with torch.no_grad():
        table = embedding.weight()
        torch.testing.assert_close(rows, table[other_ids])
        torch.testing.assert_close(out, other_x @ linear.weight().T + linear.bias, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, table[other_ids] @ table.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_exports_with_dynamic_ids_and_bags(mode):
    torch.manual_seed(0)
    bag = TTMEmbeddingBag.from_embedding_bag(nn.EmbeddingBag(5000, 64, mode=mode), rank=8)

    class Bags(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = bag

        def forward(self, ids, offsets):
            return self.bag(ids, offsets)

    dims = ({0: torch.export.Dim("ids")}, {0: torch.export.Dim("bags")})
    ep = torch.export.export(Bags(), (torch.randint(0, 5000, (20,)), torch.tensor([0, 3, 9, 15])), dynamic_shapes=dims)
    ids, offsets = torch.randint(0, 5000, (31,)), torch.tensor([0, 5, 6, 20, 25, 30])
    with torch.no_grad():
        dense = nn.functional.embedding_bag(ids, bag.weight(), offsets, mode=mode)
        torch.testing.assert_close(ep.module()(ids, offsets), dense, rtol=1e-5, atol=1e-5)


ort = pytest.importorskip("onnxruntime", reason="ONNX export tests need the export extra")
pytest.importorskip("onnxscript", reason="ONNX export tests need the export extra")


def _onnx_session(model, args, kwargs, dims, path):
    program = torch.onnx.export(model, args, kwargs=kwargs, dynamic_shapes=dims, dynamo=True, verbose=False)
    program.save(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_mlp_runs_in_onnxruntime(tmp_path):
    compressed = tncompile.compile(_mlp(), target_ratio=0.3, mode="swap").eval()
    session = _onnx_session(compressed, (torch.randn(4, 64),), None, ({0: BATCH},), tmp_path / "mlp.onnx")
    name = session.get_inputs()[0].name
    for rows in (1, 13):
        x = torch.randn(rows, 64)
        got = torch.from_numpy(session.run(None, {name: x.numpy()})[0])
        with torch.no_grad():
            torch.testing.assert_close(got, compressed(x), rtol=1e-4, atol=1e-4)


def test_bert_runs_in_onnxruntime_with_dynamic_batch_and_sequence(tmp_path):
    compressed = _compressed_bert()
    session = _onnx_session(compressed, (), _bert_inputs(2, 16), BERT_DIMS, tmp_path / "bert.onnx")
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    for batch, seq, pad in ((1, 4, 0), (3, 23, 7)):
        inputs = _bert_inputs(batch, seq, pad)
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        with torch.no_grad():
            want = compressed(**inputs)
        torch.testing.assert_close(torch.from_numpy(got[0]), want.last_hidden_state, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.from_numpy(got[1]), want.pooler_output, rtol=1e-4, atol=1e-4)


class _Scaled(nn.Module):
    """An fx-traceable model with a keyword argument and a default."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x, scale: float = 2.0):
        return self.down(torch.relu(self.up(x))) * scale


def test_a_graph_mode_model_has_its_models_signature_for_export_and_copies():
    """inspect, torch.export's dynamic_shapes by name, deepcopy and pickling all see the
    traced model's own parameters (issue 44: ``CompiledModel.forward`` was ``(*args, **kwargs)``)."""
    import copy
    import inspect
    import io
    model = _Scaled()
    compiled = tncompile.compile(model, target_ratio=0.3, mode="graph").eval()
    assert list(inspect.signature(compiled.forward).parameters) == ["x", "scale"]
    assert inspect.signature(compiled.forward).parameters["scale"].default == 2.0
    ep = torch.export.export(compiled, (torch.randn(4, 64),), dynamic_shapes={"x": {0: BATCH}})
    x = torch.randn(9, 64)
    torch.testing.assert_close(ep.module()(x), compiled(x), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(compiled)
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)
    assert not torch.equal(twin(x), compiled(x))  # the copy's forward runs the copy
    buffer = io.BytesIO()
    torch.save(compiled, buffer)
    buffer.seek(0)
    reloaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(reloaded(x, scale=3.0), compiled(x, scale=3.0))
    assert list(inspect.signature(reloaded.forward).parameters) == ["x", "scale"]
