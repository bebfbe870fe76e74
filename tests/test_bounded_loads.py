"""Issue 53: what a crafted file can make loading cost, and what it can change.

Each attack edits and reseals a genuine file (or writes the bytes by hand) and checks that
loading refuses it with a ``ModelFileError`` within seconds and a bounded amount of memory
-- measured in a subprocess by its peak resident memory, under a wall-clock timeout -- or
loads exactly the user's structure. The security page (docs/security.md) states the bounds.
"""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tncompile
from tncompile import ModelFileError
from tncompile.serialization.tensor_file import MAX_HEADER_BYTES, MAX_TENSORS, open_tensor_file
from tncompile.testing import mlp, small_encoder

from test_file_attacks import _parts, _reseal, base  # noqa: F401 -- base is a fixture; _reseal edits and reseals


def _dense():
    return mlp((64, 128, 64, 10))


@pytest.fixture(scope="module")
def checkpoint(base):
    """test_file_attacks' checkpoint: a graph-mode model with optimizer, controller and extra."""
    return base[0]


@pytest.fixture(scope="module")
def encoder_file(tmp_path_factory):
    torch.manual_seed(0)
    compiled = tncompile.compile(small_encoder(max_len=512), target_ratio=0.3,
                                 example_inputs=(torch.randint(1, 1000, (2, 16)),))
    path = tmp_path_factory.mktemp("encoder") / "enc.tnc"
    tncompile.save(compiled, path)
    return path


def _run_bounded(code: str, timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line. Adds the growth of the
    peak resident memory over what the interpreter had before the code's ``LOAD`` part."""
    script = textwrap.dedent("""
        import json, resource, sys, time
        import torch, tncompile, tncompile.testing
        def peak_mb():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    """) + textwrap.dedent(code)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _refusal_report(path: Path, model: str, extra: str = "") -> str:
    """Code loading ``path`` onto ``model`` (an expression), reporting time, memory growth
    and the refusal (or None)."""
    return f"""
        {extra}
        model = {model}
        before, start = peak_mb(), time.time()
        try:
            tncompile.load({str(path)!r}, model=model)
            refused = None
        except tncompile.ModelFileError as e:
            refused = str(e)
        print(json.dumps({{"seconds": time.time() - start, "grew_mb": peak_mb() - before, "refused": refused}}))
    """


# ----------------------------------------------------------------- work a file sizes
def test_an_empty_example_input_with_a_huge_dimension_is_refused(checkpoint, tmp_path):
    """(0, 2**31) has no elements, but tracing would run arange(2**31): each dimension is bounded."""
    bad = _reseal(checkpoint, tmp_path / "bad.tnc", lambda m, t: (
        t.update({"tncompile/example.0": torch.zeros(0, 2**31)}),
        m.update(example_inputs={"$tuple": [{"$tuple": [{"$tensor": "tncompile/example.0"}]}, {}]})))
    report = _run_bounded(_refusal_report(bad, "tncompile.testing.mlp((64, 128, 64, 10))"))
    assert report["refused"] and "pass example_inputs=" in report["refused"], report
    assert report["seconds"] < 5 and report["grew_mb"] < 200, report


def test_example_inputs_at_the_bound_are_traced_on_fake_tensors(encoder_file, tmp_path):
    """(128, 512) token ids: a real trace of the attention would allocate gigabytes; the file's
    inputs are traced on fake tensors, so the model loads in a few hundred MB at most."""
    ids = torch.randint(1, 1000, (128, 512))
    big = _reseal(encoder_file, tmp_path / "big.tnc", lambda m, t: t.update({"tncompile/example.0": ids}))
    report = _run_bounded(_refusal_report(big, "tncompile.testing.small_encoder(max_len=512)"))
    assert report["refused"] is None, report
    assert report["grew_mb"] < 400 and report["seconds"] < 30, report
    loaded = tncompile.load(big, model=small_encoder(max_len=512))
    assert torch.equal(loaded.program.example_inputs[0][0], ids)  # the file's inputs kept, as data


def test_loading_plans_nothing_whatever_the_files_batch_sizes_and_cores(tmp_path):
    """Many cores and 31 batch buckets would make an eager load search for a minute: a file's
    layouts and batch sizes size no search; every bucket is planned on its first use."""
    torch.manual_seed(0)
    model = mlp((256, 256, 10))
    compiled = tncompile.compile(model, target_ratio=0.3, prefer="size", linear_cores=6,
                                 batch_sizes=[2**k for k in range(31)])
    tncompile.save(compiled, tmp_path / "many.tnc")
    start = time.time()
    loaded = tncompile.load(tmp_path / "many.tnc", model=mlp((256, 256, 10)))
    assert time.time() - start < 10
    layers = loaded.tensorized_modules()
    assert layers and all(not m.plans for m in layers.values())
    x = torch.randn(8, 256)
    compiled.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), compiled(x))
    assert all(m.plans for m in layers.values())  # planned on first use


def test_planning_a_large_network_starts_no_process_and_leaves_pythons_random():
    """Over 12 tensors cotengra's hyper-optimizer plans: in this process (its 'labels' method
    starts a pool of workers whatever parallel=False says) and with Python's random put back."""
    psutil = pytest.importorskip("psutil")
    from tncompile.formats.layout import TTLayout
    from tncompile.planning.contraction import plan_contraction
    from tncompile.formats.indices import planner_problem
    layout = TTLayout.for_shape(256, 256, 8).with_ranks(4)
    inputs, output, sizes = planner_problem(layout, False)
    assert len(inputs) > 12
    state = random.getstate()
    first = plan_contraction(inputs, output, {**sizes, "b": 64}, batch="b")
    assert random.getstate() == state
    assert not psutil.Process().children(recursive=True)
    again = plan_contraction(inputs, output, {**sizes, "b": 64}, batch="b")
    assert again.order() == first.order()  # seeded: reproducible


def test_a_header_of_many_empty_tensors_is_refused_before_it_is_parsed(tmp_path):
    """A header listing hundreds of thousands of empty tensors: refused by its length or its
    count of entries, before JSON parsing builds an object per entry."""
    for count, name in ((MAX_TENSORS + 1, "counted.tnc"), (600_000, "long.tnc")):
        entries = ",".join(f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(count))
        header = ('{"__metadata__":{"format":"tncompile","version":"3"},' + entries + "}").encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(header)) + header)
        report = _run_bounded(_refusal_report(tmp_path / name, "tncompile.testing.mlp((64, 128, 64, 10))"))
        assert report["refused"] and ("tensors" in report["refused"] or "header of" in report["refused"]), report
        assert report["seconds"] < 3 and report["grew_mb"] < 100, report
    assert len(header) > MAX_HEADER_BYTES


def _sparse_file(path: Path, manifest: dict, tensors: dict[str, tuple[str, list[int]]], seal: bool) -> Path:
    """A file declaring ``tensors`` (name -> dtype, shape) whose data are a hole (sparse)."""
    entries, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = (torch.Size(shape).numel()) * {"F32": 4, "U8": 1, "I64": 8}[dtype]
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    meta = {"format": "tncompile", "version": "3", "manifest": json.dumps(manifest), "sha256": "0" * 64}

    def write(meta):
        header = json.dumps({"__metadata__": meta, **entries}).encode()
        header += b" " * (-len(header) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            f.truncate(8 + len(header) + offset)
    write(meta)
    if seal:
        with open_tensor_file(path) as f:
            meta["sha256"] = f.digest(meta["manifest"])
        write(meta)
    return path


def test_a_sparse_gigabyte_file_costs_no_memory_before_it_is_refused(checkpoint, tmp_path):
    """A 1 GiB tensor that is a hole in the file: one the manifest does not name is refused
    from the header alone; one it names as the model's weight is refused by the rebuilt
    model's shapes before a byte of it is read."""
    meta, manifest, tensors = _parts(checkpoint)
    specs = {name: ({torch.float32: "F32", torch.uint8: "U8", torch.int64: "I64"}[t.dtype], list(t.shape))
             for name, t in tensors.items()}
    unnamed = _sparse_file(tmp_path / "unnamed.tnc", manifest, {**specs, "huge": ("F32", [2**28])}, seal=True)
    dense_weight = next(n for n in manifest["state"]["names"] if n.endswith("bias"))
    claimed = _sparse_file(tmp_path / "claimed.tnc", manifest, {**specs, dense_weight: ("F32", [2**28])}, seal=True)
    for path, says in ((unnamed, "in no part of the manifest"), (claimed, "in the file")):
        report = _run_bounded(_refusal_report(path, "tncompile.testing.mlp((64, 128, 64, 10))"))
        assert report["refused"] and says in report["refused"], report
        assert report["grew_mb"] < 200 and report["seconds"] < 3, report  # refused before it is hashed


def test_a_fifo_as_the_model_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.tnc"
    os.mkfifo(fifo)
    report = _run_bounded(_refusal_report(fifo, "tncompile.testing.mlp((64, 128, 64, 10))"), timeout=60)
    assert report["refused"] and "not a regular file" in report["refused"], report


def test_a_file_that_cannot_be_read_is_a_model_file_error(tmp_path):
    (tmp_path / "mem.tnc").symlink_to("/proc/self/mem")
    with pytest.raises(ModelFileError):
        tncompile.load(tmp_path / "mem.tnc", model=_dense())


# ----------------------------------------------------------------- structure from the user's model
def _first_step_counter(manifest) -> dict:
    return manifest["training"]["optimizer"]["state"]["state"]


def _point(entry: int, key: str, at) -> callable:
    """An edit pointing parameter ``entry``'s optimizer state ``key`` at the tensor ``at(manifest)``
    names (the tensor it named dropped, so only the pointing is wrong)."""
    def edit(m, t):
        items = _first_step_counter(m)["$items"]
        t.pop(items[entry][1][key]["$tensor"])
        items[entry][1][key] = at(m)
    return edit


@pytest.mark.parametrize("name,edit,says", [
    # two parameters sharing one step counter: every number genuine, another run resumed
    ("shared", _point(1, "step", lambda m: _first_step_counter(m)["$items"][0][1]["step"]), "named twice"),
    ("aliased", _point(0, "exp_avg", lambda m: {"$tensor": m["state"]["names"][0]}), "not one of tncompile/training"),
])
def test_optimizer_state_shares_no_tensor(checkpoint, tmp_path, name, edit, says):
    bad = _reseal(checkpoint, tmp_path / f"{name}.tnc", edit)
    with pytest.raises(ModelFileError, match=says):
        tncompile.load(bad, model=_dense())


def test_a_moment_of_another_shape_is_refused_at_resume(checkpoint, tmp_path):
    def edit(m, t):
        name = _first_step_counter(m)["$items"][0][1]["exp_avg"]["$tensor"]
        t[name] = t[name].reshape(-1)[:3].clone()
    bad = _reseal(checkpoint, tmp_path / "reshaped.tnc", edit)
    loaded = tncompile.load(bad, model=_dense())
    opt = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    with pytest.raises(ModelFileError, match="the parameter"):
        tncompile.resume(loaded, opt, restore_rng=False)


@pytest.mark.parametrize("field,value", [("steps_done", float("inf")), ("early_steps", 1e300),
                                         ("version", "3")])
def test_a_controller_field_out_of_type_is_a_model_file_error(checkpoint, tmp_path, field, value):
    bad = _reseal(checkpoint, tmp_path / "ctl.tnc", lambda m, t: m["training"]["controller"].update({field: value}))
    loaded = tncompile.load(bad, model=_dense())
    opt = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    ctl = tncompile.RankController(loaded, opt, target_ratio=0.3)
    with pytest.raises(ModelFileError, match=field):
        tncompile.resume(loaded, None, ctl, restore_rng=False)


def test_a_random_state_no_generator_takes_is_refused(checkpoint, tmp_path):
    def edit(m, t):
        name = m["training"]["rng"]["cpu"]["$tensor"]
        t[name] = torch.zeros_like(t[name])  # the right size, not a Mersenne twister state
    bad = _reseal(checkpoint, tmp_path / "rng.tnc", edit)
    with pytest.raises(ModelFileError, match="random state"):
        tncompile.load(bad, model=_dense())


# ----------------------------------------------------------------- global state
def test_no_load_path_changes_the_callers_global_state(checkpoint, tmp_path):
    import numpy as np
    dense = _dense()

    def state():
        return (torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy(),
                torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads())

    def same(a, b):
        return torch.equal(a[0], b[0]) and a[1] == b[1] and (a[2] == b[2]).all() and a[3:] == b[3:]
    before = state()
    loaded = tncompile.load(checkpoint, model=dense)
    assert same(before, state())
    opt = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    tncompile.resume(loaded, opt, restore_rng=False)
    assert same(before, state())
    with torch.no_grad():
        loaded = tncompile.load(checkpoint, model=_dense())
        assert not torch.is_grad_enabled()
