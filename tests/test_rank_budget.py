"""schedule="budget" (the default): fit ends at or below target_ratio from a plain optimizer."""
import pytest
import torch
from torch import nn

import tncompile


def _task():
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    y = (x @ torch.randn(64, 4)).argmax(1)
    loader = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 512, 64)]
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    compiled = tncompile.compile(mlp, target_ratio=0.3, example_inputs=(x[:64],), init="random")
    return compiled, loader, x, y


def _accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def test_fit_reaches_the_target_with_adamw_over_all_parameters():
    compiled, loader, x, y = _task()
    start = compiled.ratio
    opt = torch.optim.AdamW(compiled.parameters(), lr=3e-3)  # no param_groups: gates share the lr
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.08)
    history = tncompile.fit(compiled, loader, nn.functional.cross_entropy, opt, ctl, early_steps=40,
                            late_steps=100, progress=False)
    assert start > 0.2 and compiled.ratio <= 0.08
    cuts = [e for e in history.events if e["kind"] == "truncation"]
    assert cuts and cuts[-1]["step"] == 40 + 70  # the last cut leaves 30% of the late steps to recover
    assert all(a >= b for a, b in zip([e["ratio"] for e in cuts], [e["ratio"] for e in cuts][1:]))
    assert _accuracy(compiled, x, y) > 0.6  # 4 classes: chance is ~0.25; it still learns


def test_budget_falls_linearly_to_the_target():
    compiled, *_ = _task()
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.1, late_steps=100, truncate_every=0,
                                   target_loss=1.0)
    assert ctl.budget() is None  # early stage
    ctl.start_late_stage()
    start = compiled.ratio
    assert ctl.final_cut_step() == 70 and ctl.budget() == pytest.approx(start)
    ctl.steps_done = 35
    assert ctl.budget() == pytest.approx((start + 0.1) / 2)
    ctl.steps_done = 70
    assert ctl.budget() == pytest.approx(0.1)


def test_budget_cut_keeps_the_important_ranks_of_every_bond():
    compiled, *_ = _task()
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.1)
    before = ctl.ranks()
    ctl.truncate(budget=0.15)
    assert compiled.ratio <= 0.15
    for name, ranks in ctl.ranks().items():
        assert all(r >= 1 for r in ranks)
    # a wide inner bond loses ranks before a narrow boundary one (in a layer the cut reached)
    first = next(n for n in before if ctl.ranks()[n] != before[n])
    assert ctl.ranks()[first][0] == before[first][0]
    assert sum(ctl.ranks()[first][1:-1]) < sum(before[first][1:-1])


def test_unreachable_target_is_refused_up_front():
    compiled, *_ = _task()
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="cannot be reached: with every rank at 1"):
        tncompile.RankController(compiled, opt, target_ratio=1e-4)


def test_comera_rule_stays_available():
    compiled, loader, *_ = _task()
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=3e-3))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.08, schedule="comera")
    tncompile.fit(compiled, loader, nn.functional.cross_entropy, opt, ctl, early_steps=10, late_steps=10,
                  progress=False)
    assert ctl.schedule == "comera" and ctl.last_choice is not None and not ctl.recovering
    with pytest.raises(ValueError, match="schedule must be one of"):
        tncompile.RankController(compiled, opt, target_ratio=0.08, schedule="fast")
