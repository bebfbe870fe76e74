"""Format-2 files written by tncompile before the graph-format tables (commit df6cdc5) still load,
without trust=True, and compute what they computed then (fixtures: tests/fixtures/make_v2_fixtures.py)."""
import json
from pathlib import Path

import pytest
import torch

import tncompile

FIXTURES = Path(__file__).parent / "fixtures"


def _expected(name: str) -> tuple[dict, dict]:
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    return {k: torch.tensor(v) for k, v in meta["inputs"].items()}, meta


def _check(out: torch.Tensor, meta: dict) -> None:
    assert torch.allclose(out[..., :32], torch.tensor(meta["output"]), atol=1e-5, rtol=1e-5)
    assert abs(float(out.double().sum()) - meta["output_sum"]) <= 1e-4 * max(1.0, abs(meta["output_sum"]))


def test_checkpoint_of_a_traced_encoder_loads_and_resumes():
    inputs, meta = _expected("v2_small_encoder_ckpt")
    model = tncompile.load(FIXTURES / "v2_small_encoder_ckpt.tnc").eval()
    with torch.no_grad():
        _check(model(inputs["ids"]), meta)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = tncompile.RankController(model, opt, target_ratio=0.2)
    extra = tncompile.resume(model, opt, ctl)
    assert extra["epoch"] == 1 and extra["note"] == "fixture"
    assert all(len(s) > 0 for s in opt.state.values()) and len(opt.state) == len(list(model.parameters()))


def test_embedding_bags_load():
    inputs, meta = _expected("v2_bags")
    model = tncompile.load(FIXTURES / "v2_bags.tnc").eval()
    with torch.no_grad():
        _check(model(inputs["users"], inputs["items"]), meta)


@pytest.mark.parametrize("name", ["v2_hf_bert", "v2_hf_gpt2"])
def test_exported_hf_models_load(name):
    pytest.importorskip("transformers")
    inputs, meta = _expected(name)
    model = tncompile.load(FIXTURES / f"{name}.tnc").eval()
    kwargs = {"use_cache": False} if "gpt2" in name else {}
    with torch.no_grad():
        _check(model(input_ids=inputs["input_ids"], **kwargs).logits, meta)
