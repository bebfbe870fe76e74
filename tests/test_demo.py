"""The demo's data helpers and one compiled training step on real SST-2 rows."""
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tncompile
from tncompile.testing import small_encoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
demo = pytest.importorskip("demo")


def test_generated_task_is_consistent_and_noisy():
    ids, labels = demo.generated_task(300, seed=3, noise=0.0)
    for seq, label in zip(ids, labels):
        counts = [seq.count(m) for m in (1000, 2000, 3000)]
        assert counts[label] >= 2 and counts[label] == max(counts)
    noisy_ids, noisy = demo.generated_task(300, seed=3, noise=0.3)
    assert noisy_ids == ids  # the same sequences, some labels redrawn
    flipped = sum(a != b for a, b in zip(labels, noisy)) / len(labels)
    assert 0.1 < flipped < 0.3  # about 0.3 * 2/3 of them
    x, y = demo.collate(ids[:4], labels[:4])
    assert x.shape[0] == 4 and x.shape[1] == max(len(s) for s in ids[:4]) and y.tolist() == labels[:4]


def test_demo_quick_run_shows_report_speed_accuracy_plot_and_next_step(tmp_path):
    pytest.importorskip("matplotlib")
    import json
    import subprocess
    script = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
    run = subprocess.run([sys.executable, str(script), "--quick", "--data", "none", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    smaller = re.search(r"total: .* \((\d+\.\d)x smaller\)", out)          # the report
    assert smaller and 44.9 <= float(smaller.group(1)) <= 44.9 / 0.9       # target_ratio's contract
    assert "x faster" in out and "dense" in out                              # the step against dense
    assert "| step | dense | compressed |" in out and "5. next:" in out
    assert "is within the noise" in out or "is beyond the noise" in out     # accuracy with its band
    assert "rank adaptation: ratio" in out and "the same outputs" in out    # ranks cut; saved and loaded
    assert "s of CPU time" in out
    result = json.loads((tmp_path / "demo.json").read_text())
    assert result["accuracy"][-1]["step"] == 60 and 0 <= result["accuracy"][-1]["compressed"] <= 1
    assert len(result["step_seconds"]["dense"]) == 3 and result["ratio"] <= 0.11
    assert result["ratio_after_adaptation"] < result["ratio"] and result["loaded_same_outputs"]
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"


def test_sst2_rows_tokenize_and_train_one_step(data_dir):
    pytest.importorskip("tokenizers")
    ids, labels = demo.load_sst2(data_dir / "sst2", "dev", max_rows=16)
    assert ids[0][:3] == [101, 2009, 1005] and ids[0][-1] == 102  # "[CLS] it ' ..." ... [SEP]
    assert set(labels) <= {0, 1}
    model = tncompile.compile(small_encoder(vocab_size=30522, max_len=128), target_ratio=0.05, init="random")
    x, y = demo.collate(ids, labels)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)


def test_sst2_example_quick_run(data_dir, tmp_path):
    """examples/sst2.py end to end on 500 rows: three phases, table, JSON and PNG."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("matplotlib")
    import json
    import subprocess
    script = Path(__file__).resolve().parents[1] / "examples" / "sst2.py"
    run = subprocess.run([sys.executable, str(script), "--quick", "--data", str(data_dir / "sst2"),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "sst2-quick.json").read_text())
    models = [r["model"] for r in result["rows"]]
    assert models == ["dense", "compiled, early stage", "compiled, late stage"]
    assert result["rows"][1]["ratio"] <= 0.05 and all(0 <= r["dev_acc"] <= 1 for r in result["rows"])
    assert (tmp_path / "sst2-quick_ranks.png").read_bytes()[:4] == b"\x89PNG"
    assert "| compiled, late stage |" in run.stdout


def test_minilm_batches_grouped_by_length_keep_every_sentence_and_drop_the_padding(data_dir):
    """examples/minilm.batches(group_by_length=True), which bench_pretrained distills on: the same
    sentences (each once), far less padding than batches in file order, seeded."""
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("minilm")
    tok = transformers.BertTokenizerFast(vocab=str(data_dir / "bert-base-uncased" / "vocab.txt"))  # transformers 5
    sentences = [line.split("\t")[0] for line in
                 (data_dir / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:2001]]

    def rows(batch_list):
        return sorted(tuple(ids[mask.bool()].tolist()) for b in batch_list
                      for ids, mask in zip(b["input_ids"], b["attention_mask"]))

    def real_share(batch_list):
        return sum(int(b["attention_mask"].sum()) for b in batch_list) / sum(b["input_ids"].numel()
                                                                             for b in batch_list)
    plain = minilm.batches(tok, sentences, 32)
    grouped = minilm.batches(tok, sentences, 32, group_by_length=True)
    assert len(grouped) == len(plain) == 63 and rows(grouped) == rows(plain)
    assert real_share(grouped) > 0.9 > 0.5 > real_share(plain)
    again = minilm.batches(tok, sentences, 32, group_by_length=True)
    other = minilm.batches(tok, sentences, 32, group_by_length=True, seed=1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(grouped, again))
    assert any(a["input_ids"].shape != b["input_ids"].shape or not torch.equal(a["input_ids"], b["input_ids"])
               for a, b in zip(grouped, other))
