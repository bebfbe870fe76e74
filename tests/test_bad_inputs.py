"""A hostile user's table: each bad input or fault raises a clear error whose
message names the argument (or layer, or file) and the fix, and the user's
model is left exactly as it was.

Each row: an id, what to do with the shared :class:`Env`, the exception type
and a regex its message must match. Add a row for every new error path.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.testing import mlp


class EmbedThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.lin = nn.Linear(64, 256)

    def forward(self, ids):
        return self.lin(self.emb(ids))


class DataDependent(nn.Module):
    """fx cannot trace it (branch on a value); torch.export cannot either."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else -self.lin(x)


class ShapeBranch(nn.Module):
    """fx cannot branch on a shape; torch.export can (it guards on it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x) if x.shape[-1] == 64 else x


@dataclass
class Env:
    tmp: Path
    model: nn.Module           # the user's model: must never change
    compiled: Any              # tncompile.compile(model, 0.3)
    embedded: Any              # an embedding model, compiled
    exported: Any              # compiled through torch.export

    def fresh(self):
        """A compiled model, its optimizer and a controller, built anew."""
        compiled = tncompile.compile(self.model, target_ratio=0.3)
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
        return compiled, opt, tncompile.RankController(compiled, opt, target_ratio=0.2)

    def swapped(self):
        """A swap-mode result: the user's class with its layers replaced."""
        return tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3, mode="swap", example_inputs=(torch.randn(2, 64),))

    def saved(self) -> Path:
        path = self.tmp / "good.tnc"
        if not path.exists():
            tncompile.save(self.compiled, path)
        return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    torch.manual_seed(0)
    model = mlp((64, 128, 10))
    return Env(tmp=tmp_path_factory.mktemp("bad"), model=model,
               compiled=tncompile.compile(model, target_ratio=0.3),
               embedded=tncompile.compile(EmbedThenLinear(), target_ratio=0.3),
               exported=tncompile.compile(ShapeBranch(), mode="graph", target_ratio=0.5, example_inputs=(torch.randn(3, 64),)))


def _compile(**kw) -> Callable[[Env], Any]:
    return lambda e: tncompile.compile(e.model, **{"target_ratio": 0.3, **kw})


def _fit(**kw) -> Callable[[Env], Any]:
    def run(e):
        c, opt, ctl = e.fresh()
        args = {"train_loader": [(torch.randn(4, 64), torch.randint(0, 10, (4,)))], "loss_fn": F.cross_entropy,
                "optimizer": opt, "controller": ctl, "early_steps": 1, "late_steps": 1, "progress": False, **kw}
        return tncompile.fit(c, **args)
    return run


def _controller(**kw) -> Callable[[Env], Any]:
    def run(e):
        c, opt, _ = e.fresh()
        return tncompile.RankController(c, kw.pop("optimizer", opt), **{"target_ratio": 0.2, **kw})
    return run


def _file(name: str, content: bytes | Callable[[Env], bytes]) -> Callable[[Env], Path]:
    def write(e):
        path = e.tmp / name
        path.write_bytes(content(e) if callable(content) else content)
        return path
    return write


def _flip_bytes(e: Env) -> bytes:
    data = bytearray(e.saved().read_bytes())
    for i in range(len(data) - 64, len(data)):  # tensor data sits at the end
        data[i] ^= 0xFF
    return bytes(data)


class DropOutput(tncompile.Pass):
    name = "drop-output"

    def run(self, program):
        for node in list(program.graph.nodes):
            if node.op == "output":
                program.graph.erase_node(node)
        return program


class Raises(tncompile.Pass):
    name = "raising-pass"

    def run(self, program):
        raise RuntimeError("kaboom")


class ReturnsJunk(tncompile.Pass):
    name = "junk-pass"

    def run(self, program):
        return 42


def _pipeline_with(p):
    return tncompile.default_pipeline().insert_after("tensorize", p)


# (id, action, exception, message regex)
CASES: list[tuple[str, Callable[[Env], Any], type, str]] = [
    # ---------------------------------------------------------------- what is compiled
    ("model-not-a-module", lambda e: tncompile.compile(lambda x: x, 0.3), TypeError, "expects an nn.Module"),
    ("model-already-compiled", lambda e: tncompile.compile(e.compiled, 0.1), TypeError,
     "already compressed by tncompile \\(CompiledModel\\); compile the original"),
    ("model-already-swapped", lambda e: tncompile.compile(e.swapped(), 0.1), TypeError,
     "already compressed by tncompile \\(Sequential\\); compile the original"),
    ("model-single-linear", lambda e: tncompile.compile(nn.Linear(512, 512), 0.1), TypeError,
     r"single Linear.*TTLinear\.from_linear.*nn\.Sequential"),
    ("model-single-embedding", lambda e: tncompile.compile(nn.Embedding(5000, 64), 0.1), TypeError,
     r"single Embedding.*TTMEmbedding\.from_embedding"),
    ("model-nothing-compressible", lambda e: tncompile.compile(nn.Sequential(nn.ReLU(), nn.LayerNorm(8)), 0.5),
     ValueError, "nothing to compress"),
    ("model-only-small-layers", lambda e: tncompile.compile(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)), 0.1),
     ValueError, "no layer could be tensorized, so the model stays at ratio 1"),
    ("model-untraceable-no-inputs", lambda e: tncompile.compile(DataDependent(), 0.5), tncompile.TraceError,
     "torch.fx could not trace DataDependent.*Pass example_inputs"),
    ("model-untraceable-both", lambda e: tncompile.compile(DataDependent(), 0.5, example_inputs=torch.randn(3, 64)),
     tncompile.TraceError, "torch.fx failed .* and torch.export"),
    # ---------------------------------------------------------------- target_ratio
    ("ratio-zero", _compile(target_ratio=0), ValueError, r"target_ratio must be in \(0, 1\]"),
    ("ratio-negative", _compile(target_ratio=-0.1), ValueError, r"target_ratio must be in \(0, 1\]"),
    ("ratio-above-one", _compile(target_ratio=1.5), ValueError, r"target_ratio must be in \(0, 1\]"),
    ("ratio-nan", _compile(target_ratio=math.nan), ValueError, r"target_ratio must be in \(0, 1\]"),
    ("ratio-inf", _compile(target_ratio=math.inf), ValueError, r"target_ratio must be in \(0, 1\]"),
    ("ratio-string", _compile(target_ratio="0.1"), TypeError, "target_ratio must be a number"),
    ("ratio-none", _compile(target_ratio=None), TypeError, "target_ratio must be a number"),
    ("ratio-bool", _compile(target_ratio=True), TypeError, "target_ratio must be a number"),
    ("ratio-infeasible", _compile(target_ratio=1e-5), ValueError, r"smallest possible ratio is 0\.\d+"),
    # ---------------------------------------------------------------- module selection
    ("target-modules-no-match", _compile(target_modules=["attn"]), ValueError,
     "target_modules entry 'attn' matches no compressible module; compressible modules are: 0, 2"),
    ("target-modules-bad-regex", _compile(target_modules="re:(["), ValueError,
     "target_modules entry 're:\\(\\[' is not a valid regex"),
    ("target-modules-wrong-type", _compile(target_modules=42), TypeError, "target_modules must be 'all'"),
    ("exclude-modules-no-match", _compile(exclude_modules="re:foo.*"), ValueError,
     "exclude_modules entry 're:foo.\\*' matches no compressible module"),
    ("exclude-everything", _compile(target_ratio=0.1, exclude_modules="all"), ValueError,
     "no layer could be tensorized"),
    ("rank-pattern-list", _compile(rank_pattern=[4]), TypeError, r"rank_pattern must be a dict .*got list"),
    ("rank-pattern-bad-regex", _compile(rank_pattern={"re:([": 4}), ValueError,
     "rank_pattern entry 're:\\(\\[' is not a valid regex"),
    ("rank-pattern-unmatched-key", _compile(rank_pattern={"fc9": 4}), ValueError,
     "rank_pattern entry 'fc9' matches no tensorized layer; tensorized layers are: 0"),
    ("rank-pattern-zero-rank", _compile(rank_pattern={"0": 0}), ValueError,
     r"rank_pattern\['0'\] \(a rank\) must be an int >= 1, got 0"),
    ("rank-pattern-float-rank", _compile(rank_pattern={"0": 2.5}), ValueError, r"\(a rank\) must be an int >= 1"),
    ("rank-pattern-int-key", _compile(rank_pattern={0: 4}), TypeError, "rank_pattern keys must be"),
    # ---------------------------------------------------------------- other compile options
    ("init-unknown", _compile(init="xavier"), ValueError, "init must be 'svd' or 'random'"),
    ("prefer-unknown", _compile(prefer="fast"), ValueError, r"prefer must be one of \('speed', 'size'\)"),
    ("linear-cores-zero", _compile(linear_cores=0), ValueError, r"linear_cores \(cores per network.*\) must be an int "
     r"in \[1, 16\], got 0"),
    ("linear-cores-too-many", _compile(target_ratio=0.1, linear_cores=20), ValueError,
     r"linear_cores .* must be an int in \[1, 16\], got 20"),
    ("linear-cores-too-many-for-the-layers", _compile(target_ratio=0.1, linear_cores=16), ValueError,
     "no layer could be tensorized"),
    ("embedding-cores-string", _compile(embedding_cores="4"), ValueError, r"embedding_cores .* must be an int in "),
    ("batch-sizes-too-many", _compile(batch_sizes=list(range(1, 66))), ValueError, "65 batch sizes, at most 64"),
    ("batch-sizes-zero", _compile(batch_sizes=0), TypeError, r"batch_sizes must be a list of positive ints.*\[32, 256\]"),
    ("batch-sizes-negative", _compile(batch_sizes=-1), TypeError, "batch_sizes must be a list of positive ints"),
    ("batch-sizes-float", _compile(batch_sizes=2.5), TypeError, "batch_sizes must be a list.*got float 2.5"),
    ("batch-sizes-string", _compile(batch_sizes="32"), TypeError, "batch_sizes must be a list.*got str '32'"),
    ("batch-sizes-huge-scalar", _compile(batch_sizes=10**9), TypeError, "batch_sizes must be a list"),
    ("batch-sizes-zero-entry", _compile(batch_sizes=[0]), ValueError, r"batch_sizes entries must be in \[1, "),
    ("batch-sizes-too-large", _compile(batch_sizes=[2**31]), ValueError, r"batch_sizes entries must be in \[1, "),
    ("batch-sizes-float-entry", _compile(batch_sizes=[2.5]), TypeError, "batch_sizes entries must be ints"),
    ("batch-sizes-bool-entry", _compile(batch_sizes=[True]), TypeError, "batch_sizes entries must be ints"),
    ("seed-string", _compile(init="random", seed="abc"), TypeError, "seed must be an int or None, got str 'abc'"),
    ("seed-float", _compile(seed=1.5), TypeError, "seed must be an int or None"),
    ("dump-dir-empty", _compile(dump_dir=""), ValueError, "dump_dir is empty"),
    ("dump-dir-is-a-file", lambda e: _compile(dump_dir=_file("afile", b"x")(e))(e), ValueError,
     "dump_dir .* is a file, not a directory"),
    ("dump-dir-wrong-type", _compile(dump_dir=3), TypeError, "dump_dir must be a directory path"),
    ("inplace-not-bool", _compile(inplace="yes"), TypeError, "inplace must be True or False"),
    # ---------------------------------------------------------------- example_inputs
    ("example-inputs-wrong-shape", _compile(example_inputs=torch.randn(4, 63)), ValueError,
     r"example_inputs do not fit Sequential: layer '0' \(Linear\) failed with RuntimeError: mat1 and mat2"),
    ("example-inputs-wrong-type", _compile(example_inputs={1, 2}), TypeError,
     "example_inputs must be a tuple of positional inputs, a dict of keyword inputs or a single tensor"),
    ("example-inputs-unknown-keyword", _compile(example_inputs={"foo": torch.randn(2, 64)}), ValueError,
     "example_inputs do not fit Sequential.forward: missing a required argument: 'input'"),
    # ---------------------------------------------------------------- passes
    ("passes-int", _compile(passes=42), TypeError, "passes must be a Pipeline, or a list of pass names"),
    ("passes-unknown-name", _compile(passes=["tensorise"]), ValueError,
     "unknown pass 'tensorise'.*registered passes: .*tensorize"),
    ("pass-raises", _compile(passes=_pipeline_with(Raises())), tncompile.PassError,
     "pass 'raising-pass' failed: RuntimeError: kaboom"),
    ("pass-drops-output", _compile(passes=_pipeline_with(DropOutput())), tncompile.PassError,
     "pass 'drop-output' failed: .*0 output nodes, it needs exactly one"),
    ("pass-returns-junk", _compile(passes=_pipeline_with(ReturnsJunk())), tncompile.PassError,
     "run\\(\\) must return a Program or None, got int"),
    # ---------------------------------------------------------------- calling the compiled model
    ("call-float64", lambda e: e.compiled(torch.randn(4, 64, dtype=torch.float64)), TypeError,
     r"TTLinear: the input is torch.float64 but the layer's cores are torch.float32; cast the input"),
    ("call-int-input", lambda e: e.compiled(torch.ones(4, 64, dtype=torch.long)), TypeError,
     r"TTLinear: the input is torch.int64; it takes floating-point inputs"),
    ("call-list-input", lambda e: e.compiled([1.0] * 64), TypeError, "TTLinear: the input must be a Tensor, got list"),
    ("call-wrong-last-dim", lambda e: e.compiled(torch.randn(4, 63)), ValueError, "TTLinear expected last dim 64"),
    ("call-too-many-args", lambda e: e.compiled(torch.randn(4, 64), torch.randn(4, 64)), TypeError,
     r"the compiled Sequential takes \(input\).*too many positional arguments"),
    ("call-no-args", lambda e: e.compiled(), TypeError, "missing a required argument: 'input'"),
    ("call-ids-out-of-range", lambda e: e.embedded(torch.tensor([[5, 1000]])), IndexError,
     r"TTMEmbedding: id 1000 out of range \[0, 1000\)"),
    ("call-ids-negative", lambda e: e.embedded(torch.tensor([[5, -1]])), IndexError, "id -1 out of range"),
    ("call-ids-float", lambda e: e.embedded(torch.tensor([[5.0, 1.0]])), TypeError,
     "TTMEmbedding expects integer ids, got torch.float32"),
    ("call-export-structure", lambda e: e.exported(torch.randn(3, 64), torch.randn(3, 64)), TypeError,
     "traced with 1 positional input"),
    ("call-export-keyword", lambda e: e.exported(torch.randn(3, 64), mask=torch.ones(3)), TypeError,
     "keyword input\\(s\\) \\['mask'\\] it was not traced with"),
    ("call-export-guard", lambda e: e.exported(torch.randn(3, 32)), ValueError,
     "input 'x' dim 1 is 32, but the trace fixed it to 64.*Compile with example_inputs of the size you run"),
    # ---------------------------------------------------------------- training
    ("controller-on-plain-model", lambda e: tncompile.RankController(e.model, target_ratio=0.1), TypeError,
     "RankController expects a CompiledModel, got Sequential"),
    ("controller-ratio-above-compiled", _controller(target_ratio=0.5), ValueError,
     r"target_ratio must be in \(0, 0\.\d+\), the ratio the model was compiled at"),
    ("controller-ratio-unreachable", _controller(target_ratio=0.01), ValueError,
     "target_ratio=0.01 cannot be reached: with every rank at 1.*allow_layer_removal=True"),
    ("controller-optimizer-misses-gates",
     lambda e: (lambda c: tncompile.RankController(c, torch.optim.AdamW(
         [p for n, p in c.named_parameters() if "gates" not in n]), target_ratio=0.2))(e.fresh()[0]),
     ValueError, "does not update the rank gates of \\['0'\\]; build it with tncompile.param_groups"),
    ("controller-lbfgs-slice", lambda e: (lambda c: tncompile.RankController(
        c, torch.optim.LBFGS(c.parameters()), target_ratio=0.2))(e.fresh()[0]), TypeError,
     "cannot slice the state of LBFGS.*optimizer_state='reset'"),
    ("controller-schedule", _controller(schedule="fast"), ValueError, "schedule must be one of"),
    ("controller-nonfinite", _controller(nonfinite="ignore"), ValueError, "nonfinite must be one of"),
    ("controller-optimizer-state", _controller(optimizer_state="keep"), ValueError,
     "optimizer_state must be one of \\('slice', 'reset'\\)"),
    ("controller-threshold", _controller(threshold=0), ValueError, "threshold must be a finite number > 0"),
    ("controller-truncate-every", _controller(truncate_every=-1), ValueError, "truncate_every must be an int >= 0"),
    ("controller-recovery", _controller(recovery=1.0), ValueError, r"recovery must be in \[0, 1\)"),
    ("controller-loss-smoothing", _controller(loss_smoothing=1.0), ValueError, r"loss_smoothing must be in \[0, 1\)"),
    ("controller-bad-state", lambda e: e.fresh()[2].load_state_dict({"foo": 1}), ValueError,
     "not a controller state"),
    ("penalty-vector", lambda e: e.fresh()[2].penalty(torch.ones(3)), ValueError, "expects the scalar task-loss"),
    ("late-stage-without-loss", lambda e: e.fresh()[2].start_late_stage(), RuntimeError,
     "no task loss seen in the early stage"),
    ("param-groups-plain-model", lambda e: tncompile.param_groups(e.model, lr=1e-3), TypeError,
     "param_groups expects a CompiledModel"),
    ("param-groups-negative-lr", lambda e: tncompile.param_groups(e.compiled, lr=-1), ValueError,
     "param_groups: lr must be a finite number > 0, got -1"),
    ("param-groups-nan-gate-lr", lambda e: tncompile.param_groups(e.compiled, lr=1e-3, gate_lr=math.nan), ValueError,
     "gate_lr must be a finite number > 0"),
    ("fit-negative-steps", _fit(early_steps=-1), ValueError, "fit: early_steps must be an int >= 0, got -1"),
    ("fit-empty-loader", _fit(train_loader=[]), ValueError, "fit: train_loader yielded no batches"),
    ("fit-loader-not-iterable", _fit(train_loader=5), TypeError, "train_loader must be an iterable of"),
    ("fit-loss-fn-not-callable", _fit(loss_fn="ce"), TypeError, "loss_fn must be callable"),
    ("fit-loss-not-scalar", _fit(loss_fn=lambda out, y: out), ValueError,
     r"loss_fn must return a scalar, got shape \(4, 10\)"),
    ("fit-loss-float", _fit(loss_fn=lambda out, y: 1.0), TypeError, "loss_fn must return a scalar tensor"),
    ("fit-batch-not-pair", _fit(train_loader=[torch.randn(4, 64)]), ValueError,
     r"each batch must be a pair \(inputs, targets\)"),
    ("fit-checkpoint-half", _fit(checkpoint_every=1), ValueError, "give checkpoint_path and checkpoint_every together"),
    ("fit-cuda-graph", _fit(cuda_graph="yes"), ValueError, "cuda_graph must be 'auto', True or False"),
    ("fit-grad-clip", _fit(grad_clip=-1), ValueError, "grad_clip must be > 0"),
    ("fit-log-every", _fit(log_every=0), ValueError, "log_every must be an int >= 1"),
    ("fit-eval-every", _fit(eval_fn=lambda m: 1.0, eval_every=0), ValueError, "eval_every must be an int >= 1"),
    ("fit-nan-loss", _fit(loss_fn=lambda out, y: out.sum() * math.nan), FloatingPointError,
     "non-finite task loss.*nonfinite='skip'"),
    ("fit-other-controller", lambda e: tncompile.fit(e.compiled, [], F.cross_entropy, e.fresh()[1], e.fresh()[2], 1, 1),
     ValueError, "the controller was built for a different model"),
    # ---------------------------------------------------------------- files
    ("save-plain-model", lambda e: tncompile.save(e.model, e.tmp / "x.tnc"), TypeError,
     "tncompile.save expects a model tncompile.compile returned"),
    ("save-missing-directory", lambda e: tncompile.save(e.compiled, e.tmp / "nodir" / "x.tnc"), FileNotFoundError,
     "the directory .*nodir' of .* does not exist"),
    ("save-to-directory", lambda e: tncompile.save(e.compiled, e.tmp), IsADirectoryError,
     "is a directory; give a file path"),
    ("save-path-int", lambda e: tncompile.save(e.compiled, 42), TypeError, "path must be a file path"),
    ("save-optimizer-string", lambda e: tncompile.save(e.compiled, e.tmp / "o.tnc", optimizer="adam"), TypeError,
     "optimizer must be a torch.optim.Optimizer"),
    ("save-extra-code", lambda e: tncompile.save(e.compiled, e.tmp / "o.tnc", extra={"f": print}), TypeError,
     r"cannot save the training state\['extra'\]\['f'\].*data only"),
    ("load-missing", lambda e: tncompile.load(e.tmp / "missing.tnc"), FileNotFoundError, "tncompile.load: no file"),
    ("load-directory", lambda e: tncompile.load(e.tmp), tncompile.ModelFileError, "is a directory without a config.json"),
    ("load-random-bytes", lambda e: tncompile.load(_file("rand.tnc", os.urandom(1000))(e)), ValueError,
     "is not a tncompile file"),
    ("load-empty-file", lambda e: tncompile.load(_file("empty.tnc", b"")(e)), ValueError, "is not a tncompile file"),
    ("load-truncated-header", lambda e: tncompile.load(_file("head.tnc", lambda e: e.saved().read_bytes()[:2000])(e)),
     ValueError, "is a truncated tncompile file"),
    ("load-truncated", lambda e: tncompile.load(_file("half.tnc", lambda e: _half(e.saved().read_bytes()))(e)),
     ValueError, "not a readable tncompile file \\(truncated"),
    ("load-flipped-bytes", lambda e: tncompile.load(_file("flipped.tnc", _flip_bytes)(e)), ValueError,
     "is damaged: its contents do not match the checksum"),
    ("load-pickle", lambda e: tncompile.load(_file("sd.pt", lambda e: _pickled(e))(e)), tncompile.ModelFileError,
     "is not a tncompile file: it is a pickle"),
    ("load-without-model", lambda e: tncompile.load(e.saved()), tncompile.ModelFileError,
     r"pass the dense model it was saved from \(a Sequential\).*model=lambda"),
    ("load-onto-another-model", lambda e: tncompile.load(e.saved(), model=mlp((64, 64, 10))), tncompile.ModelMismatchError,
     "'0'.*file's network stands for"),
    ("load-bad-map-location", lambda e: tncompile.load(e.saved(), map_location="gpu"), ValueError,
     "map_location='gpu' is not a device"),
    ("resume-plain-model", lambda e: tncompile.resume(e.model), TypeError, "tncompile.resume expects the model"),
    ("resume-no-training-state", lambda e: tncompile.resume(_saved_bare(e)), ValueError,
     "carries no training state"),
]


def _half(data: bytes) -> bytes:
    """The header whole, the tensor data cut in half."""
    header = int.from_bytes(data[:8], "little") + 8
    return data[: header + (len(data) - header) // 2]


def _saved_bare(e: Env):
    path = e.tmp / "bare.tnc"
    tncompile.save(e.compiled, path, rng=False)
    return tncompile.load(path, model=mlp((64, 128, 10)))


def _pickled(e: Env) -> bytes:
    path = e.tmp / "sd.pickle"
    torch.save(e.model.state_dict(), path)
    return path.read_bytes()


def test_the_table_covers_at_least_60_kinds():
    ids = [c[0] for c in CASES]
    assert len(set(ids)) == len(ids), "duplicate ids"
    assert len(ids) >= 60


@pytest.mark.parametrize("action,error,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(env, capfd, action, error, message):
    before = {k: v.clone() for k, v in env.model.state_dict().items()}
    with pytest.raises(error, match=message):
        action(env)
    after = env.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), \
        "the user's model was mutated"
    assert isinstance(env.model[0], nn.Linear) and isinstance(env.model[2], nn.Linear)
    assert "Traceback" not in capfd.readouterr().err, "an error printed a traceback of its own"


def test_check_int_and_check_float_name_the_argument_and_refuse_bools():
    from tncompile.errors import check_float, check_int
    assert check_int(3, "n", 1) == 3 and check_int(None, "n", 1, none_ok=True) is None
    with pytest.raises(ValueError, match=r"^n must be an int >= 1, got 0$"):
        check_int(0, "n", 1)
    with pytest.raises(TypeError, match=r"^n must be an int in \[1, 4\] or None, got bool True$"):
        check_int(True, "n", 1, 4, none_ok=True, error=TypeError)  # True is an int to Python, never a count
    assert check_float(0.5, "p", 0.0, 1.0, high_open=True) == 0.5
    with pytest.raises(ValueError, match=r"^p must be in \[0, 1\), got 1$"):
        check_float(1, "p", 0.0, 1.0, high_open=True)
    for bad in (float("nan"), float("inf"), False, "1"):
        with pytest.raises(ValueError, match="p must be a finite number > 0"):
            check_float(bad, "p", 0.0, low_open=True)


def test_fit_settings_are_checked_when_made():
    from tncompile.train import FitSettings
    assert FitSettings(early_steps=2, late_steps=3).log_every == 10
    with pytest.raises(ValueError, match="fit: log_every must be an int >= 1, got 0"):
        FitSettings(log_every=0)
    with pytest.raises(ValueError, match="checkpoint_path and checkpoint_every together"):
        FitSettings(checkpoint_every=5)
