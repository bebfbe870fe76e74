"""Pass infrastructure: pipeline editing, registry, user passes visible in dumps."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tncompile
from tncompile.passes import get_pass, registered_passes
from tncompile.testing import mlp, small_encoder

ROOT = Path(__file__).resolve().parents[1]


def test_default_pipeline_is_named_and_editable():
    pipe = tncompile.default_pipeline()
    assert pipe.names == ["canonicalize", "follow_device", "tensorize", "assign_ranks", "decompose",
                          "plan_contractions", "fuse_feed_forward", "lower_dropout", "fuse_attention",
                          "fuse_siblings", "measure_ways"]

    class A(tncompile.Pass):
        name = "a"

        def run(self, program):
            return program

    pipe.insert_before("assign-ranks", A()).insert_after("decompose", "tensorize")
    assert pipe.names == ["canonicalize", "follow_device", "tensorize", "a", "assign_ranks", "decompose", "tensorize",
                          "plan_contractions", "fuse_feed_forward", "lower_dropout", "fuse_attention",
                          "fuse_siblings", "measure_ways"]
    pipe.remove("a").replace("decompose", get_pass("decompose")).remove("plan-contractions")
    pipe.remove("fuse-feed-forward").remove("lower_dropout").remove("fuse-attention").remove("fuse_siblings")
    pipe.remove("measure-ways")
    assert pipe.names == ["canonicalize", "follow_device", "tensorize", "assign_ranks", "decompose", "tensorize"]
    with pytest.raises(ValueError, match="no pass named 'nope'"):
        pipe.remove("nope")
    assert tncompile.default_pipeline().names == ["canonicalize", "follow_device", "tensorize", "assign_ranks",
                                                  "decompose", "plan_contractions", "fuse_feed_forward",
                                                  "lower_dropout", "fuse_attention", "fuse_siblings",
                                                  "measure_ways"]


def test_register_pass_function_and_duplicate():
    @tncompile.register_pass(name="test-noop", overwrite=True)
    def noop(program):
        return None

    assert "test_noop" in registered_passes()
    c = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3,
                          passes=["tensorize", "test-noop", "assign_ranks", "decompose"])
    assert [r.name for r in c.program.history] == ["tensorize", "test-noop", "assign_ranks", "decompose"]
    assert c(torch.randn(3, 64)).shape == (3, 10)  # unplanned buckets are planned on first use
    with pytest.raises(ValueError, match="already registered"):
        tncompile.register_pass(noop, name="test-noop")


def test_pass_returning_garbage_is_named():
    class Bad(tncompile.Pass):
        name = "bad"

        def run(self, program):
            return 42

    with pytest.raises(tncompile.PassError, match="pass 'bad' failed.*must return a Program"):
        tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3,
                          passes=tncompile.default_pipeline().insert_after("tensorize", Bad()))


class ScaleOutput(tncompile.Pass):
    """A user's fx rewrite: multiply the model output by 2."""

    name = "scale-output"

    def run(self, program):
        graph = program.graph
        out = next(n for n in graph.nodes if n.op == "output")
        value = out.args[0]
        with graph.inserting_before(out):
            doubled = graph.call_function(torch.mul, (value, 2.0))
        out.args = (doubled,)
        return program


def test_user_fx_rewrite_runs_and_shows_in_next_dump(tmp_path):
    model = mlp((64, 128, 10))
    pipe = tncompile.default_pipeline().insert_after("decompose", ScaleOutput())
    c = tncompile.compile(model, target_ratio=0.3, passes=pipe, dump_dir=tmp_path)
    plain = tncompile.compile(model, target_ratio=0.3)
    x = torch.randn(3, 64)
    assert torch.allclose(c(x), 2 * plain(x), atol=1e-6)
    assert "torch.mul" not in (tmp_path / "05-decompose.txt").read_text()
    assert "torch.mul" in (tmp_path / "06-scale-output.txt").read_text()


def test_custom_pass_example_keeps_odd_blocks_dense(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from custom_pass import EveryOtherBlock
    finally:
        sys.path.pop(0)
    pipe = tncompile.default_pipeline().insert_after("tensorize", EveryOtherBlock())
    c = tncompile.compile(small_encoder(n_layers=4), target_ratio=0.5, passes=pipe, dump_dir=tmp_path)
    tn = c.tensorized_modules()
    assert "layers.0.ff1" in tn and "layers.2.ff1" in tn
    assert not any(n.startswith(("layers.1.", "layers.3.")) for n in tn)
    assert c.ratio <= 0.5
    before = (tmp_path / "03-tensorize.txt").read_text()
    after = (tmp_path / "04-every-other-block.txt").read_text()
    line = lambda text: next(l for l in text.splitlines() if l.startswith("%layers_1_ff1 ="))
    assert "pending TT" in line(before)
    assert "kept dense by every-other-block" in line(after)


def test_cli_inspect(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tncompile", "inspect", "tncompile.testing:small_encoder",
                        "--target-ratio", "0.2", "--dump-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "total:" in r.stdout and "# tncompile program" in r.stdout
    assert (tmp_path / "05-decompose.txt").exists()
    code = subprocess.run([sys.executable, "-m", "tncompile", "inspect", "tncompile.testing:mlp",
                           "--target-ratio", "0.3", "--batch-sizes", "1", "64", "--code"],
                          capture_output=True, text=True, timeout=300)
    assert code.returncode == 0, code.stderr
    assert "rows <= 1," in code.stdout and "rows <= 64," in code.stdout
    assert "def forward(ops, bias, mm):" in code.stdout
    bad = subprocess.run([sys.executable, "-m", "tncompile", "inspect", "tncompile.testing:mlp",
                          "--target-ratio", "0.000001"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "smallest possible ratio" in bad.stderr
    worse = subprocess.run([sys.executable, "-m", "tncompile", "inspect", "nomodule"],
                           capture_output=True, text=True, timeout=300)
    assert worse.returncode != 0
