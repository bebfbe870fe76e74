"""compile() end to end on plain PyTorch models."""
import errno
import json

import pytest
import torch
from torch import nn

import tncompile
from tncompile.runtime import TTLinear, TTMEmbedding
from tncompile.testing import mlp, small_encoder, six_encoder


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, snap):
    sd = model.state_dict()
    return sd.keys() == snap.keys() and all(torch.equal(sd[k], snap[k]) for k in sd)


def test_mlp_compile_forward_backward_and_untouched():
    model = mlp((256, 512, 512, 10))
    snap = _snapshot(model)
    compiled = tncompile.compile(model, target_ratio=0.1)
    assert compiled.ratio <= 0.1 and compiled.ratio >= 0.09
    x = torch.randn(8, 256)
    y = compiled(x)
    assert y.shape == (8, 10)
    y.sum().backward()
    assert all(p.grad is not None for p in compiled.parameters() if p.requires_grad)
    assert _same(model, snap) and isinstance(model[0], nn.Linear)
    assert isinstance(compiled.model.get_submodule("0"), TTLinear)


@pytest.mark.parametrize("target", [0.02, 0.05, 0.1, 0.3, 0.45])
def test_ratio_honoured_across_targets(target):
    model = small_encoder(vocab_size=3000, d_model=96, d_ff=384, n_heads=4)
    compiled = tncompile.compile(model, target_ratio=target)
    assert compiled.ratio <= target
    assert compiled.ratio >= 0.9 * target
    assert compiled.report().ratio == pytest.approx(compiled.ratio)


def test_target_above_what_layouts_allow_stops_at_the_caps():
    model = small_encoder(vocab_size=3000, d_model=96, d_ff=384, n_heads=4)
    high = tncompile.compile(model, target_ratio=0.9)
    top = tncompile.compile(model, target_ratio=1.0)
    assert high.ratio <= 0.9 and high.ratio == top.ratio  # every network at its cap
    assert all(r.ratio <= tncompile.tuning.MAX_LAYER_RATIO for r in high.report().rows if r.format.startswith("TT"))


def test_full_rank_compile_is_exact():
    model = mlp((64, 96, 10)).double()
    compiled = tncompile.compile(model, target_ratio=1.0)
    x = torch.randn(5, 64, dtype=torch.float64)
    # at the largest rank that still gains, SVD error is small but may be non-zero
    assert compiled.ratio <= 1.0
    rebuilt = compiled.to_dense()
    assert torch.allclose(rebuilt(x), compiled(x), atol=1e-10)


def test_six_encoder_paper_config_compiles_trains_and_reports():
    model = six_encoder()
    compiled = tncompile.compile(model, target_ratio=1 / 44.9)
    assert 0.9 / 44.9 <= compiled.ratio <= 1 / 44.9
    rep = compiled.report()
    text = str(rep)
    assert "token_embedding" in text and "TTM" in text and "layers.5.ff2" in text
    assert "classifier" in text and "too small" in text  # the 3-class head stays dense, with its reason
    ids = torch.randint(1, 30522, (2, 128))
    compiled.train()
    loss = nn.functional.cross_entropy(compiled(ids), torch.tensor([0, 2]))
    loss.backward()
    grads = [p.grad for p in compiled.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_to_dense_matches_and_save_load_identical(tmp_path):
    model = small_encoder().eval()
    compiled = tncompile.compile(model, target_ratio=0.2).eval()
    ids = torch.randint(1, 1000, (3, 12))
    dense = compiled.to_dense()
    assert not any(isinstance(m, (TTLinear, TTMEmbedding)) for m in dense.modules())
    assert torch.allclose(dense(ids), compiled(ids), atol=1e-5)
    path = tmp_path / "model.tnc"
    tncompile.save(compiled, path)
    loaded = tncompile.load(path, model=small_encoder())
    assert torch.equal(loaded.eval()(ids), compiled(ids))
    assert loaded.ratio == compiled.ratio
    assert [r.name for r in loaded.program.history] == ["canonicalize", "follow_device", "tensorize", "assign_ranks", "decompose", "plan_contractions",
                                                          "fuse_feed_forward", "lower_dropout", "fuse_attention",
                                                          "fuse_siblings", "measure_ways"]
    # state_dict round trip into a fresh load
    with torch.no_grad():
        for p in compiled.parameters():
            p.add_(0.01)
    loaded.load_state_dict(compiled.state_dict())
    assert torch.equal(loaded(ids), compiled(ids))


def test_save_is_atomic(tmp_path, monkeypatch):
    compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3)
    path = tmp_path / "m.tnc"
    tncompile.save(compiled, path)
    before = path.read_bytes()

    def boom(tensor):
        raise OSError(errno.ENOSPC, "No space left on device")  # the disk fills half way

    monkeypatch.setattr(tncompile.serialization.container, "raw_bytes", boom)
    with pytest.raises(OSError, match=r"cannot write .*m\.tnc: No space left") as info:
        tncompile.save(compiled, path)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.tnc"]


def test_inplace_swaps_layers_into_the_model():
    model = mlp((64, 128, 10))
    compiled = tncompile.compile(model, target_ratio=0.3, inplace=True)
    assert isinstance(model[0], TTLinear)
    x = torch.randn(2, 64)
    assert torch.equal(model(x), compiled(x))


def test_dumps_written_for_every_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("TNCOMPILE_DUMP", str(tmp_path / "env"))
    tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3)
    names = sorted(p.name for p in (tmp_path / "env").iterdir())
    assert names == ["00-trace.json", "00-trace.txt", "01-canonicalize.json", "01-canonicalize.txt",
                     "02-follow_device.json", "02-follow_device.txt", "03-tensorize.json", "03-tensorize.txt",
                     "04-assign_ranks.json", "04-assign_ranks.txt", "05-decompose.json",
                     "05-decompose.txt", "06-plan_contractions.json", "06-plan_contractions.txt",
                     "07-fuse_feed_forward.json", "07-fuse_feed_forward.txt",
                     "08-lower_dropout.json", "08-lower_dropout.txt", "09-fuse_attention.json",
                     "09-fuse_attention.txt", "10-fuse_siblings.json", "10-fuse_siblings.txt",
                     "11-measure_ways.json", "11-measure_ways.txt"]
    text = (tmp_path / "env" / "05-decompose.txt").read_text()
    assert "TT 4x4x4->4x8x4" in text or "TT " in text
    doc = json.loads((tmp_path / "env" / "05-decompose.json").read_text())
    layers = [n["layer"] for n in doc["nodes"] if "layer" in n]
    assert layers and all(l["ranks"] for l in layers)
    explicit = tmp_path / "explicit"
    tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3, dump_dir=explicit, batch_sizes=[1, 4096])
    assert (explicit / "04-assign_ranks.txt").exists()
    assert "pending TT" in (explicit / "04-assign_ranks.txt").read_text()
    # once layers are planned (here for two batch sizes), the dump has the code each plan runs
    assert not (explicit / "05-decompose.code.py").exists()
    code = (explicit / "06-plan_contractions.code.py").read_text()
    compile(code, "06-plan_contractions.code.py", "exec")  # valid Python
    assert code.count("def forward(ops, bias, mm):") == code.count("# =====") == 2
    assert "rows <= 1," in code and "rows <= 4096," in code and "def backward(ops, grad_out, mm):" in code


def test_dump_formats():
    compiled = tncompile.compile(small_encoder(), target_ratio=0.2,
                                 example_inputs=(torch.randint(1, 1000, (2, 8)),))
    text = compiled.program.dump("text")
    assert "int64[2,8]" in text and "TTM" in text and "ranks=" in text and "->" in text
    dot = compiled.program.dump("dot")
    assert dot.startswith("digraph") and "fillcolor" in dot
    with pytest.raises(ValueError, match="unknown dump format"):
        compiled.program.dump("yaml")


def test_target_and_exclude_modules_and_rank_pattern():
    model = small_encoder()
    # prefer="size": at 0.75 the speed rule would keep one of these small layers dense
    c = tncompile.compile(model, target_ratio=0.75, target_modules=["ff1", "ff2"],
                          rank_pattern={"re:layers\\.0\\..*": 3}, prefer="size")
    tn = c.tensorized_modules()
    assert set(tn) == {f"layers.{i}.ff{j}" for i in range(2) for j in (1, 2)}
    assert max(tn["layers.0.ff1"].layout.ranks) == 3
    assert max(tn["layers.1.ff1"].layout.ranks) > 3
    c2 = tncompile.compile(model, target_ratio=0.3, exclude_modules="re:.*attention.*")
    assert not any("attention" in n for n in c2.tensorized_modules())
    assert c2.program.notes["layers.0.attention.query"] == "excluded by exclude_modules"


def test_to_device_dtype_and_torch_compile():
    compiled = tncompile.compile(small_encoder(), target_ratio=0.2).eval()
    ids = torch.randint(1, 1000, (2, 8))
    c64 = compiled.to(torch.float64)
    assert c64(ids).dtype == torch.float64
    c32 = compiled.to("cpu", torch.float32)
    assert c32(ids).dtype == torch.float32


def test_torch_compile_runs_forward_and_backward():
    compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3)
    x = torch.randn(4, 64)
    ref = compiled(x)
    opt = torch.compile(compiled)
    out = opt(x)
    assert torch.allclose(out, ref, atol=1e-5)
    out.sum().backward()
    assert compiled.model.get_submodule("0").cores[0].grad is not None


def test_report_rows_as_data_match_the_planner():
    from tncompile.planning import plan_contraction
    compiled = tncompile.compile(small_encoder(), target_ratio=0.2)
    rows = {r["name"]: r for r in compiled.report().as_dicts()}
    ff1 = rows["layers.0.ff1"]
    assert ff1["format"] == "TT" and ff1["params"] < ff1["dense_params"]
    assert ff1["ratio"] == pytest.approx(ff1["params"] / ff1["dense_params"])
    layer = compiled.model.get_submodule("layers.0.ff1")
    inputs, output, sizes = layer.planner_problem()
    rows_assumed = tncompile.tuning.ASSUMED_ROWS  # traced without shapes: per row over the assumed rows
    assert ff1["flops_now"] == 2 * plan_contraction(inputs, output, {**sizes, "b": rows_assumed}).fwd_flops / rows_assumed
    assert rows["token_embedding"]["format"] == "TTM" and rows["token_embedding"]["flops_now"] > 0
    assert rows["classifier"]["format"] == "dense" and "too small" in rows["classifier"]["note"]
