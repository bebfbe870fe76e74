"""TrainStep: the eager path against a hand-written loop, capture bookkeeping,
re-capture decisions, bad inputs; CUDA-graph replay (marked cuda)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import tncompile
from tncompile.train import TrainStep
from tncompile.train.capture_cache import CaptureCache
from tncompile.train.train_step import make_capturable
from tncompile.testing import small_encoder


def _batches(n=20, batch=8, seed=3, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, 1000, (batch, 16), generator=g).to(device),
             torch.randint(0, 3, (batch,), generator=g).to(device)) for _ in range(n)]


def _setup(device="cpu", **ctl_kwargs):
    torch.manual_seed(0)
    compiled = tncompile.compile(small_encoder(), target_ratio=0.2, init="random").to(device)
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=2e-3, gate_lr=5e-2))
    settings = dict(target_ratio=0.05, threshold=0.95, rank_weight=1.0, truncate_every=5, early_steps=8)
    settings.update(ctl_kwargs)
    return compiled, opt, tncompile.RankController(compiled, opt, **settings)


def _hand_loop(compiled, opt, ctl, data, grad_clip=None):
    losses, events = [], []
    for x, y in data:
        task = F.cross_entropy(compiled(x), y)
        loss = task + ctl.penalty(task)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(compiled.parameters(), grad_clip, foreach=True)
        opt.step()
        events.append(ctl.step())
        losses.append(task.detach())
    return losses, events


@pytest.mark.parametrize("grad_clip", [None, 0.5])
def test_eager_train_step_equals_hand_written_loop(grad_clip):
    data = _batches()
    a = _setup()
    b = copy.deepcopy(a)  # model, optimizer and controller together (shared references kept)
    torch.manual_seed(11)
    ref, ref_events = _hand_loop(*a, data, grad_clip)
    step = TrainStep(b[0], b[1], F.cross_entropy, controller=b[2], grad_clip=grad_clip)
    torch.manual_seed(11)  # same dropout masks
    got = []
    for x, y in data:
        got.append(step(x, y))
    assert step.stats()["mode"] == "eager"
    assert [e.step for e in ref_events if e.shapes_changed]  # truncations happened...
    assert any(e.stage_changed for e in ref_events)          # ...and a stage switch
    assert all(torch.equal(r, g) for r, g in zip(ref, got))  # bit for bit
    assert b[2].ranks() == a[2].ranks()
    assert b[0].ratio == a[0].ratio


def test_returned_loss_is_a_fresh_tensor():
    compiled, opt, ctl = _setup()
    step = TrainStep(compiled, opt, F.cross_entropy, controller=ctl)
    x, y = _batches(1)[0]
    first = step(x, y)
    kept = first.clone()
    step(x, y)
    assert torch.equal(first, kept) and first.requires_grad is False


def test_bf16_autocast_keeps_fp32_master_weights():
    compiled, opt, ctl = _setup()
    step = TrainStep(compiled, opt, F.cross_entropy, controller=ctl, amp="bf16")
    for x, y in _batches(3):
        loss = step(x, y)
    assert torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in compiled.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_torch_compile_eager_path_matches_eager():
    from tncompile.testing import mlp
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    losses = {}
    for use_compile in (False, True):
        torch.manual_seed(0)
        compiled = tncompile.compile(mlp((64, 128, 10)), target_ratio=0.5, init="random")
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
        step = TrainStep(compiled, opt, F.cross_entropy, compile=use_compile)
        losses[use_compile] = torch.stack([step(x, y) for _ in range(3)])
    assert torch.allclose(losses[True], losses[False], rtol=1e-5, atol=1e-6)
    assert losses[True][-1] < losses[True][0]


def test_capture_cache_decisions_lru_and_invalidation():
    cache = CaptureCache(max_graphs=2, warmup_steps=2)
    assert not cache.check_token(("v0",))
    seq = []
    for _ in range(4):
        d = cache.decide("a")
        seq.append(d)
        if d == "eager":
            cache.warmed("a")
        elif d == "capture":
            cache.add("a", "graph-a")
        else:
            assert cache.get("a") == "graph-a"
    assert seq == ["eager", "eager", "capture", "replay"]
    for key in ("b", "c"):  # two more signatures: "a" is least recently used and evicted
        cache.warmed(key), cache.warmed(key)
        assert cache.decide(key) == "capture"
        evicted = cache.add(key, f"graph-{key}")
    assert evicted == ["graph-a"] and cache.keys() == ["b", "c"] and len(cache) == 2
    assert cache.decide("a") == "eager"  # an evicted signature warms up again
    cache.decide("b")  # touch b: now c is the oldest
    cache.warmed("a"), cache.warmed("a")
    assert cache.add("a", "graph-a2") == ["graph-c"]
    # a new state token drops every graph: nothing stale is replayed
    assert cache.check_token(("v1",))
    assert len(cache) == 0 and cache.decide("b") == "eager"
    stats = cache.stats
    assert (stats.captures, stats.evictions, stats.invalidations, stats.live_graphs) == (4, 2, 1, 0)
    with pytest.raises(ValueError, match="max_graphs"):
        CaptureCache(max_graphs=0)


def test_state_token_changes_on_truncation_stage_switch_and_dtype():
    compiled, opt, ctl = _setup(truncate_every=0, early_steps=None)
    step = TrainStep(compiled, opt, F.cross_entropy, controller=ctl)
    token = step._state_token()
    assert step._state_token() == token  # stable while nothing changes
    ctl.penalty(torch.tensor(1.0))
    ctl.start_late_stage()
    assert step._state_token() != token
    token = step._state_token()
    with torch.no_grad():
        next(iter(ctl.layers.values())).gates[0][1:] = 0.0
    ctl.truncate()
    assert step._state_token() != token
    token = step._state_token()
    compiled.double()
    assert step._state_token() != token


def test_bad_inputs_and_settings_are_clear_errors():
    compiled, opt, ctl = _setup()
    step = TrainStep(compiled, opt, F.cross_entropy, controller=ctl, max_batch=8)
    x, y = _batches(1)[0]
    step(x, y)
    with pytest.raises(ValueError, match="changed structure"):
        step((x,), y)
    with pytest.raises(ValueError, match="max_batch=8"):
        step(torch.cat([x, x]), torch.cat([y, y]))
    with pytest.raises(ValueError, match="is on meta"):
        step(x.to("meta"), y)
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
        TrainStep(compiled, opt, F.cross_entropy, cuda_graph=True)
    with pytest.raises(ValueError, match="bf16"):
        TrainStep(compiled, opt, F.cross_entropy, amp="fp16")
    other, other_opt, other_ctl = _setup()
    with pytest.raises(ValueError, match="different model"):
        TrainStep(compiled, opt, F.cross_entropy, controller=other_ctl)
    with pytest.raises(ValueError, match="scalar"):
        TrainStep(other, other_opt, lambda out, t: F.cross_entropy(out, t, reduction="none"))(x, y)


def test_fused_adamw_steps_through_cuts_like_the_default():
    """``AdamW(fused=True)`` (one kernel for all of a compressed model's many small
    tensors) trains through truncations and a stage switch as the default loop does."""
    data = _batches(20)
    results = []
    for fused in (False, True):
        compiled, _, _ = _setup()
        opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=2e-3, gate_lr=5e-2), fused=fused)
        ctl = tncompile.RankController(compiled, opt, target_ratio=0.1, threshold=0.95, rank_weight=1.0,
                                       truncate_every=5, early_steps=8)
        step = TrainStep(compiled, opt, F.cross_entropy, controller=ctl)
        losses = torch.stack([step(x, y) for x, y in data])
        results.append((losses, ctl.ranks(), compiled.ratio))
    (plain, plain_ranks, plain_ratio), (fused, fused_ranks, fused_ratio) = results
    assert fused_ranks == plain_ranks and fused_ratio == plain_ratio < 0.2
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)


def test_make_capturable():
    compiled, opt, _ = _setup()
    make_capturable(opt)
    assert all(g["capturable"] for g in opt.param_groups)
    make_capturable(torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(TypeError, match="LBFGS cannot be captured"):
        make_capturable(torch.optim.LBFGS(compiled.parameters()))


# ---------------------------------------------------------------- CUDA (skipped without a GPU)
@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager_across_truncation_and_stage_switch():
    data = _batches(20, device="cuda")
    eager = _setup("cuda")
    graphed = copy.deepcopy(eager)
    eager_step = TrainStep(eager[0], eager[1], F.cross_entropy, controller=eager[2], cuda_graph=False)
    make_capturable(eager[1])  # same optimizer arithmetic in both runs
    graph_step = TrainStep(graphed[0], graphed[1], F.cross_entropy, controller=graphed[2], cuda_graph=True)
    torch.manual_seed(11)
    ref = [eager_step(x, y) for x, y in data]
    torch.manual_seed(11)
    got = [graph_step(x, y) for x, y in data]
    stats = graph_step.stats()
    assert stats["mode"] == "cuda_graph" and stats["replays"] > 0 and stats["invalidations"] >= 2
    for r, g in zip(ref, got):
        assert torch.allclose(r, g, rtol=1e-5, atol=1e-6)
    assert graphed[2].ranks() == eager[2].ranks()


@pytest.mark.cuda
def test_cuda_no_stale_graph_and_bounded_pool():
    compiled, opt, ctl = _setup("cuda", truncate_every=0, early_steps=None)
    step = TrainStep(compiled, opt, F.cross_entropy, controller=ctl, cuda_graph=True, max_graphs=2)
    for batch in (4, 8, 12, 4, 8, 12, 16):
        for x, y in _batches(3, batch=batch, device="cuda"):
            step(x, y)
    stats = step.stats()
    assert stats["live_graphs"] <= 2 and stats["evictions"] >= 1
    with torch.no_grad():
        next(iter(ctl.layers.values())).gates[0][1:] = 0.0
    ctl.truncate()
    x, y = _batches(1, batch=16, device="cuda")[0]
    step(x, y)  # must not replay the graph captured before the cut
    assert step.stats()["live_graphs"] == 0 and step.stats()["invalidations"] >= 1


@pytest.mark.parametrize("first_step_bad", [False, True])
def test_step_guard_device_path_leaves_a_nonfinite_step_undone(first_step_bad):
    """The path a GPU (and a captured step) takes, with no host read: step, then the copy back
    where the flag says non-finite; state the step created goes back to zeros. Run on CPU here."""
    from tncompile.train.step_guard import StepGuard
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    guard = StepGuard()
    if not first_step_bad:
        layer(torch.randn(2, 4)).sum().backward()
        opt.step()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    state_before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in layer.parameters()}
    opt.zero_grad()
    layer(torch.tensor([[float("nan"), 0.0, 0.0, 0.0]])).sum().backward()
    guard._step_where(opt, list(layer.parameters()), torch.tensor(False))
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    for p in layer.parameters():
        for k, v in opt.state[p].items():
            want = state_before[id(p)].get(k, torch.zeros_like(v))
            assert torch.equal(v, want.to(v.dtype)), k
    # a finite flag: exactly the optimizer's own step
    twin = copy.deepcopy((layer, opt))
    opt.zero_grad(), twin[1].zero_grad()
    x = torch.randn(2, 4)
    layer(x).sum().backward(), twin[0](x).sum().backward()
    guard._step_where(opt, list(layer.parameters()), torch.tensor(True))
    twin[1].step()
    assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), twin[0].parameters()))
