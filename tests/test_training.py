"""fit(), History, checkpoints: atomic saves and bit-identical resume across a truncation."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tncompile
from tncompile.testing import small_encoder

HERE = Path(__file__).parent


def _data(n=6, batch=8):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(1, 1000, (batch, 16), generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(n)]


def _setup(**ctl_kwargs):
    compiled = tncompile.compile(small_encoder(), target_ratio=0.2, init="random")
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=2e-3, gate_lr=5e-2))
    settings = dict(target_ratio=0.05, threshold=0.95, rank_weight=1.0, truncate_every=5)
    settings.update(ctl_kwargs)
    return compiled, opt, tncompile.RankController(compiled, opt, **settings)


def test_fit_runs_both_stages_and_records_history(tmp_path):
    compiled, opt, ctl = _setup()
    data = _data()

    def accuracy(model):
        x, y = data[0]
        assert not model.training
        return (model(x).argmax(-1) == y).float().mean()

    history = tncompile.fit(compiled, data, torch.nn.functional.cross_entropy, opt, ctl,
                            early_steps=10, late_steps=10, eval_fn=accuracy, log_every=5, progress=False)
    assert history.step == list(range(1, 21)) and len(history) == 20
    assert history.stage[:9] == ["early"] * 9 and history.stage[-1] == "late"
    assert [e["step"] for e in history.events if e["kind"] == "late_stage"] == [10]
    cuts = [e for e in history.events if e["kind"] == "truncation"]
    assert cuts and all(e["step"] % 5 == 0 for e in cuts)
    assert history.ratio[-1] == pytest.approx(compiled.ratio) and history.ratio[-1] < history.ratio[0]
    assert [s for s, _ in history.evals] == [10, 20] and 0 <= history.evals[-1][1]["eval"] <= 1
    assert history.ranks[0][0] == 0 and set(history.ranks[0][1]) == set(ctl.layers) | set(
        k for k in history.ranks[0][1] if k not in ctl.layers)
    assert compiled.training
    png = tmp_path / "ranks.png"
    history.plot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history.save_json(tmp_path / "h.json")
    assert json.loads((tmp_path / "h.json").read_text())["step"][-1] == 20


def test_rank_plot_names_every_layer_and_line():
    """Legends beside the panels: every layer's colour (past 3 and past 12), the
    stage-switch and truncation lines; the step-time median fits a short run."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    history = tncompile.History()
    layers = [f"layers.{i}.ff1" for i in range(14)]
    for step in range(1, 25):
        history.record(step, 1.0 / step, 1.0 / step, 0.1, 10.0 + step % 3, "early" if step < 12 else "late")
    history.ranks = [(0, {n: [8, 8] for n in layers}), (12, {n: [4, 8] for n in layers})]
    history.events = [{"step": 12, "kind": "late_stage"}, {"step": 18, "kind": "truncation"}]
    fig = history.figure()
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    assert set(layers) <= set(labels)
    assert "late stage begins" in labels and "ranks cut" in labels
    assert "rolling median (3 steps)" in labels


def test_fit_rejects_bad_batches_and_mismatched_controller():
    compiled, opt, ctl = _setup()
    with pytest.raises(ValueError, match="pair"):
        tncompile.fit(compiled, [torch.zeros(2, 16, dtype=torch.long)], torch.nn.functional.cross_entropy,
                      opt, ctl, early_steps=1, late_steps=0, progress=False)
    other, other_opt, _ = _setup()
    with pytest.raises(ValueError, match="different model"):
        tncompile.fit(other, _data(), torch.nn.functional.cross_entropy, other_opt, ctl,
                      early_steps=1, late_steps=0, progress=False)
    with pytest.raises(ValueError, match="late_steps"):
        tncompile.fit(compiled, _data(), torch.nn.functional.cross_entropy, opt, ctl,
                      early_steps=1, late_steps=-1, progress=False)


def test_resume_in_a_fresh_process_is_bit_identical_across_truncation(tmp_path):
    ckpt = tmp_path / "run.tnc"
    full, resumed = tmp_path / "full.json", tmp_path / "resumed.json"
    for mode, out in (("full", full), ("resume", resumed)):
        subprocess.run([sys.executable, str(HERE / "resume_run.py"), mode, str(ckpt), str(out)],
                       check=True, timeout=300)
    a, b = json.loads(full.read_text()), json.loads(resumed.read_text())
    assert a["steps"] == b["steps"] == list(range(1, 12))
    assert a["ran"] == 11 and b["ran"] == 5  # the resumed process computed steps 7..11 itself
    truncations = [e["step"] for e in a["events"] if e["kind"] == "truncation"]
    assert any(s <= 6 for s in truncations) and any(s > 6 for s in truncations)  # cuts on both sides
    assert [e["step"] for e in a["events"] if e["kind"] == "late_stage"] == [5]
    assert b["losses"] == a["losses"]   # float.hex: bit for bit
    assert b["events"] == a["events"] and b["ranks"] == a["ranks"]


@pytest.mark.slow
@pytest.mark.parametrize("ways", ["deterministic", "prior"])
def test_resume_is_bit_identical_beside_a_cpu_hog_when_ways_follow_a_fixed_rule(ways, tmp_path):
    """Issue 65 item 7: under ``torch.use_deterministic_algorithms(True)`` (or with
    ``tuning.MEASURE_WAYS = False``) no way is chosen by timing, so a resumed process
    continues bit for bit however loaded the machine is: here a process spinning on every
    core runs beside the resumed one."""
    ckpt = tmp_path / "run.tnc"
    full, resumed = tmp_path / "full.json", tmp_path / "resumed.json"
    env = {**os.environ, "RESUME_RUN_WAYS": ways}
    subprocess.run([sys.executable, str(HERE / "resume_run.py"), "full", str(ckpt), str(full)], check=True,
                   timeout=300, env=env)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        subprocess.run([sys.executable, str(HERE / "resume_run.py"), "resume", str(ckpt), str(resumed)], check=True,
                       timeout=600, env=env)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    a, b = json.loads(full.read_text()), json.loads(resumed.read_text())
    assert b["ran"] == 5 and b["losses"] == a["losses"] and b["ranks"] == a["ranks"]


def test_checkpoint_carries_truncated_shapes_and_save_is_atomic(tmp_path, monkeypatch):
    compiled, opt, ctl = _setup(truncate_every=0)
    with torch.no_grad():
        for mod in ctl.layers.values():
            for g in mod.gates:
                g[1::2] = 0.0
    ctl.truncate()
    path = tmp_path / "m.tnc"
    tncompile.save(compiled, path, optimizer=opt, controller=ctl)
    loaded = tncompile.load(path, model=small_encoder())
    assert loaded.ratio == pytest.approx(compiled.ratio)
    x = _data(1)[0][0]
    compiled.eval(), loaded.eval()
    assert torch.equal(loaded(x), compiled(x))
    # a crash while writing leaves the previous checkpoint intact
    before = path.read_bytes()

    def crash(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tncompile.serialization.container, "raw_bytes", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        tncompile.save(compiled, path, optimizer=opt, controller=ctl)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.tnc"]


def test_resume_errors_are_clear(tmp_path):
    compiled, opt, ctl = _setup()
    path = tmp_path / "plain.tnc"
    tncompile.save(compiled, path, rng=False)
    loaded = tncompile.load(path, model=small_encoder())
    with pytest.raises(ValueError, match="no training state"):
        tncompile.resume(loaded, torch.optim.AdamW(tncompile.param_groups(loaded, lr=1e-3)))
    tncompile.save(compiled, path, optimizer=opt, controller=ctl)
    loaded = tncompile.load(path, model=small_encoder())
    with pytest.raises(ValueError, match="optimizer is AdamW"):
        tncompile.resume(loaded, torch.optim.SGD(tncompile.param_groups(loaded, lr=1e-3)))
    with pytest.raises(ValueError, match="parameter groups differ"):
        tncompile.resume(loaded, torch.optim.AdamW(loaded.parameters(), lr=1e-3))


def _nan_batch_run(nonfinite: str):
    """fit over 6 float batches, the 4th holding a NaN input."""
    from tncompile.testing import mlp
    torch.manual_seed(0)
    compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3, init="random")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.2, truncate_every=0, nonfinite=nonfinite)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(6)]
    data[3][0][2, 5] = float("nan")
    snapshots = []

    class Recording(list):
        def __iter__(self):
            for batch in super().__iter__():
                snapshots.append({k: v.detach().clone() for k, v in compiled.state_dict().items()})
                yield batch

    history = None
    error = None
    try:
        history = tncompile.fit(compiled, Recording(data), torch.nn.functional.cross_entropy, opt, ctl,
                                early_steps=6, late_steps=0, progress=False)
    except FloatingPointError as e:
        error = e
    return compiled, opt, snapshots, history, error


def test_a_nan_batch_is_skipped_on_the_device_not_applied():
    """nonfinite="skip": the NaN batch's optimizer step is left undone (parameters and Adam's
    state as before it), training goes on, and History names the step."""
    compiled, opt, snapshots, history, error = _nan_batch_run("skip")
    assert error is None and history.skipped == [4]
    after_nan = snapshots[4]  # the state before step 5 = after the skipped step 4
    for k, v in snapshots[3].items():
        assert torch.equal(after_nan[k], v), f"{k} changed in the skipped step"
    assert all(torch.isfinite(p).all() for p in compiled.parameters())
    assert all(torch.isfinite(t).all() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert any(not torch.equal(snapshots[5][k], v) for k, v in snapshots[4].items()), "training stopped"


def test_a_nan_batch_raises_before_any_parameter_changes():
    compiled, opt, snapshots, history, error = _nan_batch_run("raise")
    assert isinstance(error, FloatingPointError) and "non-finite" in str(error)
    now = compiled.state_dict()
    for k, v in snapshots[3].items():  # as before the NaN batch's step
        assert torch.equal(now[k], v), f"{k} changed before the error"
