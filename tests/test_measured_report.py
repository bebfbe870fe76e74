"""``compiled.report(inputs)``: each compressed layer's forward + backward measured on the input it
gets in the model, beside a dense layer of its shape; the model left exactly as it was."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import tncompile
from tncompile.result.host_time import measure_layer_times
from tncompile.runtime import TTLinear, TTMEmbedding
from tncompile.runtime.layers.factor_groups import peers_of


class _Tagger(nn.Module):
    """Embedding, dropout, two same-shape linears (one merge batch), a wider one, by keywords."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(512, 96)
        self.drop = nn.Dropout(0.3)
        self.a = nn.Linear(96, 96)
        self.b = nn.Linear(96, 96)
        self.wide = nn.Linear(96, 192)
        self.norm = nn.BatchNorm1d(192)

    def forward(self, ids, scale=1.0):
        h = self.drop(self.emb(ids))
        h = self.b(torch.relu(self.a(h))) * scale
        return self.norm(self.wide(h).transpose(1, 2)).transpose(1, 2)


@pytest.fixture(scope="module")
def tagger():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        compiled = tncompile.compile(_Tagger(), target_ratio=0.3)
    return compiled, {"ids": torch.randint(0, 512, (3, 40)), "scale": 0.5}


def test_every_compressed_layer_is_measured_beside_its_dense_shape(tagger):
    compiled, inputs = tagger
    report = compiled.report(inputs, steps=2)
    measured = {r.name: r.measured for r in report.rows if r.measured is not None}
    assert set(measured) == set(compiled.tensorized_modules())
    for name, t in measured.items():
        assert t.host > 0 and t.wall >= t.host and t.dense_host > 0, name
        assert t.rows == 120, name             # 3 x 40 tokens, ids for the lookup
    same_batch = [n for n, m in compiled.tensorized_modules().items()
                  if isinstance(m, TTLinear) and peers_of(m) is not None and peers_of(m).batch_of(m) is not None]
    for name in same_batch:   # timed together, forward then backward, their merge shared
        assert measured[name].shared_with == len(same_batch) >= 2
    assert report.measured is not None and report.measured.layers == len(measured)
    assert report.measured.host == pytest.approx(sum(t.host for t in measured.values()))
    text = str(report)
    assert "host (dense)" in text and "measured on cpu" in text and "wall (dense)" not in text
    json.dumps(report.as_dicts())             # rows stay plain data
    assert compiled.report().measured is None and "host (dense)" not in str(compiled.report())


def test_measuring_leaves_the_model_as_it_was(tagger):
    compiled, inputs = tagger
    norm = next(m for m in compiled.modules() if isinstance(m, nn.BatchNorm1d))
    compiled.train()
    norm.eval()   # a mix of modes the user set
    modes = {n: m.training for n, m in compiled.named_modules()}
    for p in compiled.parameters():
        p.grad = torch.full_like(p, 7.0)
    grads = {n: p.grad for n, p in compiled.named_parameters()}
    norm_stats = norm.running_mean.clone(), norm.num_batches_tracked.clone()
    rng = torch.get_rng_state()
    compiled.report(inputs, steps=2)
    assert torch.equal(torch.get_rng_state(), rng)
    assert {n: m.training for n, m in compiled.named_modules()} == modes
    assert all(p.grad is grads[n] and bool((p.grad == 7).all()) for n, p in compiled.named_parameters())
    assert torch.equal(norm.running_mean, norm_stats[0])
    assert torch.equal(norm.num_batches_tracked, norm_stats[1])
    for layer in compiled.tensorized_modules().values():     # no factors left waiting
        peers = peers_of(layer)
        assert peers is None or not peers._ready


def test_layers_the_model_never_calls_are_left_out_and_bad_arguments_are_named():
    torch.manual_seed(1)
    model = nn.ModuleDict({"used": nn.Linear(64, 64), "unused": nn.Linear(64, 64)})

    class Caller(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = model

        def forward(self, x):
            return self.layers["used"](x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        compiled = tncompile.compile(Caller(), target_ratio=0.3, mode="swap")
    compiled.layers["unused"] = TTLinear.from_linear(nn.Linear(64, 64), rank=4)
    times = measure_layer_times(compiled, torch.randn(5, 64), steps=1, warmup=0)
    assert set(times) == {"layers.used"}
    with pytest.raises(ValueError, match="steps must be >= 1"):
        compiled.report(torch.randn(5, 64), steps=0)


def test_a_lookup_is_measured_against_an_embedding_table():
    torch.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        compiled = tncompile.compile(nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 64)), target_ratio=0.1)
    kinds = {type(m) for m in compiled.tensorized_modules().values()}
    assert TTMEmbedding in kinds
    report = compiled.report(torch.randint(0, 4096, (2, 30)), steps=1)
    lookup = next(r for r in report.rows if r.format == "TTM")
    assert lookup.measured.rows == 60 and lookup.measured.dense_host > 0


class _TwoFamilies(nn.Module):
    def __init__(self):
        super().__init__()
        self.a1, self.a2 = nn.Linear(64, 64), nn.Linear(64, 64)
        self.b1, self.b2 = nn.Linear(64, 128), nn.Linear(64, 128)

    def forward(self, x):
        h = self.a2(self.a1(x))
        return self.b1(h) + self.b2(h)


@pytest.mark.parametrize("triton_on", [False, True], ids=["default", "triton"])
def test_layers_are_timed_with_what_they_merge_with(triton_on, monkeypatch):
    """Two families of two layers: each family's layers share one batch's time on PyTorch's
    ops; on the Triton kernels (one merge for the model's batches) all four share it."""
    from tncompile import tuning
    from tncompile.runtime.triton import runs_triton
    if triton_on and not runs_triton(torch.empty(0)):
        pytest.skip("the Triton path on the CPU needs Triton's interpreter (TRITON_INTERPRET=1)")
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        compiled = tncompile.compile(_TwoFamilies(), target_ratio=0.3)
    monkeypatch.setattr(tuning, "TRITON_KERNELS", triton_on)
    times = measure_layer_times(compiled, torch.randn(6, 64), steps=1, warmup=1)
    assert len(times) == 4
    assert {t.shared_with for t in times.values()} == ({4} if triton_on else {2})


@pytest.mark.cuda
def test_on_a_gpu_the_report_shows_time_to_completion_beside_host_time():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tncompile.SlowerThanDenseWarning)
        compiled = tncompile.compile(_TwoFamilies(), target_ratio=0.3).cuda()
    report = compiled.report(torch.randn(64, 64, device="cuda"), steps=3)
    assert report.measured.shows_wall and "wall (dense)" in str(report) and "NVIDIA" in report.measured.device
    assert all(r.measured.wall >= r.measured.host for r in report.rows if r.measured is not None)
