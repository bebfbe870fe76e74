"""Model files that load without running code: the safe format, what it refuses, format-1 files."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import tncompile
from tncompile.serialization import UnsafeFileError, _digest, allow_module_class
from tncompile.zoo import mlp, small_encoder

FIXTURES = Path(__file__).parent / "fixtures"


class Payload:
    """Unpickling this runs ``marker.touch()``: the classic pickle exploit."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _rewrite_manifest(src: Path, dst: Path, edit, reseal: bool = True) -> None:
    """Copy a tncompile file, letting ``edit(manifest)`` change its JSON manifest (tensors
    unchanged). ``reseal``: recompute the checksum, as a crafted (not damaged) file would."""
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    manifest = json.loads(meta["manifest"])
    edit(manifest)
    meta["manifest"] = json.dumps(manifest)
    tensors = load_file(src)
    if reseal:
        meta["sha256"] = _digest(tensors, meta["manifest"])
    save_file(tensors, dst, metadata=meta)


def _nodes(manifest):
    return manifest["graph"]["nodes"]


@pytest.fixture
def saved(tmp_path):
    ids = torch.randint(1, 1000, (2, 16))
    compiled = tncompile.compile(small_encoder(), target_ratio=0.3, example_inputs=(ids,))
    path = tmp_path / "model.tnc"
    tncompile.save(compiled, path)
    return compiled.eval(), path, ids


def test_file_is_safetensors_with_a_json_manifest(saved):
    compiled, path, ids = saved
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "tncompile" and meta["version"] == "2"
    manifest = json.loads(meta["manifest"])  # data only: it parses as JSON
    assert manifest["graph"]["root"]["__module__"] == "torch.nn.modules.module.Module"
    loaded = tncompile.load(path).eval()
    assert torch.equal(loaded(ids), compiled(ids))
    layers = loaded.tensorized_modules()
    assert {n: m.layout for n, m in layers.items()} == {n: m.layout for n, m in compiled.tensorized_modules().items()}
    # plans come back as data, equal to the ones saved
    ff1 = layers["layers.0.ff1"]
    assert ff1.plans and all(p.order() == compiled.tensorized_modules()["layers.0.ff1"].plans[b].order()
                             for b, p in ff1.plans.items())


def test_pickle_payload_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"format": "tncompile", "graph": Payload(marker)}, tmp_path / "evil.tnc")
    with pytest.raises(UnsafeFileError, match="trust=True"):
        tncompile.load(tmp_path / "evil.tnc")
    assert not marker.exists()


@pytest.mark.parametrize("attack, named", [
    ("function", "os.system"),
    ("module", "subprocess.Popen"),
    ("record", "collections.Counter"),
    ("method", "__reduce__"),
    ("getattr", "__class__"),
    ("op", "from_file"),
    ("torch_io", "torch.load"),
])
def test_crafted_manifest_is_refused(saved, tmp_path, attack, named):
    _, path, _ = saved

    def edit(manifest):
        nodes = _nodes(manifest)
        fn_node = next(n for n in nodes if n[0] == "call_function")
        if attack == "function":
            fn_node[2] = {"__fn__": "os.system"}
        elif attack == "torch_io":
            fn_node[2] = {"__fn__": "torch.load"}
        elif attack == "op":
            fn_node[2] = {"__op__": "aten::from_file"}
        elif attack == "module":
            manifest["graph"]["root"]["__module__"] = "subprocess.Popen"
        elif attack == "record":
            manifest["inputs"] = {"__dataclass__": "collections.Counter", "fields": {}}
        elif attack == "method":
            method = next(n for n in nodes if n[0] == "call_method")
            method[2] = "__reduce__"
        elif attack == "getattr":
            getter = next(n for n in nodes if n[0] == "call_function" and n[2] == {"__fn__": "builtins.getattr"})
            getter[3]["__tuple__"][1] = "__class__"

    edit_path = tmp_path / "crafted.tnc"
    _rewrite_manifest(path, edit_path, edit)
    with pytest.raises(UnsafeFileError, match=named.split(".")[-1]):
        tncompile.load(edit_path)


def test_damaged_manifest_is_detected(saved, tmp_path):
    """A changed manifest (here: the traced graph's notes) is caught by the checksum."""
    _, path, _ = saved

    def edit(manifest):
        manifest["notes"] = {"x": "flipped"}
    bad = tmp_path / "bad.tnc"
    _rewrite_manifest(path, bad, edit, reseal=False)
    with pytest.raises(ValueError, match="damaged"):
        tncompile.load(bad)


def test_save_mode_follows_umask_and_syncs_file_and_directory(saved, monkeypatch):
    """Like any file the user creates (not 0600), written durably: the file's data
    is fsynced before the rename and its directory entry after it."""
    import os
    import stat
    compiled, path, _ = saved
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real_fsync(fd))[1])
    old = os.umask(0o022)
    try:
        tncompile.save(compiled, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert len(synced) == 2 and synced[0].endswith(".tmp") and synced[1] == str(path.parent)


def test_damaged_tensors_are_detected(saved, tmp_path):
    _, path, _ = saved
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)  # zero the last 64 bytes of the tensor data
    bad = tmp_path / "bad.tnc"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged"):
        tncompile.load(bad)


def test_format_1_file_loads_only_with_trust():
    expected = json.loads((FIXTURES / "v1_small_encoder.json").read_text())
    path = FIXTURES / "v1_small_encoder.tnc"
    with pytest.raises(UnsafeFileError, match="trust=True"):
        tncompile.load(path)
    model = tncompile.load(path, trust=True).eval()
    ids = torch.tensor(expected["ids"])
    torch.testing.assert_close(model(ids), torch.tensor(expected["logits"]), rtol=1e-5, atol=1e-6)
    assert model.ratio == pytest.approx(expected["ratio"])
    # its plans were made afresh, as data this version saves
    assert all(p.cost for m in model.tensorized_modules().values() for p in m.plans.values())
    # its training state resumes into a new optimizer and controller
    opt = torch.optim.AdamW(tncompile.param_groups(model, lr=1e-3))
    ctl = tncompile.RankController(model, opt, target_ratio=0.2, early_steps=2)
    assert tncompile.resume(model, opt, ctl) == {"note": "v1 fixture"}
    assert ctl.steps_done == 3 and ctl.stage == "late"


def test_format_1_resaved_is_safe_and_equal(tmp_path):
    model = tncompile.load(FIXTURES / "v1_small_encoder.tnc", trust=True).eval()
    tncompile.save(model, tmp_path / "converted.tnc")
    again = tncompile.load(tmp_path / "converted.tnc").eval()
    ids = torch.tensor(json.loads((FIXTURES / "v1_small_encoder.json").read_text())["ids"])
    assert torch.equal(again(ids), model(ids))


class ScaledLinear(nn.Linear):
    """A user's own linear (kept dense below), unknown to tncompile's allowlist."""


def test_unknown_module_class_needs_trust_or_registration(tmp_path):
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), ScaledLinear(128, 64))
    compiled = tncompile.compile(model, target_ratio=0.6, exclude_modules=["2"])
    tncompile.save(compiled, tmp_path / "m.tnc")
    with pytest.raises(UnsafeFileError, match="ScaledLinear"):
        tncompile.load(tmp_path / "m.tnc")
    x = torch.randn(3, 64)
    assert torch.equal(tncompile.load(tmp_path / "m.tnc", trust=True)(x), compiled(x))
    from tncompile.serialization import SAFE_MODULE_CLASSES
    allow_module_class(ScaledLinear)
    try:
        assert torch.equal(tncompile.load(tmp_path / "m.tnc")(x), compiled(x))
    finally:
        SAFE_MODULE_CLASSES.discard(f"{ScaledLinear.__module__}.{ScaledLinear.__qualname__}")


def test_save_refuses_code_it_cannot_store(tmp_path):
    compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3)
    with pytest.raises(TypeError, match=r"\['extra'\]\['fn'\]: a builtins.function"):
        tncompile.save(compiled, tmp_path / "m.tnc", extra={"fn": F.relu})
    handle = compiled.model.get_submodule("0").register_forward_hook(lambda *a: None)
    with pytest.raises(TypeError, match="hooks are code"):
        tncompile.save(compiled, tmp_path / "m.tnc")
    handle.remove()
    assert not (tmp_path / "m.tnc").exists() and not list(tmp_path.iterdir())  # nothing half-written


def test_tied_parameters_stay_tied(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=500, n_positions=32)
    ids = torch.randint(0, 500, (2, 8))
    # traced in eval mode: export bakes GPT-2's functional dropout in as traced
    compiled = tncompile.compile(GPT2LMHeadModel(cfg).eval(), mode="graph", target_ratio=0.3,
                                 example_inputs={"input_ids": ids, "use_cache": False})
    tncompile.save(compiled, tmp_path / "g.tnc")
    loaded = tncompile.load(tmp_path / "g.tnc")
    head = loaded.tensorized_modules()["lm_head"]
    assert head.cores is loaded.tensorized_modules()["transformer.wte"].cores
    compiled.eval(), loaded.eval()
    assert torch.equal(loaded(input_ids=ids).logits, compiled(input_ids=ids).logits)
