"""Issue 67: the DLRM a recommender user writes (per-table ``indices`` / ``offsets`` lists,
per-sample weights, ``nn.EmbeddingBag`` tables) compiles without hand edits, trains, saves
and loads; Criteo's raw rows are read and hashed into each field's buckets."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tncompile  # noqa: E402
from dlrm_model import DLRM, CriteoRows, batch_inputs, bucket, read_criteo  # noqa: E402
from tncompile.runtime.layers.embedding_bag import TTMEmbeddingBag  # noqa: E402


def criteo_line(label: int, counts: list, cats: list) -> str:
    return "\t".join([str(label), *("" if c is None else str(c) for c in counts), *cats]) + "\n"


def test_criteo_rows_are_read_transformed_and_hashed(tmp_path):
    path = tmp_path / "train.txt"
    counts = [1, None, 5, -1, 0, 1382, 4, 15, 2, 181, 1, 2, None]
    cats = [f"{i:08x}" for i in range(25)] + [""]
    path.write_text(criteo_line(0, counts, cats) + criteo_line(1, counts, cats))
    rows = read_criteo(path, buckets=1000)
    assert rows.dense.shape == (2, 13) and rows.sparse.shape == (2, 26) and rows.labels.tolist() == [0.0, 1.0]
    assert rows.dense[0, 0].item() == pytest.approx(math.log(2)) and rows.dense[0, 1] == 0 and rows.dense[0, 3] == 0
    assert torch.equal(rows.sparse[0], rows.sparse[1]) and int(rows.sparse.max()) < 1000
    assert rows.sparse[0, 0].item() == bucket("00000000", 0, 1000) and rows.sparse[0, 25].item() == bucket("", 25, 1000)
    path.write_text(criteo_line(2, counts, cats))
    with pytest.raises(ValueError, match="train.txt:1: not a Criteo row"):
        read_criteo(path, buckets=1000)
    path.write_text(criteo_line(1, ["x"] + counts[1:], cats))
    with pytest.raises(ValueError, match="an integer field is not an integer"):
        read_criteo(path, buckets=1000)


def test_the_hash_spreads_one_value_over_fields_and_stays_put():
    ids = {bucket("68fd1e64", field, 10 ** 6) for field in range(26)}
    assert len(ids) == 26                                    # the same value, other fields: other rows
    assert bucket("68fd1e64", 3, 10 ** 6) == bucket("68fd1e64", 3, 10 ** 6)


def synthetic(n: int, tables: int, rows: int, seed: int = 0) -> CriteoRows:
    g = torch.Generator().manual_seed(seed)
    sparse = torch.randint(0, rows, (n, tables), generator=g)
    dense = torch.rand(n, 13, generator=g)
    labels = ((sparse[:, 0] % 2) ^ (dense[:, 0] > 0.5).long()).float()   # learnable from a table and a count
    return CriteoRows(dense, sparse, labels)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return DLRM(13, [1000] * 3, dim=16, bottom=(64,), top=(64,))


def test_dlrm_compiles_with_offsets_and_weights_and_every_table_is_a_bag_network(model):
    inputs = batch_inputs(synthetic(32, 3, 1000), weights=True)
    compiled = tncompile.compile(model, target_ratio=0.1, example_inputs=inputs)
    assert compiled.ratio <= 0.1
    tables = [m for m in compiled.modules() if isinstance(m, TTMEmbeddingBag)]
    assert len(tables) == 3
    report = str(compiled.report())
    assert all(f"tables.{k}" in report for k in range(3)) and "TTM" in report and "lookup" in report
    out = compiled(*inputs)
    assert out.shape == (32,) and torch.isfinite(out).all()


def test_at_full_rank_the_compiled_dlrm_is_the_dense_one(model):
    from full_rank import compile_full_rank
    model = model.double()
    dense, indices, offsets, weights = batch_inputs(synthetic(16, 3, 1000), weights=True)
    inputs = (dense.double(), indices, offsets, [w.double() for w in weights])
    compiled = compile_full_rank(model, inputs)
    assert sum(isinstance(m, TTMEmbeddingBag) for m in compiled.modules()) == 3
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-9, atol=1e-9)


def test_the_compressed_dlrm_learns_saves_and_loads(model, tmp_path):
    data = synthetic(512, 3, 1000)
    # traced with per-sample weights, called with them (an fx trace keeps the traced structure)
    compiled = tncompile.compile(model, target_ratio=0.1, example_inputs=batch_inputs(data.take(torch.arange(32)),
                                                                                      weights=True))
    opt = torch.optim.Adagrad(compiled.parameters(), lr=0.05)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    for epoch in range(6):
        for start in range(0, 512, 64):
            batch = data.take(torch.arange(start, start + 64))
            loss = loss_fn(compiled(*batch_inputs(batch, weights=True)), batch.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8 - 0.05
    tncompile.save(compiled, tmp_path / "dlrm.tnc")
    loaded = tncompile.load(tmp_path / "dlrm.tnc", model=DLRM(13, [1000] * 3, dim=16, bottom=(64,), top=(64,)))
    inputs = batch_inputs(data.take(torch.arange(8)), weights=True)
    with torch.no_grad():
        assert torch.allclose(loaded(*inputs), compiled(*inputs), atol=1e-6)


def test_an_argument_the_example_leaves_out_is_traced_as_its_none_default(model):
    """``if per_sample_weights is not None:`` -- traced on a proxy it would always index the
    weights; traced with the example's structure, the model runs without them."""
    data = synthetic(16, 3, 1000)
    compiled = tncompile.compile(model, target_ratio=0.1, example_inputs=batch_inputs(data))
    out = compiled(*batch_inputs(data))
    assert out.shape == (16,) and torch.isfinite(out).all()
    with pytest.raises(AssertionError, match="per_sample_weights has been specialized to have value None"):
        compiled(*batch_inputs(data, weights=True))


# ---------------------------------------------------------------- the benchmark's parts
def test_repeated_lines_are_left_out_when_asked(tmp_path):
    """The shared Criteo sample is its first 900 lines twelve times over: split as it is,
    every test row is a training row."""
    counts = [1] * 13
    lines = [criteo_line(k % 2, counts, [f"{k:08x}"] * 26) for k in range(3)]
    path = tmp_path / "train.txt"
    path.write_text("".join(lines * 4))
    assert len(read_criteo(path, buckets=100)) == 12
    distinct = read_criteo(path, buckets=100, distinct=True)
    assert len(distinct) == 3 and distinct.labels.tolist() == [0.0, 1.0, 0.0]


def test_auc_is_the_share_of_positive_negative_pairs_ranked_right():
    from recsys_metrics import base_rate_log_loss, log_loss, roc_auc
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (60,), generator=g).double()     # many ties
    labels = (torch.rand(60, generator=g) < 0.4).double()
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    assert roc_auc(scores, labels) == pytest.approx(pairs.mean().item(), abs=1e-12)
    assert math.isnan(roc_auc(scores, torch.zeros(60)))
    rate = labels.mean().item()
    assert base_rate_log_loss(labels, labels) == pytest.approx(-(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)))
    assert log_loss(torch.zeros(4), torch.tensor([0.0, 1, 0, 1])) == pytest.approx(math.log(2))


def test_movielens_rows_are_read_with_their_features(tmp_path):
    from movielens_data import read_movielens, table_sizes
    (tmp_path / "u.user").write_text("1|24|M|technician|85711\n2|53|F|other|94043\n")
    (tmp_path / "u.occupation").write_text("other\ntechnician\n")
    genres = "|".join(["0"] * 18 + ["1"])
    (tmp_path / "u.item").write_text(f"1|A (1995)|01-Jan-1995||url|{genres}\n2|B (1995)|01-Jan-1995||url|{genres}\n")
    (tmp_path / "u1.base").write_text("1\t2\t5\t881250949\n2\t1\t3\t891717742\n")
    (tmp_path / "u1.test").write_text("2\t2\t4\t891717742\n")
    train, test = read_movielens(tmp_path)
    assert table_sizes(tmp_path) == [2, 2, 2]
    assert train.sparse.tolist() == [[0, 1, 1], [1, 0, 0]] and train.labels.tolist() == [5.0, 3.0]
    assert train.dense.shape == (2, 21) and train.dense[1, :2].tolist() == pytest.approx([0.53, 1.0]) and train.dense[0, -1] == 1
    assert test.labels.tolist() == [4.0]
    (tmp_path / "u1.test").write_text("3\t2\t4\t891717742\n")
    with pytest.raises(ValueError, match="u1.test:1: not a rating of a known user"):
        read_movielens(tmp_path)


@pytest.fixture
def tiny_case():
    import bench_dlrm
    data = synthetic(160, 26, 4096, seed=1)
    return bench_dlrm.Case("criteo", data.take(torch.arange(96)), data.take(torch.arange(96, 128)),
                           data.take(torch.arange(128, 160)), dense_features=13, table_rows=(4096,) * 26, dim=16,
                           bottom=(32, 16), top=(32,), batch=32, epoch_grid=(1,), ratio=0.05, regression=False)


@pytest.mark.parametrize("variant", ["dense-sgd", "dense-adagrad", "tt", "tt-tables"])
def test_every_variant_trains_with_its_optimizer_and_is_scored(tiny_case, variant):
    import bench_dlrm
    row = bench_dlrm.quality_run(tiny_case, variant, 0.03, epochs=1, seed=0)
    assert all(math.isfinite(row[split]["log_loss"]) and 0 <= row[split]["auc"] <= 1 for split in ("valid", "test"))
    dense_params = sum(p.numel() for p in tiny_case.model(0, True).parameters())
    if variant.startswith("tt"):      # compiled at 1.5x the target, cut to it by the schedule
        assert row["params_end"] < row["params_start"] and row["params_end"] <= 0.05 * dense_params * 1.001
        assert len(row["tables"]) == 26 and all(t["format"] == "TTM" and t["ran_as"] for t in row["tables"])
    else:
        assert row["params_end"] == row["params_start"] == dense_params
    again = bench_dlrm.quality_run(tiny_case, variant, 0.03, epochs=1, seed=0)
    assert again["test"] == row["test"]                              # a seed is the whole run
    other = bench_dlrm.quality_run(tiny_case, variant, 0.03, epochs=1, seed=1)
    assert other["test"] != row["test"]


def test_the_dense_tables_gradients_stay_sparse_and_are_counted(tiny_case):
    import bench_dlrm
    trainee = bench_dlrm.build(tiny_case, "dense-sgd", 0.03, 0)
    bench_dlrm.train_step(tiny_case, trainee, tiny_case.train.take(torch.arange(32)), 0.0)
    trainee.model(*batch_inputs(tiny_case.train.take(torch.arange(32)))).sum().backward()
    table = trainee.model.tables[0].weight
    assert table.grad.is_sparse
    params = sum(p.numel() * 4 for p in trainee.model.parameters())
    grads_dense = sum(p.grad.numel() * 4 for p in trainee.model.parameters() if not p.grad.is_sparse)
    counted = bench_dlrm.state_bytes(trainee.model, trainee.optimizer)
    assert params + grads_dense < counted < params + grads_dense + 26 * 32 * (16 * 4 + 8) + 1


def test_finished_rows_are_read_not_rerun_and_another_protocol_is_refused(tiny_case, tmp_path):
    import bench_dlrm
    rows = bench_dlrm.Rows(tmp_path / "rows", tiny_case.protocol)
    calls = []

    def make():
        calls.append(1)
        return bench_dlrm.quality_run(tiny_case, "dense-sgd", 0.03, 1, 0)
    key = bench_dlrm.row_key(tiny_case, "dense-sgd", 0.03, 1, 0)
    first = rows.run(key, make)
    again = bench_dlrm.Rows(tmp_path / "rows", tiny_case.protocol).run(key, make)
    assert calls == [1] and again == json.loads(json.dumps(first))
    assert bench_dlrm.swept_choice(tiny_case, "dense-sgd", bench_dlrm.Rows(tmp_path / "rows", tiny_case.protocol)) \
        == (0.03, 1)
    other = bench_dlrm.Rows(tmp_path / "rows", tiny_case.protocol | {"batch": 64})
    with pytest.raises(ValueError, match="another protocol"):
        other.get(key)
    (tmp_path / "rows" / f"{key}.json").write_text("[1]")
    with pytest.raises(ValueError, match="another protocol"):
        bench_dlrm.Rows(tmp_path / "rows", tiny_case.protocol).get(key)


def test_the_sweep_widens_past_a_winning_edge(tiny_case, tmp_path, monkeypatch):
    import bench_dlrm
    scores = {0.01: 0.5, 0.03: 0.4, 0.1: 0.3, 0.3: 0.35}       # 0.1 wins at the edge, then 0.3 loses

    def fake(case, variant, lr, epochs, seed):
        return {"variant": variant, "lr": lr, "epochs": epochs, "valid": {"log_loss": scores[round(lr, 6)]},
                "test": {"log_loss": 0.0}}
    monkeypatch.setattr(bench_dlrm, "quality_run", fake)
    rows = bench_dlrm.Rows(tmp_path / "rows", tiny_case.protocol)
    assert bench_dlrm.sweep(tiny_case, "tt", rows, log=lambda _: None) == (0.1, 1)
    assert sorted(r["lr"] for r in bench_dlrm.sweep_rows(tiny_case, "tt", rows)) == pytest.approx([0.01, 0.03, 0.1, 0.3])


def test_memory_and_step_time_are_measured_from_the_start_of_training(tiny_case):
    import bench_dlrm
    dense = bench_dlrm.measure_one(tiny_case, "dense-adagrad", "", batch=32, lr=0.03, warmup=1, reps=2)
    tt = bench_dlrm.measure_one(tiny_case, "tt", "end", batch=32, lr=0.03, warmup=1, reps=2, profile=True)
    assert dense["step_ms"] > 0 and tt["step_ms"] > 0
    table_bytes = 26 * 4096 * 16 * 4
    assert dense["held_at_start_mb"] * 2**20 >= 2 * table_bytes         # the tables and Adagrad's sums
    assert tt["held_at_start_mb"] * 2**20 < 0.2 * table_bytes
    assert dense["peak_rss_mb"] >= dense["train_mb"] > 0 and tt["train_mb"] > 0
    assert tt["params"] <= 0.05 * dense["params"] * 1.001
    ops = {row["op"]: row for row in tt["profile"]}             # what the step's time goes to
    assert "profile" not in dense and len(ops) >= 5 and all(r["self_ms_per_step"] >= 0 for r in ops.values())
    assert any(op.startswith(("aten::", "tncompile::", "Optimizer")) for op in ops)


def test_the_fused_variant_is_tt_with_fused_adagrad_and_the_same_update(tiny_case):
    """``tt-fused`` (measured only) is ``tt``'s model with ``Adagrad(fused=True)``: one step
    from the same seed and batch lands on the same parameters up to rounding."""
    import bench_dlrm
    plain = bench_dlrm.build(tiny_case, "tt", 0.03, 0, ranks="end")
    fused = bench_dlrm.build(tiny_case, "tt-fused", 0.03, 0, ranks="end")
    assert all(g.get("fused") for g in fused.optimizer.param_groups)
    assert not any(g.get("fused") for g in plain.optimizer.param_groups)
    batch = tiny_case.train.take(torch.arange(32))
    for trainee in (plain, fused):
        bench_dlrm.train_step(tiny_case, trainee, batch, 0.0)
    for (name, a), (_, b) in zip(plain.model.named_parameters(), fused.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
