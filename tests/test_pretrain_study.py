"""Issue 66: the pretraining study's machinery at tiny sizes -- a run interrupted anywhere
continues to the very row an uninterrupted one gives (every variant), finished rows are
never rerun, a row or checkpoint of another run is refused, every initialization follows
the seed, the sweep widens its grid past a winning edge, evaluation covers every token."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
pytest.importorskip("transformers")
import bench_pretrain  # noqa: E402
import pretrain_loop  # noqa: E402
from pretrain_checkpoint import CheckpointError, load_run, save_run  # noqa: E402
from pretrain_loop import RunSpec, train_run  # noqa: E402
from pretrain_models import ModelShape, build  # noqa: E402

SHAPE = ModelShape(hidden=64, layers=1, ffn=128, heads=2, vocab=128, seq=16)


def stream(n: int, seed: int) -> torch.Tensor:
    """Tokens with structure to learn: every second token follows from the one before."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SHAPE.vocab, (n,), generator=g)
    ids[1::2] = (ids[0::2] * 7 + 3) % SHAPE.vocab
    return ids


@pytest.fixture(scope="module")
def corpus():
    return {"train": stream(3000, 0), "valid": stream(500, 1), "test": stream(600, 2)}


def spec(variant: str, steps: int = 20, seed: int = 0) -> RunSpec:
    return RunSpec(key=f"t-{variant}-s{seed}", variant=variant, lr=3e-3, seed=seed, steps=steps, batch=4,
                   shape=SHAPE, eval_points=4)


def galore_or_skip(variant: str) -> None:
    import importlib.util
    if variant == "galore" and importlib.util.find_spec("galore_torch") is None:
        pytest.skip("galore-torch is not installed (the test extra installs it)")


@pytest.mark.parametrize("variant", ["dense", "tt0.25", "lowrank0.25", "galore"])
def test_an_interrupted_run_continues_to_the_same_row(tmp_path, corpus, variant):
    galore_or_skip(variant)
    whole = train_run(spec(variant), corpus, tmp_path / "whole.ckpt")
    assert train_run(spec(variant), corpus, tmp_path / "cut.ckpt", stop_after=7) is None
    assert (tmp_path / "cut.ckpt").exists()
    resumed = train_run(spec(variant), corpus, tmp_path / "cut.ckpt")
    drop = ("wall_s_under_load",)
    for point in whole["curve"] + resumed["curve"]:
        point.pop("wall_s")
    assert {k: v for k, v in resumed.items() if k not in drop} == {k: v for k, v in whole.items() if k not in drop}
    assert whole["curve"][-1]["train_loss"] < whole["curve"][0]["train_loss"]     # it learned
    if variant == "tt0.25":
        assert whole["params_end"] < whole["params_start"]                        # the controller cut ranks


def test_a_checkpoint_of_another_run_or_a_damaged_one_is_refused(tmp_path, corpus):
    train_run(spec("dense"), corpus, tmp_path / "a.ckpt", stop_after=3)
    with pytest.raises(ValueError, match="continues run 't-dense-s0', not 't-dense-s1'"):
        train_run(spec("dense", seed=1), corpus, tmp_path / "a.ckpt")
    raw = (tmp_path / "a.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_run(tmp_path / "cut.ckpt", "dense", SHAPE, 3e-3, 20)
    wider = ModelShape(**{**SHAPE.as_dict(), "ffn": 256})
    with pytest.raises(CheckpointError, match="is missing or not"):
        load_run(tmp_path / "a.ckpt", "dense", wider, 3e-3, 20)
    with pytest.raises(CheckpointError, match="not a galore run"):
        load_run(tmp_path / "a.ckpt", "galore", SHAPE, 3e-3, 20)


def test_a_foreign_optimizer_state_is_refused_before_anything_changes(tmp_path):
    from safetensors.torch import load, save
    run = build("dense", SHAPE, 3e-3, 0, 10)
    x = torch.randint(0, SHAPE.vocab, (2, SHAPE.seq))
    pretrain_loop._step(run, x, x, 1.0)
    save_run(run, tmp_path / "a.ckpt", {"key": "k"})
    raw = (tmp_path / "a.ckpt").read_bytes()
    tensors = load(raw)
    meta = json.loads(json.loads(raw[8: 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]["run"])
    tensors["opt.0.exp_avg"] = torch.zeros(10 ** 4, 7)           # not a state of that parameter's shape
    (tmp_path / "b.ckpt").write_bytes(save(tensors, metadata={"run": json.dumps(meta)}))
    with pytest.raises(CheckpointError, match="cannot be the optimizer state"):
        load_run(tmp_path / "b.ckpt", "dense", SHAPE, 3e-3, 10)
    tensors = load(raw)
    tensors["opt.999.exp_avg"] = torch.zeros(3)
    (tmp_path / "c.ckpt").write_bytes(save(tensors, metadata={"run": json.dumps(meta)}))
    with pytest.raises(CheckpointError, match="not an optimizer state of one of"):
        load_run(tmp_path / "c.ckpt", "dense", SHAPE, 3e-3, 10)


@pytest.mark.parametrize("variant", ["dense", "tt0.25", "lowrank0.25"])
def test_the_seed_draws_every_initialization(variant):
    def values(seed):
        return [p.detach().clone() for p in build(variant, SHAPE, 1e-3, seed, 10).model.parameters()
                if p.dim() > 1 or p.numel() > SHAPE.hidden]
    a, b, c = values(0), values(0), values(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert sum(not torch.equal(x, z) for x, z in zip(a, c)) == len(a)


def test_compressed_variants_start_at_the_dense_models_loss():
    x = torch.randint(0, SHAPE.vocab, (4, SHAPE.seq))
    losses = {}
    for variant in ("dense", "tt0.25", "lowrank0.25"):
        model = build(variant, SHAPE, 1e-3, 0, 10).model
        with torch.no_grad():
            losses[variant] = model(input_ids=x, labels=x).loss.item()
    assert all(abs(v - math.log(SHAPE.vocab)) < 0.1 for v in losses.values()), losses


def test_every_variant_of_a_seed_sees_the_same_batches_and_each_epoch_every_window(corpus):
    n_windows = (corpus["train"].numel() - 1) // SHAPE.seq
    per_epoch = n_windows // 4
    seen = torch.cat([pretrain_loop.batch_windows(s, n_windows, 4, seed=0) for s in range(per_epoch)])
    assert seen.unique().numel() == seen.numel() == per_epoch * 4
    x0, _ = pretrain_loop.train_batch(corpus["train"], 5, 4, SHAPE.seq, seed=0, device="cpu")
    x1, _ = pretrain_loop.train_batch(corpus["train"], 5, 4, SHAPE.seq, seed=0, device="cpu")
    x2, _ = pretrain_loop.train_batch(corpus["train"], 5, 4, SHAPE.seq, seed=1, device="cpu")
    assert torch.equal(x0, x1) and not torch.equal(x0, x2)
    second = pretrain_loop.batch_windows(per_epoch, n_windows, 4, seed=0)   # epoch 2: another order
    assert not torch.equal(second, pretrain_loop.batch_windows(0, n_windows, 4, seed=0))


def test_evaluation_predicts_every_token_but_the_first_once():
    ids = torch.arange(1000)
    pieces = pretrain_loop.windows(ids, 64)
    targets = torch.cat([w[1:] for w in pieces])
    assert torch.equal(targets, ids[1:])

    class Uniform(torch.nn.Module):
        def forward(self, input_ids):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 50)})()
    assert pretrain_loop.evaluate(Uniform(), torch.randint(0, 50, (777,)), 64, "cpu") == pytest.approx(math.log(50))


def make_study(tmp_path, corpus, **kw) -> bench_pretrain.Study:
    return bench_pretrain.Study(corpus, SHAPE, batch=4, epochs=1.0, run_dir=tmp_path / "run", corpus_id="tiny",
                                eval_points=2, log=lambda *a: None, **kw)


def test_finished_rows_are_read_back_never_rerun(tmp_path, corpus, monkeypatch):
    study = make_study(tmp_path, corpus)
    row = study.run(study.spec("sweep", "dense", 3e-3, 0))
    monkeypatch.setattr(bench_pretrain, "train_run", lambda *a, **k: pytest.fail("a finished row ran again"))
    again = make_study(tmp_path, corpus)                  # a new process: rows come from the folder
    assert again.run(again.spec("sweep", "dense", 3e-3, 0)) == json.loads(json.dumps(row))
    other = bench_pretrain.Study(corpus, SHAPE, batch=2, epochs=1.0, run_dir=tmp_path / "run", corpus_id="tiny",
                                 eval_points=2)
    with pytest.raises(ValueError, match="another protocol"):
        other.run(other.spec("sweep", "dense", 3e-3, 0))
    path = study.row_path(study.spec("sweep", "dense", 3e-3, 0).key)
    path.write_text(path.read_text()[:-20])
    with pytest.raises(ValueError, match="not a readable row"):
        make_study(tmp_path, corpus).finished(path.stem)


def test_the_sweep_widens_its_grid_past_a_winning_edge(tmp_path, corpus, monkeypatch):
    study = make_study(tmp_path, corpus)
    asked = []

    def fake(spec):
        asked.append(spec.lr)
        return {"valid_loss": abs(math.log(spec.lr / 2.4e-2))}   # best at 2.4e-2, past the grid's top
    monkeypatch.setattr(study, "run", fake)
    assert study.sweep("dense") == pytest.approx(2.4e-2)
    assert sorted(set(asked)) == pytest.approx([1.5e-3, 3e-3, 6e-3, 1.2e-2, 2.4e-2])
    asked.clear()
    monkeypatch.setattr(study, "run", lambda spec: asked.append(spec.lr) or {"valid_loss": abs(math.log(spec.lr / 3e-3))})
    assert study.sweep("dense") == pytest.approx(3e-3) and sorted(set(asked)) == pytest.approx([1.5e-3, 3e-3, 6e-3])


def test_tt_wall_time_follows_its_parameter_count():
    timings = [{"variant": "tt0.1", "params": 1000, "step_s": 2.0}, {"variant": "tt0.1", "params": 500, "step_s": 1.0}]
    curve = [{"step": 10, "params": 1000}, {"step": 20, "params": 500}, {"step": 30, "params": 500}]
    walls = bench_pretrain.wall_axis("tt0.1", curve, timings)
    assert walls == pytest.approx([20.0, 20.0 + 10 * 1.5, 20.0 + 15 + 10 * 1.0])
    assert bench_pretrain.wall_axis("dense", curve, timings) is None


def test_the_command_runs_the_whole_protocol_on_a_tiny_corpus(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    text = "".join(f"# <<< file: Lib/m{i}.py >>>\n" + "".join(f"def f{j % 5}(x):\n    return x * {j}\n"
                                                          for j in range(40)) for i in range(6))
    for name in ("train-00.txt", "valid.txt", "test.txt"):
        (data / name).write_text(text)
    shape = json.dumps({**SHAPE.as_dict(), "vocab": 300, "seq": 32})
    command = [sys.executable, str(BENCH / "bench_pretrain.py"), "--data", str(data), "--vocab", "300",
               "--shape", shape, "--batch", "4", "--epochs", "1", "--variants", "dense", "--run-dir",
               str(tmp_path / "run"), "--results", str(tmp_path / "results"), "--phases", "sweep,full,report"]
    env = {**__import__("os").environ, "TNCOMPILE_PRETRAIN_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "results" / "pretrain.json").read_text())
    assert [row["variant"] for row in report["summary"]] == ["dense"] and report["summary"][0]["seeds"] == 3
    assert set(report["count_baselines_test_ppl"]) >= {"trigram", "bigram", "unigram"}
    assert (tmp_path / "results" / "pretrain.png").stat().st_size > 10_000
    assert "dense against the count trigram on test" in out.stdout


def test_masking_follows_berts_rule_and_the_seed():
    from pretrain_loop import IGNORE, mask_tokens
    from pretrain_models import MASK_ID
    rows = torch.randint(2, 500, (64, 256), generator=torch.Generator().manual_seed(0))
    inputs, labels = mask_tokens(rows, torch.Generator().manual_seed(1), 500)
    chosen = labels != IGNORE
    assert 0.13 < chosen.float().mean() < 0.17
    assert torch.equal(labels[chosen], rows[chosen]) and torch.equal(inputs[~chosen], rows[~chosen])
    masked = (inputs[chosen] == MASK_ID).float().mean()
    kept = (inputs[chosen] == rows[chosen]).float().mean()
    assert 0.77 < masked < 0.83 and 0.08 < kept < 0.13          # 10% kept, plus random draws equal by chance
    again, _ = mask_tokens(rows, torch.Generator().manual_seed(1), 500)
    assert torch.equal(again, inputs)


@pytest.mark.parametrize("variant", ["dense", "tt0.2364"])
def test_a_masked_lm_run_learns_and_resumes_exactly(tmp_path, corpus, variant):
    masked = RunSpec(key=f"m-{variant}", variant=variant, lr=3e-3, seed=0, steps=16, batch=4,
                     shape=ModelShape(hidden=64, layers=1, ffn=256, heads=2, vocab=128, seq=16), eval_points=2,
                     objective="mlm")
    whole = train_run(masked, corpus, tmp_path / "whole.ckpt")
    assert train_run(masked, corpus, tmp_path / "cut.ckpt", stop_after=5) is None
    resumed = train_run(masked, corpus, tmp_path / "cut.ckpt")
    for key in ("valid_loss", "test_loss", "valid_accuracy", "test_accuracy", "params_end"):
        assert resumed[key] == whole[key], key
    assert 0.0 <= whole["test_accuracy"] <= 1.0 and math.isfinite(whole["test_loss"])
    assert type(build(variant, masked.shape, 1e-3, 0, 10, objective="mlm").model).__name__ == "RobertaForMaskedLM"


def test_ablations_run_at_their_bases_best_rate_over_the_sweeps_horizon(tmp_path, corpus, monkeypatch):
    asked = []

    def fake_train(spec, *a, **k):
        asked.append((spec.key, spec.variant, spec.lr, spec.seed, spec.steps))
        loss = abs(math.log(spec.lr / 3e-3)) + (1.0 if "+" in spec.variant else 0.5)
        return {"key": spec.key, "valid_loss": loss, "test_loss": loss, "curve": [], "diverged": False,
                "params_end": 1}
    monkeypatch.setattr(bench_pretrain, "train_run", fake_train)
    study = make_study(tmp_path, corpus)
    study.sweep("tt0.25")
    entries = study.ablations(bases=("tt0.25", "tt0.1"))          # tt0.1 has no sweep: left out
    assert [e["base"] for e in entries] == ["tt0.25"] and entries[0]["lr"] == pytest.approx(3e-3)
    ablated = [a for a in asked if a[0].startswith("ablation-")]
    assert {a[1] for a in ablated} == {"tt0.25+torchinit", "tt0.25+direct", "tt0.25+dense-embedding"}
    assert all(a[2] == pytest.approx(3e-3) and a[3] == 0 and a[4] == study.sweep_steps for a in ablated)
    assert set(entries[0]["valid_ppl"]) == {"tt0.25", "tt0.25+torchinit", "tt0.25+direct", "tt0.25+dense-embedding"}
    trained = len(asked)
    assert make_study(tmp_path, corpus).ablations(bases=("tt0.25", "tt0.1"), train=False) == entries
    assert len(asked) == trained                                   # the report only reads them
    (tmp_path / "run" / "rows" / "ablation-tt0.25+direct-lr3.00e-03-s0.json").unlink()
    assert make_study(tmp_path, corpus).ablations(train=False) == [] and len(asked) == trained


def test_the_ablated_variants_are_what_they_name():
    x = torch.randint(0, SHAPE.vocab, (4, SHAPE.seq))
    base, torch_init, direct = (build(v, SHAPE, 1e-3, 0, 10) for v in ("tt0.25", "tt0.25+torchinit", "tt0.25+direct"))
    with torch.no_grad():
        losses = [r.model(input_ids=x, labels=x).loss.item() for r in (base, torch_init, direct)]
    assert losses[1] > 2 * losses[0] and abs(losses[2] - losses[0]) < 0.1   # a std-1 tied table: huge logits
    assert direct.controller is None and base.controller is not None
    dense = build("dense", SHAPE, 1e-3, 0, 10)
    assert direct.params() <= 0.25 * dense.params() < base.params()
    # the table dense (tied to the head), the linears at 0.25 of theirs, no rank adaptation
    kept = build("tt0.25+dense-embedding", SHAPE, 1e-3, 0, 10)
    model = kept.model
    table = model.get_input_embeddings()
    assert type(table) is torch.nn.Embedding and model.get_output_embeddings().weight is table.weight
    linears = sum(p.numel() for n, p in dense.model.named_parameters() if "layers." in n and p.dim() == 2)
    compressed = kept.params() - table.weight.numel() - (dense.params() - table.weight.numel() - linears)
    assert kept.controller is None and 0 < compressed <= 0.25 * linears
