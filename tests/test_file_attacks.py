"""Crafted model files, as an attacker would write them: the manifest or tensors edited and the
checksum recomputed (a checksum proves a file intact, not benign). A file is data: every class
of attack is refused with ``ModelFileError`` before anything is built from it, and no load
leaves a side effect -- no file written, no module imported, the caller's random stream, grad
mode, default dtype and tensors as they were. A bounded fuzz: every resealed edit is refused,
or loads the same model (same structure, same outputs)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tncompile
from tncompile import ModelFileError, ModelMismatchError
from tncompile.serialization.container import digest
from tncompile.testing import mlp

transformers = pytest.importorskip("transformers")


def _dense():
    return mlp((64, 128, 64, 10))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A graph-mode checkpoint (model, optimizer, controller, extra) and its outputs."""
    torch.manual_seed(0)
    compiled = tncompile.compile(_dense(), target_ratio=0.4, prefer="size")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.3)
    compiled(torch.randn(4, 64)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("attacks") / "base.tnc"
    tncompile.save(compiled, path, optimizer=opt, controller=ctl, extra={"k": [1, 2]})
    x = torch.randn(3, 64)
    compiled.eval()
    with torch.no_grad():
        want = compiled(x)
    tncompile.load(path, model=_dense())  # warm: later loads import nothing new
    return path, x, want


def _parts(path: Path) -> tuple[dict, dict, dict]:
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    return meta, json.loads(meta["manifest"]), load_file(path)


def _reseal(path: Path, dst: Path, edit) -> Path:
    """Write ``path`` with ``edit(manifest, tensors)`` applied and the checksum recomputed."""
    meta, manifest, tensors = _parts(path)
    edit(manifest, tensors)
    meta["manifest"] = json.dumps(manifest)
    meta["sha256"] = digest(tensors, meta["manifest"])
    save_file(tensors, dst, metadata=meta)
    return dst


class Sentinel:
    """What a payload would change: a marker file, imported modules, torch's global state,
    a tensor the caller holds."""

    def __init__(self, tmp_path: Path):
        self.marker = tmp_path / "pwned"
        self.held = torch.randn(5)
        self.copy = self.held.clone()
        self.look()

    def look(self) -> None:
        """Record the state a load must leave as it is (call right before the load)."""
        self.before = self._state()

    @staticmethod
    def _state():
        return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(),
                torch.get_rng_state().clone(), set(sys.modules), torch.are_deterministic_algorithms_enabled())

    def assert_untouched(self) -> None:
        assert not self.marker.exists(), "a payload ran"
        dtype, grad, threads, rng, modules, det = self._state()
        assert (dtype, grad, threads, det) == (self.before[0], self.before[1], self.before[2], self.before[5])
        assert torch.equal(rng, self.before[3]), "loading changed the global random state"
        assert not (modules - self.before[4]), f"loading imported {sorted(modules - self.before[4])[:5]}"
        assert torch.equal(self.held, self.copy)


def _first_row(m):
    return m["layers"][0]


def _core(m):
    return _first_row(m)["cores"][0]


# one edit per attack class: (manifest, tensors, sentinel) -> None
ATTACKS = {
    # code: nothing in the format names code, so code-shaped text has nowhere to go
    "graph-key": lambda m, t, s: m.update(graph={"nodes": [["call_function", "x", {"__fn__": "os.system"}]]}),
    "attribute-in-row": lambda m, t, s: _first_row(m).update(forward=f"__import__('os').system('touch {s.marker}')"),
    "class-as-code": lambda m, t, s: m.update(model_class=f"X(): __import__('os').system('touch {s.marker}')"),
    "pass-as-code": lambda m, t, s: m["pipeline"].insert(0, f"__import__('os').system('touch {s.marker}')"),
    "unknown-pass": lambda m, t, s: m["pipeline"].append("os-system"),
    "example-value-as-code": lambda m, t, s: m.update(example_inputs={"$tuple": [
        {"$tuple": []}, {"x": f"__import__('os').system('touch {s.marker}')"}]}),
    "object-in-training-state": lambda m, t, s: m["training"].update(extra={"$object": "os.system"}),
    # memory safety: every size is checked against the tensors before anything is built
    "core-wrong-shape": lambda m, t, s: t.update({_core(m): torch.zeros(1, 3, 5)}),
    "rank-beyond-bound": lambda m, t, s: _first_row(m)["layout"]["ranks"].__setitem__(0, 10**6),
    "modes-not-the-features": lambda m, t, s: _first_row(m)["layout"].update(in_modes=[2, 4, 8]),
    "dense-weight-wrong-shape": lambda m, t, s: t.update({"model.2.weight": torch.zeros(10, 65)}),
    "state-dtype-changed": lambda m, t, s: t.update({"model.2.bias": t["model.2.bias"].double()}),
    # exhaustion: sizes are bounded before anything allocates or runs
    "huge-modes": lambda m, t, s: _first_row(m)["layout"].update(in_features=2**30, in_modes=[2**10] * 3),
    "huge-example": lambda m, t, s: (t.update({"tncompile/example.0": torch.zeros(1 << 17, 64)}),
                                     m.update(example_inputs={"$tuple": [{"$tuple": [{"$tensor": "tncompile/example.0"}]}, {}]})),
    "many-batch-sizes": lambda m, t, s: m["options"].update(batch_sizes=list(range(1, 10**5))),
    "deep-nesting": lambda m, t, s: m["training"].update(extra={"k": json.loads("[" * 200 + "]" * 200)}),
    "random-state-wrong-size": lambda m, t, s: t.update({m["training"]["rng"]["cpu"]["$tensor"]: torch.zeros(7, dtype=torch.uint8)}),
    "random-stream-not-a-state": lambda m, t, s: m["training"]["extra"].update(rng_per_rank=[1.5]),
    # a different model, silently: names, kinds, ties and layouts must be the rebuilt model's exactly
    "state-entry-shadows-method": lambda m, t, s: (m["state"]["names"].append("train"), t.update(train=torch.zeros(1))),
    "state-entry-dropped": lambda m, t, s: (m["state"]["names"].remove("model.2.bias"), t.pop("model.2.bias")),
    "layer-kind-changed": lambda m, t, s: _first_row(m).update(kind="embedding"),
    "layer-dropped-from-table": lambda m, t, s: m["layers"].pop(0),
    "layer-moved": lambda m, t, s: _first_row(m).update(path="2"),
    "unreferenced-tensor": lambda m, t, s: t.update(extra=torch.zeros(3)),
    "tie-invented": lambda m, t, s: _first_row(m).update(kind="tied", tied_to="1"),
    "other-version": lambda m, t, s: m.update(version=2),
    "bad-field-type": lambda m, t, s: m.update(original_params="many"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_crafted_file_is_refused_with_no_side_effect(base, attack, tmp_path):
    path, _, _ = base
    dense = _dense()  # built before the sentinel looks: building draws from the random stream
    weights = {k: v.clone() for k, v in dense.state_dict().items()}
    sentinel = Sentinel(tmp_path)
    bad = _reseal(path, tmp_path / "bad.tnc", lambda m, t: ATTACKS[attack](m, t, sentinel))
    sentinel.look()
    with pytest.raises(ModelFileError):
        tncompile.load(bad, model=dense)
    sentinel.assert_untouched()
    if attack not in ("example-value-as-code",):  # refused before the model was touched
        assert all(torch.equal(v, weights[k]) for k, v in dense.state_dict().items())


def test_example_inputs_the_user_gives_replace_the_files(base, tmp_path):
    """Inputs too large to run the model on are refused -- unless the caller passes their own."""
    path, x, want = base
    bad = _reseal(path, tmp_path / "big.tnc", lambda m, t: ATTACKS["huge-example"](m, t, None))
    with pytest.raises(ModelFileError, match="pass example_inputs="):
        tncompile.load(bad, model=_dense())
    loaded = tncompile.load(bad, model=_dense(), example_inputs=(torch.randn(2, 64),)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), want)


def test_a_mismatched_model_is_a_model_file_error_that_names_the_layer(base):
    path, _, _ = base
    with pytest.raises(ModelMismatchError, match="'0'") as caught:
        tncompile.load(path, model=mlp((64, 96, 64, 10)))
    assert isinstance(caught.value, ModelFileError)
    with pytest.raises(ModelFileError, match="pass the dense model it was saved from"):
        tncompile.load(path)


def test_the_saved_model_loads_and_resumes(base):
    path, x, want = base
    loaded = tncompile.load(path, model=_dense()).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), want)
    opt = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    ctl = tncompile.RankController(loaded, opt, target_ratio=0.3)
    assert tncompile.resume(loaded, opt, ctl) == {"k": [1, 2]}


def _mutate(value, rng: random.Random):
    """A small random edit of one JSON leaf or container."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice([value + 1, value - 1, -value, value * 1000, 0, 2**40])
    if isinstance(value, float):
        return rng.choice([value * 2, -value, 0.0, 1e308])
    if isinstance(value, str):
        return rng.choice(["", value + ".x", value[::-1], "__import__('os')", "model.0"])
    if isinstance(value, list):
        if value and rng.random() < 0.5:
            return value[:-1]
        return value + value[:1]
    if isinstance(value, dict) and value:
        out = dict(value)
        out.pop(rng.choice(sorted(out)))
        return out
    return value


def _leaves(node, path=()):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, path + (i,))


def test_fuzzed_files_are_refused_or_the_same_model(base, tmp_path):
    path, x, want = base
    _, manifest, _ = _parts(path)
    targets = [p for p, _ in _leaves(manifest) if p]
    rng = random.Random(0)
    outcomes = {"refused": 0, "same": 0}
    for i in range(60):
        where = rng.choice(targets)

        def edit(m, t, where=where):
            node = m
            for k in where[:-1]:
                node = node[k]
            node[where[-1]] = _mutate(node[where[-1]], rng)
        bad = _reseal(path, tmp_path / f"fuzz{i}.tnc", edit)
        try:
            loaded = tncompile.load(bad, model=_dense())
        except ModelFileError:
            outcomes["refused"] += 1
            continue
        loaded.eval()
        with torch.no_grad():
            assert torch.equal(loaded(x), want), f"edit at {where} loaded a different model"
        outcomes["same"] += 1
    assert outcomes["refused"] > 20 and outcomes["refused"] + outcomes["same"] == 60


# ----------------------------------------------------------------- save_pretrained folders
def _bert(vocab=500):
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    ids = torch.randint(0, 500, (2, 8))
    compiled = tncompile.compile(_bert(), target_ratio=0.4, example_inputs={"input_ids": ids}, mode="swap")
    out = tmp_path_factory.mktemp("folder") / "bert"
    compiled.save_pretrained(out)
    return out


def _edited_config(folder: Path, tmp_path: Path, **changes) -> Path:
    dst = tmp_path / "edited"
    dst.mkdir()
    for f in folder.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_folder_config_asking_for_other_attention_code_is_refused(folder, tmp_path):
    edited = _edited_config(folder, tmp_path, attn_implementation="kernels-community/flash-attn")
    sentinel = Sentinel(tmp_path)
    with pytest.raises(ModelFileError, match="not PyTorch's own attention"):
        tncompile.load(edited, model=transformers.BertForSequenceClassification)
    sentinel.assert_untouched()


def test_a_folder_config_naming_remote_code_is_never_imported(folder, tmp_path):
    edited = _edited_config(folder, tmp_path, auto_map={"AutoModel": "evil_module.EvilModel"},
                            trust_remote_code=True)
    loaded = tncompile.load(edited, model=transformers.BertForSequenceClassification)
    assert "evil_module" not in sys.modules and not hasattr(loaded.config, "auto_map")


def test_a_folder_config_inflating_a_size_is_refused_within_a_memory_bound(folder, tmp_path):
    """A vocabulary of 2**27 (a 32 GB table) in config.json: refused from a meta-device build
    before anything is allocated; run under a 3 GB address-space limit to prove it."""
    edited = _edited_config(folder, tmp_path, vocab_size=2**27)
    script = textwrap.dedent(f"""
        import resource, sys
        import tncompile, transformers
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        try:
            tncompile.load({str(edited)!r}, model=transformers.BertForSequenceClassification)
        except tncompile.ModelFileError as e:
            print("refused:", e)
            sys.exit(0)
        sys.exit(1)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "refused:" in run.stdout, run.stderr[-2000:]
    assert "parameters" in run.stdout or "bytes" in run.stdout or "in the model saved beside it" in run.stdout


@pytest.mark.parametrize("shape", ["loop", "dangling"])
def test_a_link_that_leads_to_no_file_is_a_model_file_error(shape, tmp_path):
    """Issue 65 item 9: a symlink loop (or a link to nothing) is named as such, not a raw
    ``FileNotFoundError`` that says the file is missing."""
    first, second = tmp_path / "a.tnc", tmp_path / "b.tnc"
    if shape == "loop":
        first.symlink_to(second)
        second.symlink_to(first)
    else:
        first.symlink_to(tmp_path / "gone.tnc")
    with pytest.raises(ModelFileError, match="a link that leads to no file"):
        tncompile.load(first, model=mlp((8, 8)))
    with pytest.raises(FileNotFoundError, match="no file"):
        tncompile.load(tmp_path / "missing.tnc", model=mlp((8, 8)))


def test_bytes_changed_after_the_checksum_are_never_used(tmp_path, monkeypatch):
    """Issue 65 item 4: a core zeroed in place between the checksum and the read used to load
    without error, with other outputs. Each tensor is now read once; the checksum hashes
    exactly those buffers, and the load uses them."""
    from tncompile.serialization import model_file
    torch.manual_seed(0)
    model = tncompile.compile(mlp((64, 256, 256, 8)), target_ratio=0.3)
    path = tmp_path / "m.tnc"
    tncompile.save(model, path)
    x = torch.randn(4, 64)
    model.eval()
    with torch.no_grad():
        expected = model(x)
    real_verify = model_file.SavedModel.verify

    def verify_then_tamper(self):
        real_verify(self)
        name = next(n for n in self.file.specs if ".cores." in n)
        spec = self.file.specs[name]
        with open(path, "r+b") as f:       # the same inode, changed in place
            f.seek(spec.offset)
            f.write(bytes(spec.nbytes))
    monkeypatch.setattr(model_file.SavedModel, "verify", verify_then_tamper)
    loaded = tncompile.load(path, model=mlp((64, 256, 256, 8))).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)


# ----------------------------------------------------------------- one parser (issue 65 item 3)
def _raw_file(path, header: bytes, data: bytes = b"\0" * 8):
    import struct
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


_ENTRY = b'{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
CRAFTED_HEADERS = {
    "utf-8 byte-order mark": b"\xef\xbb\xbf{\"a\":" + _ENTRY + b"}",
    "utf-16": ('{"a":' + _ENTRY.decode() + "}").encode("utf-16"),
    "utf-32": ('{"a":' + _ENTRY.decode() + "}").encode("utf-32"),
    "name given twice": b'{"a":' + _ENTRY + b',"a":' + _ENTRY + b"}",
    "metadata a list": b'{"__metadata__":[],"a":' + _ENTRY + b"}",
    "metadata zero": b'{"__metadata__":0,"a":' + _ENTRY + b"}",
    "zero-size dims past 2**64": b'{"z":{"dtype":"F32","shape":[0,99999999999999999999999],"data_offsets":[0,0]},'
                                 b'"a":' + _ENTRY + b"}",
    "lone surrogate name": b'{"\\ud800":' + _ENTRY + b"}",
}


@pytest.mark.parametrize("case", list(CRAFTED_HEADERS))
def test_headers_the_safetensors_library_refuses_are_refused(case, tmp_path):
    from tncompile.serialization.tensor_file import open_tensor_file
    path = _raw_file(tmp_path / "x.safetensors", CRAFTED_HEADERS[case])
    with pytest.raises(ModelFileError):
        open_tensor_file(path)


def test_escaped_names_count_toward_the_tensor_bound_before_python_parses(tmp_path):
    """``"data\\u005foffsets"`` is ``"data_offsets"``: a count of raw bytes missed 250,000
    such entries (a 14.7 MB file took 4.5 s and 214 MB before load refused it)."""
    import resource
    import time
    from tncompile.serialization.tensor_file import MAX_TENSORS, open_tensor_file
    n = MAX_TENSORS + 50_000
    entries = b",".join(b'"t%d":{"dtype":"F32","shape":[0],"data\\u005foffsets":[0,0]}' % i for i in range(n))
    path = _raw_file(tmp_path / "many.safetensors", b"{" + entries + b"}", b"")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(ModelFileError, match="more than 100,000 tensors"):
        open_tensor_file(path)
    assert time.perf_counter() - start < 3.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 150_000   # KiB


def test_whatever_the_library_refuses_tncompile_refuses_fuzzed(tmp_path):
    """Random byte edits of a real file's header: where the safetensors library refuses the
    bytes, tncompile's reader does too (two readers that disagree are how parser attacks start)."""
    import random
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tncompile.serialization.tensor_file import open_tensor_file
    save_file({"a": torch.zeros(2), "b": torch.ones(3, 2)}, str(tmp_path / "good.safetensors"), metadata={"k": "v"})
    good = (tmp_path / "good.safetensors").read_bytes()
    length = int.from_bytes(good[:8], "little")
    rng = random.Random(0)
    refused_by_library = 0
    for i in range(300):
        header = bytearray(good[8:8 + length])
        for _ in range(rng.randint(1, 3)):
            header[rng.randrange(len(header))] = rng.choice(b'{}[]",:0123456789aeuF\\\xef\xbb\xbf\xff ')
        path = tmp_path / f"f{i}.safetensors"
        path.write_bytes(len(header).to_bytes(8, "little") + bytes(header) + good[8 + length:])
        try:
            with safe_open(str(path), "pt") as f:
                list(f.keys())
        except Exception:  # noqa: BLE001 -- whatever the library raises
            refused_by_library += 1
            with pytest.raises(ModelFileError):
                open_tensor_file(path).close()
    assert refused_by_library > 100


def test_every_file_tncompile_writes_replaces_a_planted_link_instead_of_writing_through(tmp_path):
    """IR dumps and a training history's JSON and PNG: a link planted where the file goes is
    replaced by the file; the link's target is left as it was."""
    from tncompile.train.history import History
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "00-trace.txt").symlink_to(target)
    tncompile.compile(mlp(), target_ratio=0.5, dump_dir=dumps)
    history = History()
    history.record(0, 1.0, 1.0, 1.0, 10.0, "early")
    history.record(1, 0.5, 0.5, 0.5, 10.0, "late")
    for name, write in (("h.json", history.save_json), ("h.png", history.plot)):
        (tmp_path / name).symlink_to(target)
        write(tmp_path / name)
        assert not (tmp_path / name).is_symlink() and (tmp_path / name).stat().st_size > 0
    assert not (dumps / "00-trace.txt").is_symlink() and "tncompile program" in (dumps / "00-trace.txt").read_text()
    assert target.read_text() == "keep me"
    assert History.from_dict(json.loads((tmp_path / "h.json").read_text())).loss == [1.0, 0.5]
