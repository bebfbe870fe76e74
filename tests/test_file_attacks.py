"""Crafted model files, as an attacker would write them: the manifest edited and the
checksum recomputed (a checksum proves a file intact, not benign). Each attack class is
refused by ``tncompile.load`` with the library's error, before anything runs: no file is
created or read, no module imported, no process started, no global torch state changed.
Plus a bounded fuzz of saved files: every outcome is the library's error or the same model.

Base files: the format-2 fixtures (a traced encoder; an exported HF BERT with aten ops and
pytree specs), so no test here compiles a model it does not need.
"""
import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tncompile
from tncompile.errors import ModelFileError, UnsafeFileError
from tncompile.serialization import _digest

FIXTURES = Path(__file__).parent / "fixtures"
ENCODER = FIXTURES / "v2_small_encoder_ckpt.tnc"
BERT = FIXTURES / "v2_hf_bert.tnc"


def _parts(path: Path) -> tuple[dict, dict, dict]:
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    return meta, json.loads(meta["manifest"]), load_file(path)


def _reseal(meta: dict, manifest, tensors: dict, dst: Path) -> Path:
    """Write a crafted file whose checksum matches its (edited) contents."""
    meta = dict(meta)
    meta["manifest"] = manifest if isinstance(manifest, str) else json.dumps(manifest)
    meta["sha256"] = _digest(tensors, meta["manifest"])
    save_file(tensors, dst, metadata=meta)
    return dst


def _nodes(manifest) -> list:
    return manifest["graph"]["nodes"]


def _first(manifest, op, pred=lambda n: True) -> list:
    return next(n for n in _nodes(manifest) if n[0] == op and pred(n))


def _module(manifest, path: str) -> dict:
    node = manifest["graph"]["root"]
    for part in path.split("."):
        node = node["state"]["_modules"][part]
    return node


class Sentinel:
    """What a payload would change: a marker file, imported modules, torch's global state."""

    def __init__(self, tmp_path: Path):
        self.marker = tmp_path / "pwned"
        self.before = self._state()

    @staticmethod
    def _state():
        return (torch.get_default_dtype(), torch.get_num_threads(), torch.get_rng_state().clone(),
                set(sys.modules), torch.are_deterministic_algorithms_enabled())

    def command(self) -> str:
        return f"touch {self.marker}"

    def assert_untouched(self, rng_used: bool = False) -> None:
        """``rng_used``: the test ran the model in training mode (dropout draws from the global stream)."""
        assert not self.marker.exists(), "a payload ran"
        dtype, threads, rng, modules, det = self._state()
        assert dtype == self.before[0] and threads == self.before[1] and det == self.before[4]
        assert rng_used or torch.equal(rng, self.before[2]), "loading changed the global random state"
        assert not {"antigravity", "webbrowser", "subprocess_payload"} & (modules - self.before[3])


# ----------------------------------------------------------------- attacks, one per class
def _code_in_placeholder(m, s):
    _first(m, "placeholder")[2] = f"ids=__import__('os').system('{s.command()}')"


def _code_in_method_name(m, s):
    _first(m, "call_method")[2] = f'size"); __import__("os").system("{s.command()}"); getattr(x, "'


def _code_in_keyword_key(m, s):
    node = _first(m, "call_method")
    node[4] = {f"a=__import__('os').system('{s.command()}'),b": 1}


def _code_in_node_name(m, s):
    node = _first(m, "call_function")
    node[1] = f"x=__import__('os').system('{s.command()}')"


def _code_in_class_name(m, s):
    m["graph"]["class_name"] = f"X(): __import__('os').system('{s.command()}')"


def _code_in_pytree_args(m, s):
    m["graph"]["pytree"]["orig_args"] = [f"input_ids=__import__('os').system('{s.command()}')"]


def _code_in_pytree_key(m, s):
    spec = json.loads(m["graph"]["pytree"]["in_spec"])
    spec[1]["children_spec"][1]["context"] = json.dumps([f"input_ids': __import__('os').system('{s.command()}'), '"])
    m["graph"]["pytree"]["in_spec"] = json.dumps(spec)


def _pytree_type_imports(m, s):
    spec = json.loads(m["graph"]["pytree"]["out_spec"])
    spec[1]["type"] = "antigravity.Fly"
    m["graph"]["pytree"]["out_spec"] = json.dumps(spec)


def _fn(name):
    def edit(m, s):
        _first(m, "call_function")[2] = {"__fn__": name}
    return edit


def _method(name):
    def edit(m, s):
        _first(m, "call_method")[2] = name
    return edit


def _op(name):
    def edit(m, s):
        _first(m, "call_function", lambda n: "__op__" in n[2])[2] = {"__op__": name}
    return edit


def _getattr_reads(attr):
    def edit(m, s):
        node = _first(m, "call_function", lambda n: n[2] == {"__fn__": "builtins.getattr"})
        node[3]["__tuple__"][1] = attr
    return edit


def _to_device_by_string(m, s):
    node = _first(m, "call_method", lambda n: n[2] == "to")
    node[3]["__tuple__"][1:] = ["cuda"]


def _module_class(name):
    def edit(m, s):
        _module(m, "norm")["__module__"] = name
    return edit


def _record(name):
    def edit(m, s):
        m["inputs"] = {"__dataclass__": name, "fields": {}}
    return edit


def _torch_value(m, s):
    _first(m, "call_method", lambda n: n[2] == "to")[3]["__tuple__"][1] = {"__torch__": "set_default_dtype"}


def _device_string(m, s):
    m["inputs"] = {"__device__": f"cpu'); __import__('os').system('{s.command()}'); ('"}


def _foreign_get_attr(m, s):
    _first(m, "get_attr")[2] = "norm.__class__.__init__.__globals__"


def _module_outside_graph(m, s):
    _first(m, "call_module")[2] = "nothing.here"


def _hook_in_state(m, s):
    _module(m, "norm")["state"]["_forward_hooks"] = {"__dict__": [[0, "os.system"]]}


def _child_named_like_code(m, s):
    mods = m["graph"]["root"]["state"]["_modules"]
    mods[f"x\"); __import__('os').system('{s.command()}'); (\""] = mods.pop("norm")


def _huge_literal_allocation(m, s):
    node = _first(m, "call_function")
    node[2] = {"__fn__": "torch.zeros"}
    node[3] = {"__tuple__": [100_000, 100_000]}
    node[4] = {}


def _inflated_setting(m, s):
    _module(m, "norm")["state"]["normalized_shape"] = {"__tuple__": [10**12]}


ATTACKS = {
    # strings torch.fx pastes into generated code
    "placeholder-default-runs-code": (ENCODER, _code_in_placeholder, UnsafeFileError, "input name"),
    "method-name-breaks-out": (ENCODER, _code_in_method_name, UnsafeFileError, "method"),
    "keyword-key-runs-code": (ENCODER, _code_in_keyword_key, UnsafeFileError, "keyword argument"),
    "node-name-runs-code": (ENCODER, _code_in_node_name, UnsafeFileError, "node name"),
    "class-name-runs-code": (ENCODER, _code_in_class_name, UnsafeFileError, "class name"),
    "pytree-arg-runs-code": (BERT, _code_in_pytree_args, UnsafeFileError, "argument names"),
    "pytree-key-breaks-out": (BERT, _code_in_pytree_key, UnsafeFileError, "pytree key"),
    "pytree-type-imports": (BERT, _pytree_type_imports, UnsafeFileError, "antigravity"),
    # functions outside the table, however spelled
    "import-dotted-name": (ENCODER, _fn("torch._import_dotted_name"), UnsafeFileError, "_import_dotted_name"),
    "attrgetter": (ENCODER, _fn("operator.attrgetter"), UnsafeFileError, "attrgetter"),
    "operator-call": (ENCODER, _fn("operator.call"), UnsafeFileError, "operator.call"),
    "eval": (ENCODER, _fn("builtins.eval"), UnsafeFileError, "eval"),
    "os-system": (ENCODER, _fn("os.system"), UnsafeFileError, "os.system"),
    "import-before-check": (ENCODER, _fn("antigravity.fly"), UnsafeFileError, "antigravity"),
    "set-default-dtype": (ENCODER, _fn("torch.set_default_dtype"), UnsafeFileError, "set_default_dtype"),
    "set-num-threads": (ENCODER, _fn("torch.set_num_threads"), UnsafeFileError, "set_num_threads"),
    "manual-seed": (ENCODER, _fn("torch.manual_seed"), UnsafeFileError, "manual_seed"),
    "torch-load": (ENCODER, _fn("torch.load"), UnsafeFileError, "torch.load"),
    "torch-from-file": (ENCODER, _fn("torch.from_file"), UnsafeFileError, "from_file"),
    # methods that reach files, storage, numpy, sharing, devices by name
    "numpy": (ENCODER, _method("numpy"), UnsafeFileError, "numpy"),
    "tofile": (ENCODER, _method("tofile"), UnsafeFileError, "tofile"),
    "untyped-storage": (ENCODER, _method("untyped_storage"), UnsafeFileError, "untyped_storage"),
    "share-memory": (ENCODER, _method("share_memory_"), UnsafeFileError, "share_memory_"),
    "dunder-method": (ENCODER, _method("__reduce__"), UnsafeFileError, "__reduce__"),
    "to-device-by-string": (ENCODER, _to_device_by_string, UnsafeFileError, "string argument"),
    # ops
    "aten-from-file": (BERT, _op("aten::from_file"), UnsafeFileError, "from_file"),
    "aten-nested-from-file": (BERT, _op("aten::_nested_from_file"), UnsafeFileError, "_nested_from_file"),
    "op-name-with-code": (BERT, _op("aten::add.Tensor; import os"), UnsafeFileError, "not an op name"),
    "other-namespace": (BERT, _op("prims::device_put.default"), UnsafeFileError, "prims"),
    # attribute reads and paths
    "getattr-dunder": (ENCODER, _getattr_reads("__class__"), UnsafeFileError, "__class__"),
    "getattr-numpy": (ENCODER, _getattr_reads("numpy"), UnsafeFileError, "numpy"),
    "get-attr-globals": (ENCODER, _foreign_get_attr, UnsafeFileError, "not an attribute of the graph"),
    "call-module-elsewhere": (ENCODER, _module_outside_graph, UnsafeFileError, "nothing.here"),
    "child-name-breaks-out": (ENCODER, _child_named_like_code, UnsafeFileError, "letters, digits"),
    # module classes, records, values
    "class-by-prefix": (ENCODER, _module_class("torch.nn.modules.module.torch.nn.parallel.DistributedDataParallel"),
                        UnsafeFileError, "DistributedDataParallel"),
    "class-elsewhere": (ENCODER, _module_class("subprocess.Popen"), UnsafeFileError, "Popen"),
    "class-import-before-check": (ENCODER, _module_class("antigravity.Fly"), UnsafeFileError, "antigravity"),
    "ddp-class": (ENCODER, _module_class("torch.nn.parallel.distributed.DistributedDataParallel"),
                  UnsafeFileError, "DistributedDataParallel"),
    "hook-in-state": (ENCODER, _hook_in_state, UnsafeFileError, "hooks are code"),
    "record-elsewhere": (ENCODER, _record("collections.Counter"), UnsafeFileError, "Counter"),
    "torch-value-elsewhere": (ENCODER, _torch_value, UnsafeFileError, "set_default_dtype"),
    "device-string": (ENCODER, _device_string, ModelFileError, "not a device"),
    # sizes
    "literal-allocation": (ENCODER, _huge_literal_allocation, UnsafeFileError, "10,000,000,000 elements"),
    "inflated-setting": (ENCODER, _inflated_setting, UnsafeFileError, "normalized_shape: 1,000,000,000,000"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_crafted_file_is_refused_with_no_side_effect(attack, tmp_path):
    base, edit, error, message = ATTACKS[attack]
    meta, manifest, tensors = _parts(base)
    sentinel = Sentinel(tmp_path)
    edit(manifest, sentinel)
    crafted = _reseal(meta, manifest, tensors, tmp_path / "crafted.tnc")
    with pytest.raises(error, match=message):
        tncompile.load(crafted)
    sentinel.assert_untouched()
    assert issubclass(error, ValueError)


def test_deep_nesting_is_the_librarys_error(tmp_path):
    meta, manifest, tensors = _parts(ENCODER)
    text = json.dumps(manifest).replace('"notes": {', '"notes": {"deep": ' + "[" * 10000 + "]" * 10000 + ", ", 1)
    crafted = _reseal(meta, text, tensors, tmp_path / "deep.tnc")
    with pytest.raises(ModelFileError, match="manifest"):
        tncompile.load(crafted)
    manifest["inputs"] = {"__tuple__": [{"__tuple__": []}]}
    for _ in range(200):
        manifest["inputs"] = {"__tuple__": [manifest["inputs"]]}
    crafted = _reseal(meta, manifest, tensors, tmp_path / "deep2.tnc")
    with pytest.raises(ModelFileError, match="nested more than"):
        tncompile.load(crafted)


def test_plan_fields_never_reach_generated_code(tmp_path):
    """A plan's index names and sizes were pasted into the executor's generated source; now
    loading rebuilds every plan from the layout and keeps only its bucket and order."""
    meta, manifest, tensors = _parts(ENCODER)
    model = tncompile.load(ENCODER).eval()
    ids = torch.randint(1, 300, (2, 8))
    with torch.no_grad():
        want = model(ids)
    sentinel = Sentinel(tmp_path)
    payload = f"\n    __import__('os').system('{sentinel.command()}')\n#"
    edited = 0
    for value in _walk(manifest):
        if isinstance(value, dict) and value.get("__dataclass__") == "tncompile.runtime.plans.ContractionPlan":
            fields = value["fields"]
            fields["sizes"] = {k: f"1){payload}" for k in (fields["sizes"] or {})}
            for step in fields["steps"]:
                step["fields"]["a_idx"] = {"__tuple__": [payload] * len(step["fields"]["a_idx"]["__tuple__"])}
            edited += 1
    assert edited > 0
    loaded = tncompile.load(_reseal(meta, manifest, tensors, tmp_path / "plans.tnc")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids), want)
    loaded.train()
    loaded(ids).sum().backward()  # the backward's generated code too
    sentinel.assert_untouched(rng_used=True)


def _walk(v):
    yield v
    if isinstance(v, dict):
        for x in v.values():
            yield from _walk(x)
    elif isinstance(v, list):
        for x in v:
            yield from _walk(x)


def _first_tt_layout(manifest) -> dict:
    for v in _walk(manifest):
        if isinstance(v, dict) and v.get("__dataclass__") == "tncompile.formats.layout.TTLayout":
            return v["fields"]
    raise AssertionError("no TT layout in the file")


@pytest.mark.parametrize("edit, message", [
    (lambda f: f.update(ranks={"__tuple__": [r + 1 for r in f["ranks"]["__tuple__"]]}), "cores are"),
    (lambda f: f.update(in_modes={"__tuple__": [4096, 4096, 4096]}), "cores are"),
    (lambda f: f.update(in_features=10**9), r"hold .* < in_features"),
    (lambda f: f.update(ranks={"__tuple__": [0] + f["ranks"]["__tuple__"][1:]}), "not an integer"),
    (lambda f: f.update(out_modes={"__tuple__": ["8", 8, 8]}), "not an integer"),
])
def test_layouts_must_agree_with_the_stored_tensors(edit, message, tmp_path):
    meta, manifest, tensors = _parts(ENCODER)
    edit(_first_tt_layout(manifest))
    with pytest.raises(ModelFileError, match=message):
        tncompile.load(_reseal(meta, manifest, tensors, tmp_path / "layout.tnc"))


def test_trust_is_the_only_way_past_the_tables(tmp_path):
    """A benign function outside the table (``torch.special.entr``) loads with trust=True, and only then."""
    meta, manifest, tensors = _parts(ENCODER)
    node = _first(manifest, "call_function", lambda n: "__fn__" in n[2])
    node[2] = {"__fn__": "torch.special.entr"}
    crafted = _reseal(meta, manifest, tensors, tmp_path / "entr.tnc")
    with pytest.raises(UnsafeFileError, match="entr"):
        tncompile.load(crafted)
    assert tncompile.load(crafted, trust=True) is not None


# ----------------------------------------------------------------- fuzz
FUZZ_CASES = int(os.environ.get("TNCOMPILE_FUZZ_CASES", "160"))


def _mutations(rng: random.Random, meta: dict, manifest: dict, tensors: dict, raw: bytes):
    """Yield ``(kind, bytes of a mutated file)``."""
    kind = rng.choice(["flip", "truncate", "json", "json", "json", "header"])
    if kind == "flip":
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return kind, bytes(data)
    if kind == "truncate":
        return kind, raw[: rng.randrange(len(raw))]
    if kind == "header":
        n = int.from_bytes(raw[:8], "little")
        header = bytearray(raw[8:8 + n])
        pos = rng.randrange(len(header))
        header[pos:pos + 1] = rng.choice([b"9", b"-", b'"', b"{", b"]", b"\\", b"\x00", b"1e999"])
        return kind, len(header).to_bytes(8, "little") + bytes(header) + raw[8 + n:]
    edited = json.loads(json.dumps(manifest))
    nodes = list(_walk(edited))
    target = rng.choice([v for v in nodes if isinstance(v, (dict, list)) and v])
    key = rng.choice(list(target) if isinstance(target, dict) else range(len(target)))
    junk = rng.choice([None, True, -1, 0, 2**70, 1e308, "", "x" * 300, "__import__('os')", [], {}, [[[]]],
                       {"__tensor__": "t999999"}, {"__tuple__": 5}, {"__dataclass__": "x"}, {"__node__": "nope"},
                       {"__module__": "torch.nn.modules.linear.Linear", "path": "", "state": {}}])
    action = rng.choice(["replace", "delete", "swap"])
    if action == "delete" and isinstance(target, dict):
        del target[key]
    elif action == "swap" and isinstance(target, list) and len(target) > 1:
        i = rng.randrange(len(target))
        target[key], target[i] = target[i], target[key]
    else:
        target[key] = junk
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tnc-fuzz-{os.getpid()}.tnc"
    _reseal(meta, edited, tensors, path)
    data = path.read_bytes()
    path.unlink()
    return kind, data


@pytest.mark.parametrize("base", [ENCODER, BERT], ids=["traced-encoder", "exported-bert"])
def test_fuzzed_files_give_the_librarys_error_or_the_same_model(base, tmp_path):
    if base is BERT:
        pytest.importorskip("transformers")
    seed = int(os.environ.get("TNCOMPILE_FUZZ_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    meta, manifest, tensors = _parts(base)
    raw = base.read_bytes()
    original = tncompile.load(base).eval()
    if base is ENCODER:
        inputs = {"ids": torch.randint(1, 300, (2, 8))}
    else:
        inputs = {"input_ids": torch.randint(0, 500, (2, 8))}

    def output(model):
        with torch.no_grad():
            out = model(*inputs.values()) if base is ENCODER else model(**inputs).logits
        return out

    want = output(original)
    sentinel = Sentinel(tmp_path)
    outcomes = {}
    for case in range(FUZZ_CASES // 2):
        kind, data = _mutations(rng, meta, manifest, tensors, raw)
        path = tmp_path / "fuzz.tnc"
        path.write_bytes(data)
        try:
            loaded = tncompile.load(path).eval()
        except ModelFileError:
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            continue
        except Exception as e:  # noqa: BLE001 - the point: nothing but the library's error
            pytest.fail(f"seed {seed} case {case} ({kind}): {type(e).__name__}: {e}")
        try:
            same = torch.equal(output(loaded), want)
        except Exception:  # noqa: BLE001 - an edited setting the layer rejects when it runs
            same = False
        label = "loaded-same" if same else "loaded-different"
        if not same and kind != "json":  # only a resealed edit may make another valid model
            pytest.fail(f"seed {seed} case {case} ({kind}): a damaged file loaded as another model")
        outcomes[label] = outcomes.get(label, 0) + 1
    sentinel.assert_untouched()
    print(f"fuzz seed {seed}: {outcomes}")
    assert outcomes.get("refused", 0) > 0
