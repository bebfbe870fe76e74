"""Issue 55: a model's own calls in the user's loop, forward and backward, replayed from
graphs per input signature (``tncompile.train.graph_calls``). On this CPU-only machine the
bookkeeping runs on ``EmulatedGraphs`` (a replay re-runs the captured function into the
static buffers), so what a user relies on is tested here: the same training as eager,
outputs that stay the caller's, gradients that accumulate, a graph per signature, stale
graphs dropped, and clean fallbacks. ``tests/test_cuda.py`` runs the CUDA capture."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.train.graphed_calls import CudaGraphs, EmulatedGraphs, GraphedCalls, graph_calls, ungraph_calls


def _models(compressed=True):
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    if compressed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dense = tncompile.compile(dense, target_ratio=0.5, init="random", example_inputs=(torch.randn(8, 32),))
    twin = copy.deepcopy(dense)
    return graph_calls(dense, graphs=EmulatedGraphs()), twin


def _batches(n=8, rows=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 32, generator=g), torch.randint(0, 4, (rows,), generator=g)) for _ in range(n)]


def _train(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
    return losses


@pytest.mark.parametrize("compressed", [True, False], ids=["compressed", "dense"])
def test_graphed_calls_train_exactly_as_eager_calls(compressed):
    model, twin = _models(compressed)
    batches = _batches()
    got, want = _train(model, batches), _train(twin, batches)
    calls = model.__dict__["forward"]
    assert calls.stats["captures"] == 1 and calls.stats["replays"] == len(batches) - 2   # two warm-up calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_outputs_a_caller_keeps_never_change_under_it():
    model, _ = _models()
    _train(model, _batches())                                   # captured: later calls replay
    outputs = []
    for x, y in _batches(n=3, seed=2):                         # the model's own outputs, kept
        outputs.append(model(x))
        F.cross_entropy(outputs[-1], y).backward()
    kept = [o.detach().clone() for o in outputs]
    _train(model, _batches(seed=3))
    assert model.__dict__["forward"].stats["fallbacks"] == 0
    assert all(torch.equal(a, b) for a, b in zip(outputs, kept))   # replays wrote nothing into them


def test_gradients_accumulate_over_micro_batches_as_in_eager():
    model, twin = _models()
    batches = _batches(n=4)
    for m in (model, twin):
        for x, y in batches[:3]:      # warm up and capture first
            F.cross_entropy(m(x), y).backward()
            m.zero_grad(set_to_none=True)
        for x, y in batches:          # then four micro-batches into one gradient
            F.cross_entropy(m(x), y).backward()
    assert model.__dict__["forward"].stats["replays"] >= 4
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_each_signature_and_mode_gets_its_own_graph_and_no_grad_runs_eagerly():
    model, twin = _models()
    calls = model.__dict__["forward"]
    for rows in (16, 16, 16, 24, 24, 24):
        x = torch.randn(rows, 32)
        F.cross_entropy(model(x), torch.zeros(rows, dtype=torch.long)).backward()
    assert calls.stats["captures"] == 2
    model.eval()
    for _ in range(3):
        model(torch.randn(16, 32)).sum().backward()
    assert calls.stats["captures"] == 3                          # eval mode: a graph of its own
    with torch.no_grad():
        before = calls.stats["eager"]
        out = model(torch.randn(16, 32))
    assert calls.stats["eager"] == before + 1 and out.grad_fn is None


def test_a_replaced_parameter_drops_every_graph_and_training_stays_exact():
    model, twin = _models()
    batches = _batches()
    _train(model, batches[:4])
    _train(twin, batches[:4])
    calls = model.__dict__["forward"]
    live = calls.stats["captures"]
    for m in (model, twin):
        first = next(m.parameters())
        first.data = first.data * 0.5               # new storage: the graphs read the old one
    got, want = _train(model, batches[4:]), _train(twin, batches[4:])
    assert calls.cache.stats.invalidations == 1 and calls.stats["captures"] == live + 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_second_forward_before_the_backward_runs_eagerly_and_both_gradients_hold():
    model, twin = _models()
    batches = _batches(n=5)
    for m in (model, twin):
        for x, y in batches[:3]:
            F.cross_entropy(m(x), y).backward()
            m.zero_grad(set_to_none=True)
    calls = model.__dict__["forward"]
    grads = []
    for m in (model, twin):
        first = F.cross_entropy(m(batches[3][0]), batches[3][1])
        second = F.cross_entropy(m(batches[4][0]), batches[4][1])   # the first's backward is still due
        (first + second).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        m.zero_grad(set_to_none=True)
    assert calls.stats["fallbacks"] == 1
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _WithCache(nn.Module):
    """Returns a plain object beside its tensor, as HF models return a ``DynamicCache``."""

    class Cache:
        pass

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return {"out": self.linear(x), "cache": self.Cache()}


def test_outputs_that_are_not_tensors_fall_back_with_a_warning_naming_the_fix():
    model = graph_calls(_WithCache(), graphs=EmulatedGraphs())
    x = torch.randn(4, 8)
    for _ in range(2):
        model(x)["out"].sum().backward()
    with pytest.warns(UserWarning, match="use_cache=False"):
        out = model(x)
    out["out"].sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # warned once: later calls of the signature run eagerly quietly
        for _ in range(3):
            model(x)["out"].sum().backward()
    assert model.__dict__["forward"].stats["captures"] == 0


def test_graph_calls_wraps_once_and_ungraph_calls_restores():
    model, _ = _models()   # graphed already
    own = model.__dict__["forward"].replaced   # a CompiledModel's forward with its traced signature
    assert own is not None and not isinstance(own, GraphedCalls)
    graph_calls(model, graphs=EmulatedGraphs())
    graph_calls(model, graphs=EmulatedGraphs())
    assert isinstance(model.__dict__["forward"], GraphedCalls)
    assert not isinstance(model.__dict__["forward"].forward, GraphedCalls)   # not wrapped twice
    ungraph_calls(model)
    assert model.__dict__.get("forward") is own
    plain, _ = _models(False)
    graph_calls(plain, graphs=EmulatedGraphs())
    ungraph_calls(plain)
    assert "forward" not in plain.__dict__
    with pytest.raises(TypeError, match="nn.Module"):
        graph_calls(lambda x: x)


def test_a_hugging_face_decoder_trains_from_graphs_with_use_cache_off():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False)
    ids = torch.randint(0, 100, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tncompile.compile(transformers.LlamaForCausalLM(config), target_ratio=0.5,
                                  example_inputs={"input_ids": ids, "labels": ids}).train()
    twin = copy.deepcopy(model)
    graph_calls(model, graphs=EmulatedGraphs())
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 200, (2, 16), generator=g) for _ in range(6)]
    losses = {}
    for name, m in (("graphed", model), ("eager", twin)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses[name] = []
        for b in batches:
            loss = m(input_ids=b, labels=b).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    assert model.__dict__["forward"].stats["replays"] == 4
    assert losses["graphed"] == pytest.approx(losses["eager"], rel=1e-5)


def test_a_frozen_model_replays_its_forward_alone():
    """Everything frozen, grad mode on (an evaluation inside a training loop): a forward
    graph alone, outputs equal to eager and without autograd history."""
    model, twin = _models()
    for m in (model, twin):
        m.requires_grad_(False)
    x = torch.randn(16, 32)
    outs = [model(x) for _ in range(4)]
    assert model.__dict__["forward"].stats["replays"] == 2
    for out in outs:
        assert out.grad_fn is None
        torch.testing.assert_close(out, twin(x), rtol=1e-5, atol=1e-6)


def test_no_graph_runs_while_another_signatures_backward_is_due():
    """Graphs share one memory pool: a replay of signature B between A's forward and
    backward could overwrite A's saved activations, so B runs eagerly then."""
    model, twin = _models()
    a, b = _batches(n=4, rows=16), _batches(n=4, rows=24, seed=5)
    for m in (model, twin):
        for (xa, ya), (xb, yb) in zip(a[:3], b[:3]):   # both signatures warmed up and captured
            F.cross_entropy(m(xa), ya).backward()
            F.cross_entropy(m(xb), yb).backward()
            m.zero_grad(set_to_none=True)
    calls = model.__dict__["forward"]
    assert calls.stats["captures"] == 2
    grads = []
    for m in (model, twin):
        first = F.cross_entropy(m(a[3][0]), a[3][1])
        second = F.cross_entropy(m(b[3][0]), b[3][1])   # another signature, A's backward still due
        (first + second).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert calls.stats["fallbacks"] == 1
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


class _ReadsTheHost(nn.Module):
    """A forward that reads a value back to the host: capture would break on it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 4)

    def forward(self, x):
        scale = float(x.abs().max())   # a host read
        return self.linear(x) / scale


def test_a_call_with_a_host_read_is_proved_unsafe_and_stays_eager_with_its_line_named():
    model = graph_calls(_ReadsTheHost(), graphs=EmulatedGraphs())
    twin = copy.deepcopy(model)
    tncompile.ungraph_calls(twin)
    batches = _batches(5)
    with pytest.warns(UserWarning, match=r"(?s)run eagerly, not from CUDA graphs: .*host sync.*test_graphed_calls.py.*float\(x.abs\(\).max\(\)\)"):
        got = _train(model, batches)
    torch.testing.assert_close(torch.stack(got), torch.stack(_train(twin, batches)))
    calls = model.__dict__["forward"]
    assert calls.stats["captures"] == 0 and calls.stats["eager"] == len(batches)
    frozen = _ReadsTheHost().requires_grad_(False)   # a forward graph alone: proved all the same
    graph_calls(frozen, graphs=EmulatedGraphs())
    with pytest.warns(UserWarning, match=r"(?s)run eagerly, not from CUDA graphs: .*host sync"):
        for x, _ in batches:
            frozen(x)
    assert frozen.__dict__["forward"].stats["captures"] == 0
    unchecked = graph_calls(_ReadsTheHost(), graphs=EmulatedGraphs(), check=False)
    _train(unchecked, batches)   # the emulation cannot see host reads: unchecked, it captures
    assert unchecked.__dict__["forward"].stats["captures"] == 1


def test_a_safe_model_is_proved_once_per_signature(monkeypatch):
    import importlib
    dry_run_module = importlib.import_module("tncompile.train.graphed_calls")   # the name it calls
    runs = []
    real = dry_run_module.dry_run

    def counted(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(dry_run_module, "dry_run", counted)
    model, _ = _models(True)
    _train(model, _batches(6) + _batches(6, rows=8) + _batches(3))
    assert len(runs) == 2 and model.__dict__["forward"].stats["captures"] == 2
    first = next(model.parameters())
    first.data = first.data.clone()   # a changed model: every graph dropped, each signature proved again
    _train(model, _batches(4))
    assert len(runs) == 3 and model.__dict__["forward"].stats["captures"] == 3


def test_inputs_whose_shapes_never_repeat_stop_capturing_with_a_warning_on_padding():
    model, twin = _models(False)
    model.__dict__["forward"].cache.warmup_steps = 1
    batches = [b for rows in range(2, 40) for b in _batches(2, rows=rows, seed=rows)]   # each length twice
    with pytest.warns(UserWarning, match="pad_to_multiple_of"):
        got = _train(model, batches)
    calls = model.__dict__["forward"]
    assert calls.churning and calls.stats["captures"] <= 2 * calls.cache.max_graphs
    torch.testing.assert_close(torch.stack(got), torch.stack(_train(twin, batches)), rtol=1e-5, atol=1e-6)


def test_fsdp2_sharded_parameters_are_never_captured():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, _ = _models(False)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        graph_calls(model, graphs=EmulatedGraphs())
        _train(model, _batches(5))
        calls = model.__dict__["forward"]
        assert calls.sharded and calls.stats["captures"] == 0 and calls.stats["eager"] == 5
    finally:
        dist.destroy_process_group()


def test_the_forward_signature_stays_the_models_and_ungraph_restores_a_compiled_models_own():
    """HF Trainer picks a dataset's columns by inspect.signature(model.forward): graphed calls
    show the model's own parameters; ungraph_calls puts back the forward a CompiledModel
    keeps on its instance (its traced signature), not the class's."""
    import inspect
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=32)
    ids = torch.randint(0, 100, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = tncompile.compile(transformers.BertModel(config), target_ratio=0.5, example_inputs={"input_ids": ids})
    before = inspect.signature(bert.forward)
    assert {"input_ids", "attention_mask", "labels"} & set(before.parameters) >= {"input_ids", "attention_mask"}
    graph_calls(bert, graphs=EmulatedGraphs())
    assert inspect.signature(bert.forward) == before
    ungraph_calls(bert)
    assert inspect.signature(bert.forward) == before

    model, _ = _models()   # a CompiledModel of an fx trace, graphed
    own = model.__dict__["forward"].replaced
    assert list(inspect.signature(model.forward).parameters) == list(inspect.signature(own).parameters) == ["input"]
    ungraph_calls(model)
    assert model.__dict__["forward"] is own


def test_tuning_graph_calls_makes_compile_hand_back_a_graphed_model():
    from tncompile import tuning
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = tncompile.compile(dense, target_ratio=0.5, init="random", example_inputs=(x,))
        with tuning.override(GRAPH_CALLS=True):
            graphed = tncompile.compile(dense, target_ratio=0.5, init="random", example_inputs=(x,))
    assert not isinstance(plain.__dict__.get("forward"), GraphedCalls)
    calls = graphed.__dict__["forward"]
    assert isinstance(calls, GraphedCalls) and isinstance(calls.graphs, CudaGraphs)
    torch.testing.assert_close(graphed(x), plain(x))   # off the GPU: eager calls
    assert calls.stats["eager"] == 1 and calls.stats["captures"] == 0
