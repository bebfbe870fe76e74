"""Issue 56: a model compiled on the meta device is made real -- ``to_empty`` then
``reset_parameters`` (the PyTorch / FSDP2 convention), or ``tncompile.materialize`` -- with
each network's matrix at its dense layer's init variance, without one dense-sized tensor,
and it trains like a model compiled from a real dense one."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.runtime import TTLinear, TTMEmbedding
from tncompile.testing import mlp


def _compile(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tncompile.compile(model, **kw)


def _meta_mlp(widths=(64, 256, 256, 10), ratio=0.3, **kw):
    with torch.device("meta"):
        model = mlp(widths)
    return _compile(model, target_ratio=ratio, init="random", **kw)


class Tokens(nn.Module):
    """An embedding, a feed-forward block and a head: the shapes of a language model."""

    def __init__(self, vocab=3000, width=64, hidden=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.norm(h).mean(1))


def _variances(layer, draws=16, **kw):
    """The merged matrix's variance after each of ``draws`` seeded resets. (Entries of one
    draw share cores: a single draw's variance scatters ~15% around its expectation.)"""
    out = []
    for seed in range(draws):
        torch.manual_seed(seed)
        layer.reset_parameters(**kw)
        out.append(layer.weight().detach().var().item())
    return torch.tensor(out)


def test_reset_parameters_draws_cores_at_the_dense_layers_variance():
    torch.manual_seed(0)
    layer = TTLinear.from_linear(nn.Linear(512, 1024), rank=24)
    with torch.no_grad():
        for g in layer.gates:
            g.mul_(0.5)
    layer.reset_parameters()
    assert all(torch.equal(g, torch.ones_like(g)) for g in layer.gates)
    assert layer.bias.abs().max() <= 512 ** -0.5 and layer.bias.std() > 0.5 * 512 ** -0.5 / 3 ** 0.5
    ratios = _variances(layer) * 3 * 512                         # nn.Linear: 1 / (3 in)
    assert abs(ratios.mean().item() - 1) < 0.1 and ratios.min() > 0.5 and ratios.max() < 1.6, ratios
    emb = TTMEmbedding.from_embedding(nn.Embedding(4096, 128), rank=16)
    ratios = _variances(emb)                                     # nn.Embedding: N(0, 1)
    assert abs(ratios.mean().item() - 1) < 0.1 and ratios.min() > 0.5 and ratios.max() < 1.6, ratios
    ratios = _variances(emb, variance=0.02 ** 2) / 0.02 ** 2
    assert abs(ratios.mean().item() - 1) < 0.1, ratios


def test_materialize_makes_a_meta_compiled_model_real_and_sound():
    compiled = _meta_mlp()
    assert all(p.is_meta for p in compiled.parameters())
    out = tncompile.materialize(compiled, "cpu", seed=0)
    assert out is compiled and not any(p.is_meta for p in compiled.parameters())
    layers = [m for m in compiled.modules() if isinstance(m, TTLinear)]
    assert layers
    for m in layers:
        assert all(torch.equal(g, torch.ones_like(g)) for g in m.gates)
        assert 0.4 < m.weight().detach().var().item() * 3 * m.in_features < 1.8
    x = torch.randn(8, 64)
    for m in layers:   # no stale derived state: each layer computes its network's matrix
        x_in = torch.randn(5, m.in_features)
        torch.testing.assert_close(m(x_in), F.linear(x_in, m.weight(), m.bias), rtol=1e-4, atol=1e-5)
    assert torch.isfinite(compiled(x)).all()
    again = tncompile.materialize(_meta_mlp(), "cpu", seed=0)   # seeded: the same model
    assert all(torch.equal(a, b) for a, b in zip(compiled.parameters(), again.parameters()))
    state = torch.get_rng_state()
    tncompile.materialize(_meta_mlp(), "cpu", seed=1)
    assert torch.equal(torch.get_rng_state(), state)           # the caller's stream never moved


def test_to_empty_then_reset_parameters_is_the_same_as_materialize():
    by_hand = _meta_mlp()
    torch.manual_seed(3)
    by_hand.to_empty(device="cpu")
    for m in by_hand.modules():
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    assert all(torch.isfinite(p).all() for p in by_hand.parameters())
    assert torch.isfinite(by_hand(torch.randn(4, 64))).all()


def test_materialize_casts_to_the_dtype_asked():
    compiled = tncompile.materialize(_meta_mlp(), "cpu", dtype=torch.bfloat16, seed=0)
    assert {p.dtype for p in compiled.parameters()} == {torch.bfloat16}
    assert compiled(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def _loss_curve(model, seed, steps=60):
    g = torch.Generator().manual_seed(100 + seed)
    teacher = torch.randn(3000, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 3000, (16, 12), generator=g)
        y = (teacher[ids].mean(1) * 4).long().clamp(-2, 1) + 2
        loss = F.cross_entropy(model(ids), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_meta_compiled_model_trains_like_one_compiled_from_a_real_dense_model():
    ids = torch.randint(0, 3000, (2, 12))
    real_final, meta_final = [], []
    for seed in range(3):
        torch.manual_seed(seed)
        real = _compile(Tokens(), target_ratio=0.2, init="random", example_inputs=(ids,))
        with torch.device("meta"):
            dense = Tokens()
        meta = _compile(dense, target_ratio=0.2, init="random", example_inputs=(ids.to("meta"),))
        tncompile.materialize(meta, "cpu", seed=seed)
        assert [tuple(p.shape) for p in meta.parameters()] == [tuple(p.shape) for p in real.parameters()]
        real_final.append(sum(_loss_curve(real, seed)[-10:]) / 10)
        meta_final.append(sum(_loss_curve(meta, seed)[-10:]) / 10)
    start = F.cross_entropy(torch.zeros(1, 4), torch.tensor([0])).item()    # log 4: chance
    gap = abs(sum(real_final) - sum(meta_final)) / 3
    spread = max(max(real_final) - min(real_final), max(meta_final) - min(meta_final))
    assert max(real_final + meta_final) < 0.8 * start                       # both learned
    assert gap <= max(spread, 0.1), (real_final, meta_final)                # within the seeds' noise


def test_a_huggingface_model_gets_its_own_init_and_buffers():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      initializer_range=0.2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    compiled = _compile(model, target_ratio=0.3, init="random",
                        example_inputs={"input_ids": torch.zeros(1, 16, dtype=torch.long, device="meta")})
    tncompile.materialize(compiled, "cpu", seed=0)
    assert not any(t.is_meta for t in [*compiled.parameters(), *compiled.buffers()])
    fresh = transformers.LlamaForCausalLM(config)
    torch.testing.assert_close(compiled.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
    tt = [m for m in compiled.modules() if isinstance(m, (TTLinear, TTMEmbedding))]
    assert tt
    # the config's initializer_range (0.2), not PyTorch's default (std ~0.07 at 64 wide); one
    # small network's realized variance scatters widely around its expectation: their mean
    ratios = torch.tensor([m.weight().detach().var().item() / 0.2 ** 2 for m in tt])
    assert 0.7 < ratios.mean().item() < 1.3, ratios
    norms = [m for m in compiled.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in norms)
    ids = torch.randint(0, 1000, (2, 16))
    loss = compiled(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and loss.item() < 3 * torch.log(torch.tensor(1000.0)).item()


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))
        self.body = mlp((64, 256, 256, 10))

    def forward(self, x):
        return self.body(x * self.scale)


class MetaBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp((64, 256, 256, 10))
        self.register_buffer("shift", torch.arange(64.0))

    def forward(self, x):
        return self.body(x + self.shift)


@pytest.mark.parametrize("model, named", [(NoReset, "the parameter 'model.scale': its module has no reset_parameters"),
                                          (MetaBuffer, "the buffer 'model.shift' exists only on the meta device")])
def test_what_nothing_can_initialize_is_named_and_nothing_changes(model, named):
    with torch.device("meta"):
        dense = model()
    compiled = _compile(dense, target_ratio=0.3, init="random", example_inputs=(torch.zeros(2, 64, device="meta"),))
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")) as err:
        tncompile.materialize(compiled, "cpu")
    assert "The model was not changed" in str(err.value)
    assert all(p.is_meta for p in compiled.parameters())


class Shifted(nn.Module):
    """A module that computes its buffer in reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.empty(64))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.shift.copy_(torch.arange(64.0))

    def forward(self, x):
        return x + self.shift


def test_buffers_are_kept_or_computed_never_left_empty():
    def build():
        with torch.device("meta"):
            return nn.Sequential(Shifted(), mlp((64, 256, 256, 10)))
    example = (torch.zeros(2, 64, device="meta"),)
    graph = _compile(build(), target_ratio=0.3, init="random", example_inputs=example)
    with pytest.raises(ValueError, match=r"mode='swap'\) keeps your modules"):   # the tracer inlined Shifted
        tncompile.materialize(graph, "cpu")
    swapped = _compile(build(), target_ratio=0.3, init="random", example_inputs=example, mode="swap")
    tncompile.materialize(swapped, "cpu")
    assert torch.equal(swapped[0].shift, torch.arange(64.0))
    assert any(isinstance(m, TTLinear) for m in swapped.modules())
    # any module, compiled or not: a buffer built off the meta device keeps its value
    with torch.device("meta"):
        plain = mlp((64, 32, 10))
    plain.register_buffer("scale", torch.full((64,), 3.0))
    tncompile.materialize(plain, "cpu")
    assert torch.equal(plain.scale, torch.full((64,), 3.0)) and not any(p.is_meta for p in plain.parameters())


@pytest.mark.parametrize("kwargs, error", [({"device": "meta"}, ValueError), ({"dtype": torch.int8}, TypeError)])
def test_bad_arguments_are_named(kwargs, error):
    with pytest.raises(error, match="device|dtype"):
        tncompile.materialize(_meta_mlp(), **kwargs)


PROBE = textwrap.dedent("""
    import json, resource, sys, warnings
    import torch
    LIMIT_GROWTH = 384 << 20
    from torch import nn
    import tncompile
    warnings.simplefilter("ignore")

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(131072, 1024)                     # 512 MB dense
            self.up, self.down = nn.Linear(1024, 8192), nn.Linear(8192, 1024)
            self.head = nn.Linear(1024, 131072)                          # 512 MB dense

        def forward(self, ids):
            h = self.embed(ids)
            return self.head(h + self.down(torch.relu(self.up(h))))

    with torch.device("meta"):
        model = Wide()
    dense_bytes = sum(p.numel() * 4 for p in model.parameters())
    compiled = tncompile.compile(model, target_ratio=0.01, init="random", mode="graph",
                                 example_inputs=(torch.zeros(1, 8, dtype=torch.long, device="meta"),))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # from here the address space may grow by less than one dense weight (512 MB): making
    # one fails (MemoryError / "can't allocate") and the probe exits non-zero
    mapped = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize:")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + LIMIT_GROWTH, resource.RLIM_INFINITY))
    tncompile.materialize(compiled, "cpu", seed=0)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    ids = torch.randint(0, 131072, (2, 8))
    compiled(ids)[..., :8].square().mean().backward()
    opt.step()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:   # the limit bites: one dense weight cannot be made under it
        torch.empty(131072, 1024).fill_(1.0)
        dense_fails = False
    except (MemoryError, RuntimeError):
        dense_fails = True
    print(json.dumps({"dense_bytes": dense_bytes, "grew": after - before, "dense_fails": dense_fails,
                      "params": sum(p.numel() for p in compiled.parameters())}))
""")


def test_no_dense_sized_tensor_is_made():
    """A model of 1.1 GB dense weights, compiled on meta, materialized and trained one step
    under RLIMIT_AS (the address space may grow by 384 MB, less than one dense weight of
    512 MB: allocating one would fail): the process's peak memory grows by far less."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"}   # thread stacks and arenas reserve space
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["dense_bytes"] > 1.1e9 and got["params"] < 0.02 * got["dense_bytes"] / 4
    assert got["grew"] < 256 << 20, got
    assert got["dense_fails"], got   # the address-space limit would have stopped a dense weight


# ----------------------------------------------------------- issue 64 items 2 and 3
def _meta_llama(transformers, mode="auto"):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    compiled = _compile(model, target_ratio=0.2, init="random", mode=mode,
                        example_inputs={"input_ids": torch.zeros(2, 16, dtype=torch.long, device="meta")})
    return config, compiled


def test_a_model_compiled_on_meta_saves_and_loads_by_both_routes_onto_meta_or_cpu(tmp_path):
    """Pretrained from scratch, then shared: ``save_pretrained`` -> ``from_pretrained``, and
    ``tncompile.save`` -> ``tncompile.load`` onto a model built on meta or on the CPU."""
    transformers = pytest.importorskip("transformers")
    config, compiled = _meta_llama(transformers)
    tncompile.materialize(compiled, "cpu", seed=0)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    ids = torch.randint(0, 500, (2, 16))
    compiled(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    compiled.eval()
    with torch.no_grad():
        expected = compiled(input_ids=ids).logits
    compiled.save_pretrained(tmp_path / "folder")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folder")
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, expected, rtol=0, atol=0)
    tncompile.save(compiled, tmp_path / "m.tnc")
    for device in ("meta", "cpu"):
        for source in (tmp_path / "m.tnc", tmp_path / "folder"):
            with torch.device(device):
                target = transformers.LlamaForCausalLM(config)
            loaded = tncompile.load(source, model=target)
            assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()]), (device, source)
            loaded.eval()
            with torch.no_grad():
                torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_every_entry_point_given_a_meta_model_names_materialize(tmp_path):
    transformers = pytest.importorskip("transformers")
    _, compiled = _meta_llama(transformers)
    ids = torch.zeros(2, 16, dtype=torch.long)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)

    def loss_fn(out, _):
        return out.logits.float().mean()
    calls = {
        "tncompile.save": lambda: tncompile.save(compiled, tmp_path / "m.tnc"),
        "TrainStep": lambda: tncompile.TrainStep(compiled, opt, loss_fn),
        "tncompile.fit": lambda: tncompile.fit(compiled, [({"input_ids": ids}, ids)], loss_fn, opt, steps=1,
                                               progress=False),
        "RankController": lambda: tncompile.RankController(compiled, opt, target_ratio=0.1),
        "report(inputs)": lambda: compiled.report({"input_ids": ids}),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=rf"{re.escape(where)}: the model is still on the meta device.*"
                                             r"tncompile\.materialize"):
            call()
    assert not (tmp_path / "m.tnc").exists()
    compiled.report()                        # the table alone needs no memory
