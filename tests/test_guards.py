"""Shape constraints of an export trace are kept: a compiled model refuses the
shapes its graph was not traced for instead of returning wrong values."""
import pytest
import torch
from torch import nn

import tncompile


class UsesLen(nn.Module):
    """``len(x)`` makes the batch size a constant of the exported graph."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.down(self.up(x.reshape(len(x), -1, 64)))


class ShapeGeneric(UsesLen):
    def forward(self, x):
        if x.shape[0] > 0:  # control flow on a size: fx cannot trace it, export keeps the size dynamic
            return self.down(self.up(x))
        return x


def test_a_size_fixed_by_the_trace_is_refused_with_the_reason(tmp_path):
    torch.manual_seed(0)
    model = UsesLen()
    compiled = tncompile.compile(model, mode="graph", target_ratio=0.5, example_inputs=(torch.randn(2, 4, 64),))
    assert compiled.program.inputs.frontend == "export"
    assert compiled(torch.randn(2, 7, 64)).shape == (2, 7, 64)  # the other dims stay dynamic
    with pytest.raises(ValueError, match=r"dim 0 is 5, but the trace fixed it to 2.*len\(x\)"):
        compiled(torch.randn(5, 4, 64))
    path = tmp_path / "m.tnc"
    tncompile.save(compiled, path)
    with pytest.raises(ValueError, match="fixed it to 2"):  # the constraint is saved with the model
        tncompile.load(path, model=UsesLen())(torch.randn(5, 4, 64))


def test_shape_generic_code_runs_at_any_batch():
    torch.manual_seed(0)
    model = ShapeGeneric()
    compiled = tncompile.compile(model, mode="graph", target_ratio=0.5, example_inputs=(torch.randn(2, 4, 64),)).eval()
    assert compiled.program.inputs.frontend == "export"
    for shape in [(5, 4, 64), (1, 3, 64), (3, 1, 64)]:
        x = torch.randn(*shape)
        assert compiled(x).shape == shape


def test_size_one_example_dims_warn_at_compile_time():
    with pytest.warns(UserWarning, match="size 1 at x dim 0"):
        compiled = tncompile.compile(ShapeGeneric(), mode="graph", target_ratio=0.5, example_inputs=(torch.randn(1, 4, 64),))
    with pytest.raises(ValueError, match="fixed it to 1"):
        compiled(torch.randn(2, 4, 64))


def test_sizes_the_trace_tied_together_must_agree():
    class Adds(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, a, b):
            if a.shape[0] > 0:  # data-dependent control flow: fx cannot trace it, export can
                return self.lin(a) + b
            return b

    compiled = tncompile.compile(Adds(), mode="graph", target_ratio=0.9, example_inputs=(torch.randn(3, 64), torch.randn(3, 64)),
                                 linear_cores=2)
    assert compiled(torch.randn(4, 64), torch.randn(4, 64)).shape == (4, 64)
    with pytest.raises(ValueError, match="requires them equal"):
        compiled(torch.randn(4, 64), torch.randn(5, 64))
