"""dry_run: the step TrainStep would capture, on fake device copies, reports every
op that would break CUDA-graph capture -- and finds none in tncompile's own code."""
import operator

import pytest
import torch
import torch.nn.functional as F

import tncompile
from tncompile.runtime import TTMEmbedding
from tncompile.train import CaptureError, dry_run
from tncompile.testing import six_encoder, small_encoder

pytestmark = pytest.mark.filterwarnings("ignore:User provided device_type of 'cuda'")


def _lm_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _hf(name: str):
    """A small HF model from ``input_ids`` alone, with its batch and loss."""
    import transformers as tf
    ids = torch.randint(0, 300, (2, 8))
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=32, num_labels=3)
        model, inputs, loss = tf.BertForSequenceClassification(cfg), {"input_ids": ids}, \
            (lambda out, y: F.cross_entropy(out.logits, y))
        return model, inputs, torch.randint(0, 3, (2,)), loss
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=32)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             tie_word_embeddings=(name == "llama-tied"))
        model = tf.LlamaForCausalLM(cfg)
    return model, {"input_ids": ids, "use_cache": False}, torch.randint(0, 300, (2, 8)), _lm_loss


def _optimizer(kind: str, compiled):
    groups = tncompile.param_groups(compiled, lr=1e-3)
    return {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
            "sgd": lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9)}[kind](groups)


@pytest.mark.parametrize("name, opt_kind, amp", [
    ("bert", "adam", None), ("bert", "adamw", "bf16"), ("gpt2", "sgd", None), ("gpt2", "adamw", "bf16"),
    ("llama", "adam", None), ("llama-tied", "adamw", "bf16"),
])
def test_hf_models_capture(name, opt_kind, amp):
    model, inputs, targets, loss = _hf(name)
    compiled = tncompile.compile(model, mode="graph", target_ratio=0.3, example_inputs=inputs)
    if name in ("gpt2", "llama-tied"):
        assert any(type(m).__name__ == "TTMTiedLinear" for m in compiled.tensorized_modules().values())
    opt = _optimizer(opt_kind, compiled)
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.2)
    call = {k: v for k, v in inputs.items() if k != "use_cache"}
    report = dry_run(compiled, opt, loss, call, targets, controller=ctl, amp=amp, grad_clip=1.0)
    assert report.ok, str(report)
    assert report.stages == ["early", "late"] and report.ops > 1000


def test_six_encoder_captures_in_both_stages_and_leaves_the_model_alone():
    """The paper's six-encoder (two of its layers: every layer's step is checked alike)."""
    compiled = tncompile.compile(six_encoder(n_layers=2), target_ratio=0.022271, init="random")
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3, gate_lr=1e-2))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.005)
    ids, y = torch.randint(1, 30522, (2, 128)), torch.randint(0, 3, (2,))
    before = {k: v.clone() for k, v in compiled.state_dict().items()}
    params = [id(p) for p in compiled.parameters()]
    report = dry_run(compiled, opt, F.cross_entropy, ids, y, controller=ctl, grad_clip=1.0)
    assert report.ok, str(report)
    assert [id(p) for p in compiled.parameters()] == params and not opt.state and ctl.stage == "early"
    assert all(torch.equal(v, before[k]) for k, v in compiled.state_dict().items())


def test_after_a_truncation_and_in_the_late_stage():
    ids, y = torch.randint(1, 1000, (4, 16)), torch.randint(0, 3, (4,))
    compiled = tncompile.compile(small_encoder(), target_ratio=0.3, example_inputs=(ids,))
    opt = torch.optim.Adam(tncompile.param_groups(compiled, lr=1e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.1, truncate_every=0, allow_layer_removal=True)
    step = tncompile.TrainStep(compiled, opt, F.cross_entropy, controller=ctl)
    for _ in range(2):
        step(ids, y)
    with torch.no_grad():
        for k, mod in enumerate(ctl.layers.values()):
            for g in mod.gates:
                g[g.numel() // 2:] = 0.0
            if k == 1:
                mod.gates[0].zero_()  # this layer collapses to its bias
    ctl.start_late_stage()
    event = ctl.truncate()
    assert event.truncated and event.removed
    report = dry_run(compiled, opt, F.cross_entropy, ids, y, controller=ctl)
    assert report.ok, str(report)
    assert report.stages == ["late"]


class ReadsAValue(tncompile.Pass):
    """A user pass with a bug: it scales the classifier's input by a value read to the host."""

    name = "scale-by-mean"

    def run(self, program):
        g = program.graph
        head = next(n for n in g.nodes if n.op == "call_module" and n.target == "classifier")
        with g.inserting_before(head):
            mean = g.call_method("mean", (head.args[0],))
            value = g.call_method("item", (mean,))
            head.args = (g.call_function(operator.mul, (head.args[0], value)),)


def test_names_the_op_and_line_a_custom_pass_put_in():
    ids, y = torch.randint(1, 1000, (4, 16)), torch.randint(0, 3, (4,))
    compiled = tncompile.compile(small_encoder(), target_ratio=0.3, example_inputs=(ids,),
                                 passes=tncompile.default_pipeline().append(ReadsAValue()))
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3))
    report = dry_run(compiled, opt, F.cross_entropy, ids, y)
    assert not report.ok
    (hazard,) = report.hazards
    assert hazard.kind == "host sync" and hazard.op == "aten._local_scalar_dense.default"
    assert "item = mean.item()" in hazard.where and hazard.phase == "forward" and hazard.module == "model"
    with pytest.raises(CaptureError, match=r"host sync: aten._local_scalar_dense.*mean.item\(\)"):
        report.raise_if_unsafe()


def _host_checked_ids(self, ids):  # what TTMEmbedding did before: read the ids on the host
    if int(ids.max()) >= self.num_embeddings:
        raise IndexError("out of range")


def _deduplicated_lookup(self, ids):
    unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
    return _plain_forward(self, unique)[inverse].reshape(*ids.shape, -1)


_plain_forward = TTMEmbedding.forward


def test_finds_host_syncs_and_dynamic_shapes_in_layer_code(monkeypatch):
    ids, y = torch.randint(1, 1000, (4, 16)), torch.randint(0, 3, (4,))
    compiled = tncompile.compile(small_encoder(), target_ratio=0.3, example_inputs=(ids,))
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3))
    monkeypatch.setattr(TTMEmbedding, "_check_ids", _host_checked_ids)
    monkeypatch.setattr(TTMEmbedding, "forward", _deduplicated_lookup)
    report = dry_run(compiled, opt, F.cross_entropy, ids, y)
    kinds = {(h.kind, h.module, h.where.split(" in ")[1].split(":")[0]) for h in report.hazards}
    assert ("host sync", "model.token_embedding", "_host_checked_ids") in kinds
    assert ("dynamic shape", "model.token_embedding", "_deduplicated_lookup") in kinds


def test_a_cpu_kernel_on_the_device_path_is_reported(monkeypatch):
    """The dry run asserts the device path: a native CPU kernel there is a hazard."""
    from tncompile.runtime import native
    from tncompile.runtime.kernels import tt_chain
    if native.native_ops() is None:
        pytest.skip("native kernels not built here")
    ids, y = torch.randint(1, 1000, (1, 1)), torch.randint(0, 3, (1,))
    compiled = tncompile.compile(small_encoder(), target_ratio=0.3, example_inputs=(ids,))
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    monkeypatch.setattr(tt_chain, "kernels_for", lambda t: native.native_ops())  # a bug: no device check
    report = dry_run(compiled, opt, F.cross_entropy, ids, y)
    cpu = [h for h in report.hazards if h.kind == "cpu kernel"]
    assert cpu and cpu[0].op == "tncompile::tt_chain" and "tt_chain.py" in cpu[0].where, str(report)


def test_optimizers_without_a_capturable_mode_are_reported():
    ids, y = torch.randint(1, 1000, (2, 8)), torch.randint(0, 3, (2,))
    compiled = tncompile.compile(small_encoder(), target_ratio=0.3, example_inputs=(ids,))
    report = dry_run(compiled, torch.optim.LBFGS(compiled.parameters()), F.cross_entropy, ids, y)
    assert [h.kind for h in report.hazards] == ["optimizer"] and "capturable" in report.hazards[0].where


def test_bad_arguments_are_refused_not_reported_capturable():
    """An empty or misspelled check is an error, not a pass; so is an optimizer of another model."""
    ids, y = torch.randint(1, 1000, (2, 16)), torch.randint(0, 3, (2,))
    compiled = tncompile.compile(small_encoder(), target_ratio=0.3, example_inputs=(ids,))
    opt = torch.optim.AdamW(compiled.parameters())
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.2)
    with pytest.raises(TypeError, match=r"stages=\('early',\)"):
        dry_run(compiled, opt, F.cross_entropy, ids, y, controller=ctl, stages="early")
    with pytest.raises(ValueError, match="checking nothing"):
        dry_run(compiled, opt, F.cross_entropy, ids, y, controller=ctl, stages=())
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['erly'\]"):
        dry_run(compiled, opt, F.cross_entropy, ids, y, controller=ctl, stages=("erly",))
    with pytest.raises(ValueError, match=r"\('step',\)"):
        dry_run(compiled, opt, F.cross_entropy, ids, y, stages=("early",))
    other = torch.optim.AdamW(torch.nn.Linear(3, 3).parameters())
    with pytest.raises(ValueError, match="not this model's"):
        dry_run(compiled, other, F.cross_entropy, ids, y)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        dry_run(compiled, "adam", F.cross_entropy, ids, y)
    assert dry_run(compiled, opt, F.cross_entropy, ids, y, controller=ctl, stages=("early",)).ok
