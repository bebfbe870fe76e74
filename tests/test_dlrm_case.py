"""Issue 67: the DLRM a recommender user writes (per-table ``indices`` / ``offsets`` lists,
per-sample weights, ``nn.EmbeddingBag`` tables) compiles without hand edits, trains, saves
and loads; Criteo's raw rows are read and hashed into each field's buckets."""
from __future__ import annotations

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
