"""compile(prefer=...): no network costlier to train than its dense layer by default; the report says when."""
import pytest
import torch
from torch import nn

import tncompile
from tncompile.formats.layout import TTLayout
from tncompile.passes.assign_ranks import AssignRanks
from tncompile.planning import fixed_order_macs
from tncompile.runtime import TTLinear


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))


def _tt_layers(compiled):
    return {name: m for name, m in compiled.tensorized_modules().items() if isinstance(m, TTLinear)}


def _step_macs(layer: TTLinear, rows: int) -> tuple[int, int]:
    lay = layer.layout
    return fixed_order_macs(lay, rows), 3 * rows * lay.in_features * lay.out_features


@pytest.mark.parametrize("traced_rows", [1, 32])
def test_speed_keeps_every_network_at_most_as_costly_as_dense(traced_rows):
    """Over a batch of 32 samples (tuning.ASSUMED_ROWS) at the rows per sample traced,
    whatever batch the example inputs had: the ranks do not depend on it."""
    compiled = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(traced_rows, 256),))
    assert compiled.ratio <= 0.05
    for name, layer in _tt_layers(compiled).items():
        tn, dense = _step_macs(layer, 32)
        assert tn <= dense, (name, layer.layout.ranks)
    assert "slower than dense" not in str(compiled.report())
    other = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(33 - traced_rows, 256),))
    assert {n: m.layout.ranks for n, m in _tt_layers(other).items()} == \
        {n: m.layout.ranks for n, m in _tt_layers(compiled).items()}


def test_batch_sizes_say_which_batch_speed_is_judged_at():
    compiled = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(32, 256),), batch_sizes=[1])
    for name, layer in _tt_layers(compiled).items():
        tn, dense = _step_macs(layer, 1)
        assert tn <= dense, (name, layer.layout.ranks)


@pytest.mark.parametrize("batch_sizes,rows", [(None, 32), ([1], 1), ([4, 256], 256)])
def test_without_shapes_speed_uses_batch_sizes_or_32_rows(batch_sizes, rows):
    """Traced by fx without example_inputs there are no shapes: the rule still holds,
    over the largest of batch_sizes, else tuning.ASSUMED_ROWS (32)."""
    assert tncompile.tuning.ASSUMED_ROWS == 32
    compiled = tncompile.compile(_mlp(), target_ratio=0.05, batch_sizes=batch_sizes)
    for name, layer in _tt_layers(compiled).items():
        tn, dense = _step_macs(layer, rows)
        assert tn <= dense, (name, layer.layout.ranks)
    small = tncompile.compile(_mlp(), target_ratio=0.05, batch_sizes=batch_sizes, prefer="size")
    assert any(_step_macs(layer, rows)[0] > _step_macs(layer, rows)[1] for layer in _tt_layers(small).values())


def test_size_grows_ranks_past_that_and_the_report_flags_it():
    x = torch.randn(32, 256)
    fast = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(x,))
    small = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(x,), prefer="size")
    slower = [name for name, layer in _tt_layers(small).items() if _step_macs(layer, 32)[0] > _step_macs(layer, 32)[1]]
    assert slower == ["4"]  # the 512->8 head: rank 2 under "speed", larger under "size"
    assert max(_tt_layers(small)["4"].layout.ranks) > max(_tt_layers(fast)["4"].layout.ranks)
    report = str(small.report())
    assert "slower than dense at 32 rows" in report
    assert small.ratio >= fast.ratio  # size spends the budget the speed rule leaves


def test_speed_cap_is_the_first_rank_that_costs_too_much():
    """The cost is not monotonic in the rank: the cap stops below the first rank over dense."""
    lay = TTLayout.for_shape(256, 512, 3)
    cap = AssignRanks._speed_cap(lay, 1)
    dense = 3 * 256 * 512
    assert all(fixed_order_macs(lay.with_ranks(r), 1) <= dense for r in range(1, cap + 1))
    assert fixed_order_macs(lay.with_ranks(cap + 1), 1) > dense


def test_bad_prefer_names_the_choices():
    with pytest.raises(ValueError, match="prefer must be one of"):
        tncompile.compile(_mlp(), target_ratio=0.05, prefer="fast")
