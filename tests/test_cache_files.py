"""Issue 65 items 1 and 2: caches and folders tncompile writes are inputs too.

Every file tncompile writes beside the user's own goes through ``tncompile.files``:
atomically, never through a planted link; cache folders are the user's alone; cache reads
take regular files of bounded size only (a FIFO never blocks). A way read from a cache file
or a checkpoint is a hint, taken only where it is a candidate here, and a checkpoint's ways
never reach the disk cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import tncompile
from tncompile import tuning
from tncompile.planning import speed_model
from tncompile.runtime import TTLinear
from tncompile.runtime.ways import measured
from tncompile.files import UnsafeFolderError, private_folder, read_bounded, write_replacing
from tncompile.testing import mlp


# ----------------------------------------------------------------- the primitives
def test_an_atomic_write_replaces_a_planted_link_and_never_writes_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "cache.json"
    target.symlink_to(victim)
    write_replacing(target, "{}")
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_text() == "{}"
    assert oct(os.stat(target).st_mode & 0o777) == oct(0o600)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_bounded_read_refuses_fifos_links_and_large_files_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        read_bounded(fifo, 100)                      # would block forever with a plain open()
    (tmp_path / "real").write_text("x" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        read_bounded(tmp_path / "link", 100)
    with pytest.raises(OSError, match="larger than 5 bytes"):
        read_bounded(tmp_path / "real", 5)
    assert read_bounded(tmp_path / "real", 10) == b"x" * 10


def test_a_cache_folder_is_made_private_and_one_others_may_write_is_refused(tmp_path):
    made = private_folder(tmp_path / "a" / "cache")
    assert oct(os.stat(made).st_mode & 0o777) == oct(0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeFolderError, match="may be written by others"):
        private_folder(shared)


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to make another user's folder")
def test_a_cache_folder_another_user_owns_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(UnsafeFolderError, match="belongs to another user"):
        private_folder(theirs)


# ----------------------------------------------------------------- the device-speed cache
def _measure_speed_into(folder, monkeypatch):
    monkeypatch.setattr(tuning, "DEVICE_SPEED", None)
    monkeypatch.delenv("TNCOMPILE_DEVICE_SPEED")
    monkeypatch.setenv("TNCOMPILE_CACHE_DIR", str(folder))
    monkeypatch.setattr(speed_model, "_measured", {})
    monkeypatch.setattr(speed_model, "_looked_up", set())
    monkeypatch.setattr(speed_model, "measure_device_speed", lambda d: speed_model.REFERENCE)
    return speed_model.device_speed("cpu")


def test_the_device_speed_cache_writes_through_no_planted_link(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in ("device_speed.json", "device_speed.lock", f"device_speed.{os.getpid()}.tmp"):
        (folder / name).symlink_to(victim)          # every path the old writer wrote or opened
    assert _measure_speed_into(folder, monkeypatch) == speed_model.REFERENCE
    assert victim.read_text() == "precious"
    assert not (folder / "device_speed.json").is_symlink()
    assert json.loads((folder / "device_speed.json").read_text())


def test_a_fifo_at_the_device_speed_cache_does_not_block_compile(tmp_path):
    """A FIFO planted at ``$TNCOMPILE_CACHE_DIR/device_speed.json``: a default compile (no
    speed override) in a fresh process finishes instead of blocking on the open."""
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    os.mkfifo(folder / "device_speed.json")
    code = textwrap.dedent("""
        import torch, warnings, tncompile
        from tncompile.testing import mlp
        warnings.simplefilter("ignore")
        c = tncompile.compile(mlp((64, 256, 256, 10)), target_ratio=0.3)
        print("compiled", c.ratio < 0.35)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TNCOMPILE_DEVICE_SPEED"}
    env["TNCOMPILE_CACHE_DIR"] = str(folder)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiled True" in out.stdout


def test_a_device_speed_cache_folder_others_may_write_is_not_used(tmp_path, monkeypatch):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.warns(UserWarning, match="not caching the device speed.*may be written by others"):
        _measure_speed_into(folder, monkeypatch)
    assert not (folder / "device_speed.json").exists()


# ----------------------------------------------------------------- the measured-ways cache
@pytest.fixture
def fresh_ways(monkeypatch):
    measured.forget()
    measured._WARNED.clear()
    yield
    measured.forget()
    measured._WARNED.clear()


def _trained_once(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tncompile.compile(mlp((32, 64, 64, 8)), target_ratio=0.5)
    model(x).sum().backward()
    return model


def test_the_ways_cache_writes_through_no_planted_link(tmp_path, monkeypatch, fresh_ways):
    folder = tmp_path / "ways"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(tuning, "WAY_CACHE_DIR", str(folder))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    measured.cache_file().symlink_to(victim)
    with pytest.warns(UserWarning, match="ignoring the measured-ways cache"):   # the link is not read either
        _trained_once(torch.randn(200, 32))
    assert victim.read_text() == "precious"
    assert not measured.cache_file().is_symlink() and json.loads(measured.cache_file().read_text())["winners"]


@pytest.mark.parametrize("poison", ["whole table", "native chain"])
def test_a_cached_way_that_is_no_candidate_here_is_ignored_and_measured_afresh(poison, tmp_path, monkeypatch,
                                                                              fresh_ways):
    """``"whole table"`` (a lookup's way) for a TT linear, or ``"native chain"`` while native
    kernels are off: the first step used to raise; now the entry is dropped with one warning."""
    x = torch.randn(200, 32)
    folder = tmp_path / "ways"
    monkeypatch.setattr(tuning, "WAY_CACHE_DIR", str(folder))
    _trained_once(x)                                              # a real cache file
    path = measured.cache_file()
    data = json.loads(path.read_text())
    data["winners"] = {key: poison for key in data["winners"]}
    path.write_text(json.dumps(data))
    measured.forget()
    from tncompile.runtime.native import native_kernels
    with native_kernels(poison != "native chain"), pytest.warns(UserWarning, match="not one of its candidates") as got:
        model = _trained_once(x)
    assert len([w for w in got if "not one of its candidates" in str(w.message)]) == 1
    assert all(m.ran_as != poison for m in model.modules() if isinstance(m, TTLinear))
    assert measured.stats()["measured"] > 0


def test_a_checkpoints_ways_never_reach_the_disk_cache(tmp_path, monkeypatch, fresh_ways):
    x = torch.randn(200, 32)
    model = _trained_once(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = measured.snapshot()
    assert saved
    tncompile.save(model, tmp_path / "ckpt.tnc", optimizer=opt)
    measured.forget()
    folder = tmp_path / "ways"
    monkeypatch.setattr(tuning, "WAY_CACHE_DIR", str(folder))
    loaded = tncompile.load(tmp_path / "ckpt.tnc", model=mlp((32, 64, 64, 8)))
    tncompile.resume(loaded, torch.optim.SGD(loaded.parameters(), lr=0.1))
    assert measured.snapshot() == saved                           # the resumed run takes the saved ways
    other = _trained_once(torch.randn(300, 48)[:, :32])           # a new shape is measured and cached
    written = json.loads(measured.cache_file().read_text())["winners"]
    assert written and not set(written) & set(saved), "a checkpoint's ways were written to the disk cache"
    del other


# ----------------------------------------------------------------- save_pretrained's folder
def test_save_pretrained_replaces_planted_links_instead_of_writing_through_them(tmp_path):
    """``folder/config.json`` (and ``generation_config.json``) planted as links: transformers'
    own writer would follow them; tncompile's files are written atomically over the links."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=200, n_embd=32, n_layer=1, n_head=2, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tncompile.compile(transformers.GPT2LMHeadModel(cfg), 0.5, example_inputs={"input_ids": ids},
                                  mode="swap").eval()
    folder = tmp_path / "out"
    folder.mkdir()
    victims = {}
    for name in ("config.json", "generation_config.json"):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text("precious")
        (folder / name).symlink_to(victims[name])
    model.save_pretrained(folder)
    for name, victim in victims.items():
        assert victim.read_text() == "precious", name
        assert not (folder / name).is_symlink() and json.loads((folder / name).read_text()), name
    again = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_model_files_replace_planted_links(tmp_path):
    """``tncompile.save`` and ``save_pretrained``'s ``model.safetensors``: a link planted at
    the target is replaced by the new file, its target untouched."""
    transformers = pytest.importorskip("transformers")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tncompile.compile(mlp((64, 256, 256, 10)), 0.3)
    (tmp_path / "m.tnc").symlink_to(victim)
    tncompile.save(model, tmp_path / "m.tnc")
    assert victim.read_text() == "precious" and not (tmp_path / "m.tnc").is_symlink()
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32)
    torch.manual_seed(0)
    ids = torch.randint(0, 120, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = tncompile.compile(transformers.BertModel(cfg), 0.5, example_inputs={"input_ids": ids}, mode="swap")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(victim)
    bert.save_pretrained(folder)
    assert victim.read_text() == "precious" and not (folder / "model.safetensors").is_symlink()
