"""Pretrained models: calibrated initialization, rank allocation by sensitivity,
distillation in ``fit``, gentle targets, fixed-rank training, ``compress_pretrained``.

The "pretrained" model is a small text classifier trained here for a few hundred
steps on Zipf-distributed token ids (no downloads); its trained weights are not
low-rank.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile import tuning
from tncompile.calibration import collect_statistics, fit_linear_cores, fit_table_cores
from tncompile.formats.factorization import tt_from_linear_weight, tt_to_dense, ttm_from_embedding_weight, ttm_to_dense
from tncompile.formats.layout import TTLayout, TTMLayout

VOCAB, SEQ = 400, 16


class TinyText(nn.Module):
    def __init__(self, vocab=VOCAB, dim=48, hidden=192, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.head(h.mean(1))


def zipf_ids(n, generator):
    p = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(p / p.sum(), n * SEQ, replacement=True, generator=generator).reshape(n, SEQ)


@pytest.fixture(scope="module")
def pretrained():
    """(model, calibration batches, held-out batches): trained 300 steps."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(VOCAB, 4, generator=g)
    model = TinyText()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        ids = zipf_ids(32, g)
        loss = F.cross_entropy(model(ids), truth[ids].sum(1).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    model.eval()
    calib = [zipf_ids(32, g) for _ in range(6)]
    held = [zipf_ids(64, g) for _ in range(4)]
    return model, calib, held


def output_error(model, reference, batches):
    with torch.no_grad():
        num = sum(float((model(x) - reference(x)).pow(2).sum()) for x in batches)
        den = sum(float(reference(x).pow(2).sum()) for x in batches)
    return num / den


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- statistics
def test_statistics_are_the_inputs_second_moments_and_row_counts(pretrained, monkeypatch):
    model, calib, _ = pretrained
    before = state_of(model)
    held = collect_statistics(model, calib, progress=False)  # every 5th sample held out from the fit
    monkeypatch.setattr(tuning, "CALIBRATION_HOLD_OUT", 0)
    stats = collect_statistics(model, calib, progress=False)
    xs = [model.emb(x).reshape(-1, 48).double() for x in calib]
    x = torch.cat(xs)
    # one batch's products in float32, summed in float64
    torch.testing.assert_close(stats.moment_of(model.fc1.weight), x.t() @ x / x.shape[0], rtol=1e-5, atol=1e-5)
    fit, out = held.moments[id(model.fc1.weight)], held.moments[id(model.fc1.weight)]
    assert fit.rows + out.held_rows == x.shape[0] and 0 < out.held_rows < fit.rows
    torch.testing.assert_close((fit.total + out.held_total) / x.shape[0], x.t() @ x / x.shape[0], rtol=1e-5, atol=1e-5)
    counts = torch.bincount(torch.cat([c.reshape(-1) for c in calib]), minlength=VOCAB)
    assert torch.equal(stats.counts_of(model.emb.weight), counts)
    assert stats.batches == len(calib) and not model.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_layers_fed_the_same_tensor_share_one_moment_until_their_inputs_differ(monkeypatch):
    monkeypatch.setattr(tuning, "CALIBRATION_HOLD_OUT", 0)  # every row into the moment
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, other=None):
            return self.q(x) + self.k(x) + self.v(x if other is None else other)
    model = QKV()
    xs = [torch.randn(5, 8) for _ in range(3)]
    stats = collect_statistics(model, [xs[0], xs[1]], progress=False)
    assert stats.moments[id(model.q.weight)] is stats.moments[id(model.v.weight)]
    stats2 = collect_statistics(model, [xs[0], (xs[1], xs[2])], progress=False)
    q, v = stats2.moment_of(model.q.weight), stats2.moment_of(model.v.weight)
    a, b = torch.cat([xs[0], xs[1]]).double(), torch.cat([xs[0], xs[2]]).double()
    torch.testing.assert_close(q, a.t() @ a / 10)
    torch.testing.assert_close(v, b.t() @ b / 10)


def test_calibration_input_is_checked():
    model = TinyText()
    with pytest.raises(TypeError, match="iterable of model inputs"):
        tncompile.compile(model, 0.3, calibration=torch.zeros(2, SEQ, dtype=torch.long))
    with pytest.raises(ValueError, match="no batches"):
        tncompile.compile(model, 0.3, calibration=[])
    with pytest.raises(ValueError, match="init='svd'"):
        tncompile.compile(model, 0.3, init="random", calibration=[torch.zeros(2, SEQ, dtype=torch.long)])
    with pytest.raises(ValueError, match="needs|calibration="):
        tncompile.compile(model, 0.3, allocation="sensitivity")
    with pytest.raises(ValueError, match="allocation must be"):
        tncompile.compile(model, 0.3, allocation="greedy")


# ---------------------------------------------------------------- layer fits (float64, against the dense matrices)
@pytest.mark.parametrize("cores_per_side", [1, 2])
def test_linear_fit_minimizes_the_output_error_it_reports(cores_per_side):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 36, generator=g, dtype=torch.float64)             # not low-rank
    x = torch.randn(500, 36, generator=g, dtype=torch.float64) * torch.logspace(0, -2, 36, dtype=torch.float64)
    moment = x.t() @ x / x.shape[0]
    layout = TTLayout.for_shape(36, 40, cores_per_side).with_ranks(4)
    result = fit_linear_cores(w, layout, moment, ridge=0.0)

    def out_err(cores):
        return float((x @ (w - tt_to_dense(cores, layout)).t()).pow(2).sum() / (x @ w.t()).pow(2).sum())
    assert result.svd_error == pytest.approx(out_err(tt_from_linear_weight(w, layout)), rel=1e-9)
    assert result.fit_error == pytest.approx(out_err(result.cores), rel=1e-9)
    assert result.fit_error < 0.7 * result.svd_error
    # never below the best rank-4 matrix in this metric: the truncated SVD of the whitened
    # weight W C^{1/2} (closed form); with one core a side the network is any rank-4 matrix
    vals, vecs = torch.linalg.eigh(moment)
    sv = torch.linalg.svdvals(w @ (vecs * vals.clamp_min(0).sqrt()) @ vecs.t())
    optimum = float(sv[4:].pow(2).sum() / sv.pow(2).sum())
    assert result.fit_error >= optimum * (1 - 1e-9)
    if cores_per_side == 1:
        assert result.fit_error == pytest.approx(optimum, rel=1e-6)


def test_table_fit_weights_rows_by_use():
    g = torch.Generator().manual_seed(2)
    table = torch.randn(120, 12, generator=g, dtype=torch.float64)
    counts = torch.zeros(120, dtype=torch.long)
    counts[:15] = 100                                                       # a few rows carry the text
    layout = TTMLayout.for_shape(120, 12, 2).with_ranks(3)
    result = fit_table_cores(table, layout, counts, uniform_share=0.05)
    svd = ttm_to_dense(ttm_from_embedding_weight(table, layout), layout)
    fitted = ttm_to_dense(result.cores, layout)

    def used_err(t):
        return float((t[:15] - table[:15]).pow(2).sum() / table[:15].pow(2).sum())
    assert result.fit_error < result.svd_error
    assert used_err(fitted) < 0.5 * used_err(svd)


def test_a_table_fit_gathers_no_half_table_copies(monkeypatch):
    """Issue 64 item 4: each step of a table fit multiplies the gathered half-table slices
    in one product (the native kernel on CPU) -- no ``index_select`` copy of either half
    table, whose rows x rank x columns traffic was most of a vocabulary's fit."""
    from tncompile.calibration import layer_fit
    calls = {"product": 0, "copies": 0}
    real_apply, real_select = layer_fit.GatheredProduct.apply, torch.Tensor.index_select

    def product(*args):
        calls["product"] += 1
        return real_apply(*args)

    def select(self, dim, index):
        if self.dim() == 3:  # a half table (M, N, r) / (M, r, N)
            calls["copies"] += 1
        return real_select(self, dim, index)
    monkeypatch.setattr(layer_fit.GatheredProduct, "apply", product)
    monkeypatch.setattr(torch.Tensor, "index_select", select)
    g = torch.Generator().manual_seed(2)
    table = torch.randn(120, 12, generator=g, dtype=torch.float64)
    counts = torch.zeros(120, dtype=torch.long)
    counts[:15] = 100
    result = fit_table_cores(table, TTMLayout.for_shape(120, 12, 2).with_ranks(3), counts, uniform_share=0.05)
    assert calls["product"] > 0 and calls["copies"] == 0 and result.fit_error < result.svd_error


class Chain(nn.Module):
    """``out = b(a(x))``; ``side`` runs but only feeds ``loss``, which sensitivity ignores."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 24, bias=False)
        self.b = nn.Linear(24, 8, bias=False)
        self.side = nn.Linear(16, 4)

    def forward(self, x):
        return {"loss": self.side(x).sum(), "out": self.b(self.a(x))}


@pytest.mark.parametrize("frozen", [False, True])
def test_output_sensitivity_is_the_jacobian_norm_it_estimates(frozen):
    torch.manual_seed(0)
    model = Chain().requires_grad_(not frozen)
    xs = [torch.randn(64, 16) for _ in range(8)]
    stats = collect_statistics(model, xs, progress=False, sensitivity=True)
    assert all(p.grad is None and p.requires_grad == (not frozen) for p in model.parameters())
    # b's output is the output: sum ||Y||^2 ||v||^2 / (numel ||F||^2) = 1 per batch, exactly
    assert stats.sensitivity_of(model.b.weight, "linear") == pytest.approx(len(xs), rel=1e-6)   # float32 products
    # a's: E ||v B||^2 = rows ||B||_F^2, so ||Y_a||^2 ||B||_F^2 / (24 ||F||^2) per batch
    with torch.no_grad():
        expected = sum(float(model.a(x).pow(2).sum() * model.b.weight.pow(2).sum()
                             / (24 * model(x)["out"].pow(2).sum())) for x in xs)
    assert stats.sensitivity_of(model.a.weight, "linear") == pytest.approx(expected, rel=0.15)
    assert stats.sensitivity_of(model.side.weight, "linear") == 0.0     # reaches only the loss
    plain = collect_statistics(model, xs, progress=False)
    assert plain.sensitivity_of(model.a.weight, "linear") is None
    torch.testing.assert_close(plain.moment_of(model.a.weight), stats.moment_of(model.a.weight))


class Branches(nn.Module):
    """Two equally hard layers; the output hardly sees the second."""

    def __init__(self):
        super().__init__()
        self.loud = nn.Linear(64, 64)
        self.quiet = nn.Linear(64, 64)

    def forward(self, x):
        return self.loud(x) + 0.05 * self.quiet(x)


def test_allocation_weighs_layers_by_how_much_the_output_sees_them():
    torch.manual_seed(0)
    model = Branches().eval()
    calib = [torch.randn(32, 64) for _ in range(4)]
    held = [torch.randn(64, 64) for _ in range(2)]
    # prefer="size": allocation is under test; the speed rule would keep the small quiet layer dense
    uniform = tncompile.compile(model, 0.3, calibration=calib, allocation="uniform", prefer="size")
    sens = tncompile.compile(model, 0.3, calibration=calib, prefer="size")
    ranks = {r.name: max(r.ranks) for r in sens.report().rows if r.ranks}
    assert ranks["loud"] > ranks["quiet"]
    assert uniform.ratio <= 0.3 and sens.ratio <= 0.3                  # the same target (uniform under-spends)
    assert output_error(sens, model, held) < 0.95 * output_error(uniform, model, held)
    summary = sens.program.calibration_summary
    assert summary["loud"]["output_weight"] > 0.99 > 0.01 > summary["quiet"]["output_weight"]


def test_error_curve_bounds_tt_svd_and_allocation_spends_the_budget_where_it_pays():
    from tncompile.calibration import allocate_by_sensitivity, candidate_ranks, error_curve
    g = torch.Generator().manual_seed(3)
    full = torch.randn(48, 40, generator=g, dtype=torch.float64)
    low = torch.randn(48, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 40, generator=g, dtype=torch.float64)
    layout = TTLayout.for_shape(40, 48, 2)
    ranks = candidate_ranks(20)
    curves = {"full": error_curve(full, layout, ranks)}
    for r, est in zip(ranks, curves["full"].errors):                 # TT-SVD's error bound, per bond
        lay = layout.with_ranks(r)
        actual = float((tt_to_dense(tt_from_linear_weight(full, lay), lay) - full).pow(2).sum() / full.pow(2).sum())
        assert actual <= est * (1 + 1e-4) + 1e-12  # (tt_svd uses a randomized SVD at small ranks)
    one_bond = TTLayout.for_shape(40, 48, 1)                         # one core a side: the bond is the matrix rank
    curves = {"full": error_curve(full, one_bond, ranks), "low": error_curve(low, one_bond, ranks)}
    assert curves["low"].errors[ranks.index(2)] < 1e-12 < curves["low"].errors[ranks.index(1)]
    budget = curves["full"].params[ranks.index(8)] + curves["low"].params[ranks.index(8)]
    chosen = allocate_by_sensitivity(curves, budget)
    assert chosen["low"] == 2 and chosen["full"] > 8
    spent = sum(c.params[c.ranks.index(chosen[n])] for n, c in curves.items())
    assert spent <= budget
    assert allocate_by_sensitivity(curves, 10) is None


# ---------------------------------------------------------------- compile(calibration=...)
@pytest.mark.parametrize("mode", ["graph", "swap"])
def test_calibrated_compile_beats_svd_on_unseen_inputs(pretrained, mode):
    model, calib, held = pretrained
    before = state_of(model)
    svd = tncompile.compile(model, 0.3, mode=mode)
    fitted = tncompile.compile(model, 0.3, mode=mode, calibration=calib, allocation="uniform")
    assert fitted.ratio == pytest.approx(svd.ratio)
    assert output_error(fitted, model, held) < 0.7 * output_error(svd, model, held)
    summary = fitted.program.calibration_summary
    assert set(summary) == {"emb", "fc1", "fc2"}
    assert all(s["fit_error"] < s["svd_error"] for s in summary.values())
    assert not hasattr(fitted.program, "context")          # covariances dropped after compiling
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_calibrated_compile_is_deterministic(pretrained):
    model, calib, _ = pretrained
    a = tncompile.compile(model, 0.3, calibration=calib, seed=3)
    b = tncompile.compile(model, 0.3, calibration=calib, seed=3)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_sensitivity_allocation_never_starves_a_layer_its_reader_needs(pretrained):
    """fc2 nearly rank 2: what fc1 feeds sees few directions, so the first-order output
    sensitivity of fc1 is small; without the rank floor fc1 got rank 1 and the output
    error was 5x uniform's."""
    model, calib, held = pretrained
    skewed = copy.deepcopy(model)
    with torch.no_grad():
        u, s, vh = torch.linalg.svd(skewed.fc2.weight, full_matrices=False)
        skewed.fc2.weight.copy_((u[:, :2] * s[:2]) @ vh[:2] + 1e-4 * torch.randn_like(skewed.fc2.weight))
    uniform = tncompile.compile(skewed, 0.25, calibration=calib, allocation="uniform")
    sens = tncompile.compile(skewed, 0.25, calibration=calib)
    assert sens.ratio <= 0.25 and uniform.ratio <= 0.25
    ranks = {r.name: max(r.ranks) for r in sens.report().rows if r.ranks}
    uniform_ranks = {r.name: max(r.ranks) for r in uniform.report().rows if r.ranks}
    assert ranks["fc2"] < uniform_ranks["fc2"]                         # the near-low-rank layer gives way
    assert ranks["fc1"] >= uniform_ranks["fc1"] * tncompile.tuning.SENSITIVITY_RANK_FLOOR
    assert output_error(sens, skewed, held) < 1.1 * output_error(uniform, skewed, held)
    text = str(sens.report())
    assert "calib. error" in text and "est." in text


# ---------------------------------------------------------------- gentle targets, traced batch
def test_gentle_targets_are_reachable(pretrained):
    model, _, _ = pretrained
    for target in (0.6, 0.8):
        compiled = tncompile.compile(model, target, prefer="size")
        assert 0.9 * target <= compiled.ratio <= target
        assert all(r.ratio <= 0.9 for r in compiled.report().rows if r.format.startswith("TT"))


def test_ranks_do_not_depend_on_the_batch_size_traced_with(pretrained):
    model, _, _ = pretrained
    ranks = []
    for batch in (2, 32):
        compiled = tncompile.compile(model, 0.3, example_inputs=(torch.zeros(batch, SEQ, dtype=torch.long),))
        ranks.append({r.name: r.ranks for r in compiled.report().rows})
    assert ranks[0] == ranks[1]


# ---------------------------------------------------------------- distillation and fixed-rank training
def unlabeled(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [zipf_ids(32, g) for _ in range(n)]


@pytest.mark.parametrize("mode", ["graph", "swap"])
def test_distillation_closes_the_gap_and_never_touches_the_teacher(pretrained, mode):
    model, _, held = pretrained
    before = state_of(model)
    student = tncompile.compile(model, 0.2, mode=mode)
    gates = [g for m in student.modules() if isinstance(m, tncompile.runtime.TNModule) for g in m.gates]
    assert tncompile.freeze_gates(student) == len({id(g) for g in gates}) > 0
    assert not any(g.requires_grad for g in gates)
    opt = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=3e-3)
    gap = output_error(student, model, held)
    history = tncompile.fit(student, unlabeled(8), None, opt, steps=40, teacher=model, progress=False)
    assert len(history.step) == 40 and history.stage[-1] == "fixed"
    assert output_error(student, model, held) < 0.5 * gap
    assert history.loss[-1] < history.loss[0]
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not model._forward_hooks and not any(m._forward_hooks for m in model.modules())
    assert all(float(g.min()) == float(g.max()) == 1.0 for m in student.modules()
               if isinstance(m, tncompile.runtime.TTLinear) for g in m.gates)  # frozen gates stayed


def test_distill_terms_mix_with_the_task_loss_by_name(pretrained):
    model, _, held = pretrained
    student = tncompile.compile(model, 0.2, mode="swap")
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(7)
    data = [(x, torch.randint(0, 4, (32,), generator=g)) for x in unlabeled(4)]
    spec = tncompile.Distill(logits=1.0, temperature=3.0, hidden={"fc2": "fc2"}, hidden_weight=0.5,
                             pool=lambda out, ids: out, pooled=0.5, task=0.1)
    history = tncompile.fit(student, data, F.cross_entropy, opt, steps=12, teacher=model, distill=spec,
                            progress=False)
    assert history.loss[-1] < history.loss[0]
    assert spec.logits == 1.0 and spec.output == 0.0          # the user's spec is not edited


class Block(nn.Module):
    def __init__(self, dim=96):
        super().__init__()
        self.mix = nn.Linear(dim, dim)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(2)])

    def forward(self, h):
        h = h + torch.tanh(self.mix(h))
        return h + sum(e(h) for e in self.experts) / 2


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 96)
        self.layers = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Sequential(nn.Linear(96, 96), nn.Linear(96, 4))   # same-class leaves: not blocks

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def test_hidden_blocks_match_every_layer_of_the_stack_by_name():
    from tncompile.train.distill import Teacher, block_names
    torch.manual_seed(0)
    teacher = Stack().eval()
    assert block_names(teacher) == ["layers.0", "layers.1", "layers.2"]   # experts inside a block are not blocks
    student = tncompile.compile(teacher, 0.3, mode="swap")
    spec = tncompile.Distill(hidden_blocks=True)
    recorder = Teacher(teacher, student, spec)
    try:
        assert recorder.spec.pairs == {f"layers.{i}": f"layers.{i}" for i in range(3)}
        rec = recorder.record(unlabeled(1)[0])
        assert set(rec) == {"output", "hidden"} and set(rec["hidden"]) == {"layers.0", "layers.1", "layers.2"}
    finally:
        recorder.close()
    assert not spec.pairs and not any(m._forward_hooks for m in teacher.modules())
    opt = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=3e-3)
    history = tncompile.fit(student, unlabeled(4), None, opt, steps=16, teacher=teacher, distill=spec,
                            progress=False)
    assert history.loss[-1] < history.loss[0]
    graph = tncompile.compile(teacher, 0.3)
    with pytest.raises(ValueError, match="'layers.0' did not run.*mode='swap'"):
        tncompile.fit(graph, unlabeled(1), None, opt, steps=1, teacher=teacher, distill=spec, progress=False)
    assert not any(m._forward_hooks for m in teacher.modules())


def test_padding_does_not_count_in_output_and_hidden_terms():
    from tncompile.train.distill import Teacher, distill_loss
    teacher_out = torch.randn(2, 5, 8)
    student_out = teacher_out.clone()
    student_out[0, 3:] += 10.0                                         # wrong only where sentence 0 is padded
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    inputs = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": mask}

    class Stub(nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return teacher_out

    for masked, expect_zero in ((True, True), (False, False)):
        spec = tncompile.Distill(output=1.0, mask_padding=masked)
        guide = Teacher(Stub(), nn.Linear(1, 1), spec)
        try:
            value = float(distill_loss(guide, None)(student_out, (None, guide.record(inputs), inputs)))
        finally:
            guide.close()
        assert (value == 0.0) == expect_zero
    unmasked = {"input_ids": inputs["input_ids"]}                       # no attention_mask: every position
    guide = Teacher(Stub(), nn.Linear(1, 1), tncompile.Distill(output=1.0))
    assert float(distill_loss(guide, None)(student_out, (None, guide.record(unmasked), unmasked))) > 0
    guide.close()


def test_graph_mode_names_a_module_that_does_not_run(pretrained):
    model, _, _ = pretrained
    wrapped = nn.Sequential(model)
    student = tncompile.compile(wrapped, 0.3)
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="did not run.*mode='swap'"):
        tncompile.fit(student, unlabeled(1), None, opt, steps=1, teacher=wrapped,
                      distill=tncompile.Distill(hidden=["0"]), progress=False)
    assert not any(m._forward_hooks for m in wrapped.modules())


def test_fit_arguments_are_checked(pretrained):
    model, _, _ = pretrained
    student = tncompile.compile(model, 0.3)
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="steps=N"):
        tncompile.fit(student, unlabeled(1), None, opt, None, 5, 5, teacher=model)
    with pytest.raises(ValueError, match="steps="):
        tncompile.fit(student, unlabeled(1), None, opt, teacher=model)
    with pytest.raises(ValueError, match="teacher to distill"):
        tncompile.fit(student, unlabeled(1), None, opt, steps=1)
    with pytest.raises(ValueError, match="is the student itself"):
        tncompile.fit(student, unlabeled(1), None, opt, steps=1, teacher=student)
    inplace = tncompile.compile(copy.deepcopy(model), 0.3, inplace=True, mode="swap")
    with pytest.raises(ValueError, match="is the student itself|shares parameters"):
        tncompile.fit(inplace, unlabeled(1), None, opt, steps=1, teacher=inplace)
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        tncompile.Distill(logits=-1)
    with pytest.raises(ValueError, match="pool="):
        tncompile.Distill(pooled=1.0)
    tncompile.freeze_gates(student)
    ctl_opt = torch.optim.Adam(tncompile.param_groups(student, lr=1e-3))
    ctl = tncompile.RankController(student, ctl_opt, target_ratio=0.2, early_steps=1, late_steps=1)
    with pytest.raises(ValueError, match="rank gates of .* are frozen"):
        tncompile.fit(student, unlabeled(1), None, ctl_opt, ctl, 1, 1, teacher=model)


def test_distilling_while_the_controller_cuts_ranks_checkpoints_and_resumes(pretrained, tmp_path):
    model, _, held = pretrained
    student = tncompile.compile(model, 0.3)
    opt = torch.optim.AdamW(tncompile.param_groups(student, lr=3e-3, gate_lr=3e-2))
    ctl = tncompile.RankController(student, opt, target_ratio=0.15, early_steps=6, late_steps=18, truncate_every=3)
    data = unlabeled(6)
    history = tncompile.fit(student, data, None, opt, ctl, 6, 18, teacher=model, progress=False,
                            checkpoint_path=tmp_path / "ck.tnc", checkpoint_every=12)
    assert any(e["kind"] == "truncation" for e in history.events)
    assert student.ratio < 0.3
    loaded = tncompile.load(tmp_path / "ck.tnc", model=TinyText())
    opt2 = torch.optim.AdamW(tncompile.param_groups(loaded, lr=3e-3, gate_lr=3e-2))
    ctl2 = tncompile.RankController(loaded, opt2, target_ratio=0.15, early_steps=6, late_steps=18,
                                    truncate_every=3)
    extra = tncompile.resume(loaded, opt2, ctl2)
    rest = tncompile.fit(loaded, data, None, opt2, ctl2, 6, 18, teacher=model, progress=False,
                         history=extra["history"])
    assert rest.step[-1] == 24 and ctl2.steps_done == 24


def test_fixed_rank_checkpoints_resume_where_they_stopped(pretrained, tmp_path):
    model, _, _ = pretrained
    student = tncompile.compile(model, 0.3)
    tncompile.freeze_gates(student)
    opt = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=1e-3)
    tncompile.fit(student, unlabeled(3), None, opt, steps=4, teacher=model, progress=False,
                  checkpoint_path=tmp_path / "ck.tnc", checkpoint_every=4)
    loaded = tncompile.load(tmp_path / "ck.tnc", model=TinyText())
    tncompile.freeze_gates(loaded)
    opt2 = torch.optim.Adam([p for p in loaded.parameters() if p.requires_grad], lr=1e-3)
    extra = tncompile.resume(loaded, opt2)
    history = tncompile.fit(loaded, unlabeled(3), None, opt2, steps=7, teacher=model, progress=False,
                            history=extra["history"])
    assert history.step == list(range(1, 8))


# ---------------------------------------------------------------- one call
def test_compress_pretrained_keeps_the_class_and_recovers(pretrained):
    model, calib, held = pretrained
    before = state_of(model)
    svd = tncompile.compile(model, 0.2)
    history = tncompile.History()
    small = tncompile.compress_pretrained(model, 0.2, calib, steps=30, calibration_batches=4, lr=3e-3,
                                          history=history, progress=False)
    assert type(small).__name__ == "TinyText" and isinstance(small, TinyText)
    assert small.ratio <= 0.2 and len(history.step) == 30
    assert output_error(small, model, held) < 0.5 * output_error(svd, model, held)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(TypeError, match="re-iterable"):
        tncompile.compress_pretrained(model, 0.2, iter(calib))


def test_a_sampled_table_fit_stops_where_held_out_rows_stop_improving():
    """Issue 64 item 4: a table too large to fit whole is fit on its used rows and a sample of
    the rest. Fitting that sample ever closer overfits it; the fit judges every few iterations
    on other rows, stops once they stop improving, and ends no worse than running all
    iterations."""
    g = torch.Generator().manual_seed(3)
    layout = TTMLayout.for_shape(6000, 32, 4).with_ranks(12)
    # a table with structure a network can learn, plus noise it cannot
    structured = ttm_to_dense([torch.randn(k.shape, generator=g, dtype=torch.float64) for k in
                               ttm_from_embedding_weight(torch.randn(6000, 32, generator=g, dtype=torch.float64),
                                                         layout)], layout)
    table = structured / structured.std() + 0.5 * torch.randn(6000, 32, generator=g, dtype=torch.float64)
    counts = torch.zeros(6000, dtype=torch.long)
    counts[torch.randperm(6000, generator=g)[:300]] = torch.randint(1, 50, (300,), generator=g)
    judged = fit_table_cores(table, layout, counts, sample_rows=256, held_out_rows=512)
    unjudged = fit_table_cores(table, layout, counts, sample_rows=256, held_out_rows=0)
    assert unjudged.iterations > judged.iterations
    assert judged.fit_error < judged.svd_error
    assert judged.fit_error <= unjudged.fit_error * 1.01, (judged.fit_error, unjudged.fit_error)


def test_layers_fed_the_same_input_share_one_factorization(monkeypatch):
    """Issue 64 item 4: the moment's square root (the allocation's whitening and the fit's
    closed-form start; a Cholesky factor, no eigendecomposition) is computed once per
    distinct input, not per layer and pass."""
    from tncompile.calibration import layer_fit
    calls = []
    real = torch.linalg.cholesky
    monkeypatch.setattr(layer_fit.torch.linalg, "cholesky", lambda m: calls.append(m.shape) or real(m))

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(64, 64) for _ in range(3))
            self.out = nn.Linear(64, 64)

        def forward(self, x):
            return self.out(self.q(x) * self.k(x) + self.v(x))
    torch.manual_seed(0)
    data = [torch.randn(64, 64) for _ in range(4)]
    tncompile.compile(QKV(), 0.5, example_inputs=(data[0],), calibration=data)
    assert len(calls) == 2, calls        # one for q, k and v's shared input, one for out's


def test_the_nearest_matrix_at_a_rank_is_the_same_by_any_square_root_of_the_moment():
    """The closed-form start: the rank-r matrix nearest W in tr(D C D^T) found with the
    Cholesky factor equals the one found with the symmetric root (eigendecomposition), and
    no rank-r matrix tried is nearer."""
    from tncompile.calibration import layer_fit
    torch.manual_seed(0)
    w = torch.randn(24, 16, dtype=torch.float64)
    x = torch.randn(200, 16, dtype=torch.float64) * torch.linspace(0.1, 3.0, 16, dtype=torch.float64)
    moment = x.t() @ x / 200
    root = layer_fit.normalized_root(moment)
    c_r = root @ root.t()
    vals, vecs = torch.linalg.eigh(c_r)
    symmetric = (vecs * vals.sqrt()) @ vecs.t()
    u, s, vh = torch.linalg.svd(w @ symmetric, full_matrices=False)
    by_eigh = (u[:, :5] * s[:5]) @ vh[:5] @ torch.linalg.inv(symmetric)
    nearest = layer_fit._best_at_bond(w, root, 5)
    torch.testing.assert_close(nearest, by_eigh, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(layer_fit._best_at_bond(w.t().contiguous(), layer_fit.normalized_root(
        torch.eye(24, dtype=torch.float64)), 5), torch.linalg.svd(w.t(), full_matrices=False)[0][:, :5]
        @ torch.linalg.svd(w.t(), full_matrices=False)[0][:, :5].t() @ w.t(), rtol=1e-8, atol=1e-10)  # wide side

    def err(m):
        d = w - m
        return float(((d @ c_r) * d).sum())
    for _ in range(20):
        other = nearest + 1e-2 * torch.randn(24, 5, dtype=torch.float64) @ torch.randn(5, 16, dtype=torch.float64)
        u, s, vh = torch.linalg.svd(other, full_matrices=False)
        assert err((u[:, :5] * s[:5]) @ vh[:5]) >= err(nearest) - 1e-9
