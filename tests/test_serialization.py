"""The model file (format 3): safetensors tensors under their ``state_dict`` names plus a
manifest of data; ``load`` rebuilds from the user's model. Round trips are bit for bit in
graph mode (default pipeline, a custom pass) and swap mode (BERT, GPT-2, Llama), with the
training state; older formats and damaged files are refused with ``ModelFileError``."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import tncompile
from tncompile import ModelFileError, ModelMismatchError
from tncompile.testing import mlp, small_encoder

transformers = pytest.importorskip("transformers")
FIXTURES = Path(__file__).parent / "fixtures"
MANIFEST_KEYS = {"format", "version", "mode", "model_class", "pipeline", "options", "original_params",
                 "compiled_ratio", "example_inputs", "layers", "state", "training", "train_mode"}


def _manifest(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["manifest"])


def _trained_encoder():
    torch.manual_seed(0)
    compiled = tncompile.compile(small_encoder(max_len=16), target_ratio=0.3)
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3, gate_lr=1e-2))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.2, early_steps=2, late_steps=4, truncate_every=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randint(0, 1000, (4, 16), generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = F.cross_entropy(compiled(x), y)
        opt.zero_grad()
        (loss + ctl.penalty(loss)).backward()
        opt.step()
        ctl.step()
    return compiled, opt, ctl


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    compiled, opt, ctl = _trained_encoder()
    path = tmp_path_factory.mktemp("ckpt") / "enc.tnc"
    tncompile.save(compiled, path, optimizer=opt, controller=ctl, extra={"note": ("a", 1), "t": torch.ones(2)})
    return compiled, opt, ctl, path


def test_a_file_is_tensors_and_a_manifest_of_data(checkpoint):
    compiled, _, _, path = checkpoint
    manifest = _manifest(path)
    assert set(manifest) == MANIFEST_KEYS and manifest["version"] == 3 and manifest["mode"] == "graph"
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
    state = set(compiled.state_dict())
    assert state <= names and all(n.startswith("tncompile/") for n in names - state)  # training tensors
    rows = {row["path"]: row for row in manifest["layers"]}
    ff1 = compiled.tensorized_modules()["layers.0.ff1"]
    assert rows["layers.0.ff1"]["layout"]["ranks"] == list(ff1.layout.ranks)
    assert rows["layers.0.ff1"]["cores"] == [f"model.layers.0.ff1.cores.{k}" for k in range(len(ff1.cores))]
    text = json.dumps(manifest)
    for code_shaped in ("__import__", "__fn__", "__op__", "__module__", "__dataclass__", "in_spec", "nodes"):
        assert code_shaped not in text  # what format 2 held: no graph, no object state, no pytree specs


def test_graph_mode_round_trip_is_bit_for_bit_and_resumes(checkpoint):
    compiled, opt, ctl, path = checkpoint
    loaded = tncompile.load(path, model=lambda: small_encoder(max_len=16))
    assert {n: m.layout.ranks for n, m in loaded.tensorized_modules().items()} == \
        {n: m.layout.ranks for n, m in compiled.tensorized_modules().items()}
    for a, b in zip(compiled.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randint(0, 1000, (3, 16))
    compiled.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(compiled(x), loaded(x))
    compiled.train(), loaded.train()
    opt2 = torch.optim.AdamW(tncompile.param_groups(loaded, lr=1e-3, gate_lr=1e-2))
    ctl2 = tncompile.RankController(loaded, opt2, target_ratio=0.2, early_steps=2, late_steps=4, truncate_every=2)
    extra = tncompile.resume(loaded, opt2, ctl2)
    assert extra["note"] == ("a", 1) and torch.equal(extra["t"], torch.ones(2))
    assert ctl2.state_dict() == ctl.state_dict()
    for (p, q) in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert all(torch.equal(torch.as_tensor(p[k]), torch.as_tensor(q[k])) for k in p)


class Scale(tncompile.Pass):
    """A user's pass: doubles every LayerNorm's weight (a structure edit load must run again)."""
    name = "scale-norms"

    def run(self, program):
        with torch.no_grad():
            for m in program.graph_module.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.mul_(2.0)
        return program


def test_a_custom_pass_runs_where_the_users_pipeline_puts_it(tmp_path):
    """Issue 53: load takes the pipeline the user compiled with; the file's pass names only
    confirm it (a file cannot move the user's pass, or run it where they did not)."""
    torch.manual_seed(0)
    pipe = tncompile.default_pipeline().insert_after("tensorize", Scale())
    compiled = tncompile.compile(small_encoder(max_len=16), target_ratio=0.3, passes=pipe)
    path = tmp_path / "custom.tnc"
    tncompile.save(compiled, path)
    with pytest.raises(ModelMismatchError, match=r"the file ran \['scale-norms'\]"):
        tncompile.load(path, model=small_encoder(max_len=16))
    with pytest.raises(ModelMismatchError, match="never chooses it"):  # the pass alone: where would it run?
        tncompile.load(path, model=small_encoder(max_len=16), passes=[Scale()])
    loaded = tncompile.load(path, model=small_encoder(max_len=16), passes=pipe)
    assert [r.name for r in loaded.program.history] == [r.name for r in compiled.program.history]
    x = torch.randint(0, 1000, (2, 16))
    compiled.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(compiled(x), loaded(x))
    moved = tncompile.default_pipeline().insert_after("canonicalize", Scale())
    with pytest.raises(ModelMismatchError, match="compiled with the passes"):
        tncompile.load(path, model=small_encoder(max_len=16), passes=moved)


def test_a_file_moving_the_users_pass_is_refused(tmp_path):
    """The attack of issue 53: the file's pipeline puts the user's pass before tensorize."""
    import json
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from tncompile.serialization.container import digest
    torch.manual_seed(0)
    pipe = tncompile.default_pipeline().insert_after("tensorize", Scale())
    compiled = tncompile.compile(small_encoder(max_len=16), target_ratio=0.3, passes=pipe)
    tncompile.save(compiled, tmp_path / "custom.tnc")
    with safe_open(str(tmp_path / "custom.tnc"), framework="pt") as f:
        meta = dict(f.metadata())
    manifest = json.loads(meta["manifest"])
    names = manifest["pipeline"]
    names.remove("scale-norms")
    names.insert(0, "scale-norms")
    meta["manifest"] = json.dumps(manifest)
    tensors = load_file(tmp_path / "custom.tnc")
    meta["sha256"] = digest(tensors, meta["manifest"])
    save_file(tensors, tmp_path / "moved.tnc", metadata=meta)
    with pytest.raises(ModelMismatchError, match="never chooses it"):
        tncompile.load(tmp_path / "moved.tnc", model=small_encoder(max_len=16), passes=pipe)


_DECODER = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)


def _hf(family):
    torch.manual_seed(0)
    if family == "bert":
        cfg = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=32, num_labels=3)
        return transformers.BertForSequenceClassification(cfg)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=4,
                                                                    n_positions=64))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER))


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_swap_mode_round_trip_is_bit_for_bit(family, tmp_path):
    ids = torch.randint(1, 500, (2, 12))
    compiled = tncompile.compile(_hf(family), target_ratio=0.4, example_inputs={"input_ids": ids}, mode="swap")
    with torch.no_grad():
        for p in compiled.parameters():  # weights no fresh compile would have
            p.add_(0.01 * torch.randn_like(p))
    path = tmp_path / f"{family}.tnc"
    tncompile.save(compiled, path)
    fresh = _hf(family)
    loaded = tncompile.load(path, model=fresh)
    assert loaded is fresh and _manifest(path)["mode"] == "swap"
    mine, theirs = compiled.state_dict(), loaded.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    compiled.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_tied_parameters_stay_tied(tmp_path):
    ids = torch.randint(1, 500, (2, 12))
    compiled = tncompile.compile(_hf("gpt2"), target_ratio=0.4, example_inputs={"input_ids": ids}, mode="swap")
    tncompile.save(compiled, tmp_path / "tied.tnc")
    aliases = _manifest(tmp_path / "tied.tnc")["state"]["aliases"]
    assert aliases  # the head's shared tensors are stored once
    loaded = tncompile.load(tmp_path / "tied.tnc", model=_hf("gpt2"))
    assert loaded.lm_head.embedding is loaded.transformer.wte


@pytest.mark.parametrize("fixture,version", [("v2_small_encoder_ckpt.tnc", "'2'"), ("v1_small_encoder.tnc", "pickle")])
def test_older_formats_are_refused_naming_the_version(fixture, version):
    with pytest.raises(ModelFileError, match=version):
        tncompile.load(FIXTURES / fixture, model=small_encoder())


def test_damage_is_detected(checkpoint, tmp_path):
    *_, path = checkpoint
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)
    (tmp_path / "bad.tnc").write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="damaged"):
        tncompile.load(tmp_path / "bad.tnc", model=small_encoder(max_len=16))


def test_save_mode_follows_umask_and_syncs_file_and_directory(tmp_path, monkeypatch):
    """Like any file the user creates (not 0600), written durably: the file's data is
    fsynced before the rename and its directory entry after it."""
    compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.4)
    path = tmp_path / "m.tnc"
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


def test_save_refuses_what_is_not_data(tmp_path):
    compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.4)
    with pytest.raises(TypeError, match=r"cannot save the training state\['extra'\]\['f'\].*plain data only"):
        tncompile.save(compiled, tmp_path / "x.tnc", extra={"f": print})
