"""``nn.EmbeddingBag`` as a TTM network: every mode and bag form against the
dense bag of the same table, gradients included, and a DLRM compiled to 0.1."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.runtime import CollapsedLayer, TTMEmbeddingBag

from full_rank import compile_full_rank, full_rank_pipeline

f64 = torch.float64


def _bag(mode, rank=3, include_last_offset=False, padding_idx=None, dtype=f64):
    dense = nn.EmbeddingBag(60, 12, mode=mode, include_last_offset=include_last_offset, padding_idx=padding_idx,
                            dtype=dtype)
    return TTMEmbeddingBag.from_embedding_bag(dense, rank=rank, num_cores=2, init="random",
                                              generator=torch.Generator().manual_seed(0))


CASES = {  # name -> (input, offsets, per_sample_weights needed)
    "2d": (torch.tensor([[1, 5, 7], [7, 7, 59], [0, 3, 2]]), None),
    "offsets": (torch.tensor([4, 9, 9, 31, 2, 0, 58]), torch.tensor([0, 2, 2, 5])),  # bag 1 is empty
}


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("form", list(CASES))
@pytest.mark.parametrize("padding_idx", [None, 7])
def test_bag_matches_dense_bag_forward_and_gradients(mode, form, padding_idx):
    tt = _bag(mode, padding_idx=padding_idx)
    ids, offsets = CASES[form]
    out = tt(ids, offsets)
    table = tt.weight()
    ref = F.embedding_bag(ids, table, offsets, mode=mode, padding_idx=padding_idx)
    torch.testing.assert_close(out, ref)
    # gradients reach the cores as through the dense table they stand for
    probe = torch.randn_like(ref)
    got = torch.autograd.grad((out * probe).sum(), list(tt.cores))
    want = torch.autograd.grad((F.embedding_bag(ids, tt.weight(), offsets, mode=mode, padding_idx=padding_idx)
                                * probe).sum(), list(tt.cores))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_per_sample_weights_and_include_last_offset():
    tt = _bag("sum", include_last_offset=True)
    ids, offsets = torch.tensor([4, 9, 9, 31, 2]), torch.tensor([0, 2, 2, 5])  # 3 bags, the last offset is the end
    weights = torch.rand(5, dtype=f64, requires_grad=True)
    out = tt(ids, offsets, per_sample_weights=weights)
    ref = F.embedding_bag(ids, tt.weight(), offsets, mode="sum", per_sample_weights=weights, include_last_offset=True)
    torch.testing.assert_close(out, ref)
    assert out.shape == (3, 12)
    g_tt, = torch.autograd.grad(out.sum(), weights)
    g_ref, = torch.autograd.grad(ref.sum(), weights)
    torch.testing.assert_close(g_tt, g_ref)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_gradcheck_of_cores_and_gates(mode):
    tt = _bag(mode, rank=2)
    ids, offsets = CASES["offsets"]
    params = [*tt.cores, *tt.gates]

    def run(*values):
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
        return tt(ids, offsets)

    def fn(*values):  # functional: swap the parameters for the inputs
        cores, gates = values[:len(tt.cores)], values[len(tt.cores):]
        saved = list(tt.cores), list(tt.gates)
        for k, c in enumerate(cores):
            tt.cores._parameters[str(k)] = c
        for k, g in enumerate(gates):
            tt.gates._parameters[str(k)] = g
        try:
            return tt(ids, offsets)
        finally:
            for k, c in enumerate(saved[0]):
                tt.cores._parameters[str(k)] = c
            for k, g in enumerate(saved[1]):
                tt.gates._parameters[str(k)] = g

    inputs = [p.detach().clone().requires_grad_(True) for p in params]
    if mode == "max":  # max picks one row per column: keep the values apart so the choice is stable
        inputs = [(i * 3).detach().requires_grad_(True) for i in inputs]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)


def test_bad_bag_inputs_are_named():
    tt = _bag("mean")
    with pytest.raises(ValueError, match="per_sample_weights needs mode='sum'"):
        tt(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2, dtype=f64))
    with pytest.raises(ValueError, match="offsets must be None for a 2-D input"):
        tt(torch.tensor([[1, 2]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="a 1-D input needs 1-D offsets"):
        tt(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="mode must be one of"):
        TTMEmbeddingBag(tt.layout, mode="median")


# ---------------------------------------------------------------- a DLRM
TABLES = (20000, 5000, 30000, 1000)


class DLRM(nn.Module):
    """Criteo-style: 13 dense features through a bottom MLP, 4 categorical
    features through embedding bags, pairwise dot products, a top MLP."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in TABLES)
        self.pairs = (len(TABLES) + 1) * len(TABLES) // 2
        self.top = nn.Sequential(nn.Linear(dim + self.pairs, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense, ids, offsets):
        x = self.bottom(dense)
        features = torch.stack([x] + [bag(ids[k], offsets[k]) for k, bag in enumerate(self.bags)], 1)
        dots = torch.bmm(features, features.transpose(1, 2))
        n = len(self.bags) + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        return self.top(torch.cat([x, dots[:, rows, cols]], 1)).squeeze(-1)


def _batch(batch=32, per_bag=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, 13, generator=g)
    ids = torch.stack([torch.randint(0, n, (batch * per_bag,), generator=g) for n in TABLES])
    offsets = torch.arange(0, batch * per_bag, per_bag).expand(len(TABLES), -1).contiguous()
    label = (dense[:, 0] > 0).float()
    return (dense, ids, offsets), label


def test_dlrm_reaches_a_tenth_and_trains():
    torch.manual_seed(0)
    model = DLRM()
    inputs, label = _batch()
    compiled = tncompile.compile(model, target_ratio=0.1)
    assert compiled.ratio <= 0.1
    layers = compiled.tensorized_modules()
    assert all(isinstance(layers[f"bags.{k}"], TTMEmbeddingBag) for k in range(len(TABLES)))
    assert "TTM" in str(compiled.report())
    opt = torch.optim.AdamW(compiled.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = F.binary_cross_entropy_with_logits(compiled(*inputs), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    dense = compiled.to_dense()
    assert isinstance(dense.get_submodule("bags.0"), nn.EmbeddingBag)
    torch.testing.assert_close(dense(*inputs), compiled(*inputs), rtol=1e-5, atol=1e-5)


def test_dlrm_at_full_rank_equals_the_original(tmp_path):
    model = DLRM().double()
    inputs, _ = _batch()
    inputs = (inputs[0].double(), *inputs[1:])
    compiled = compile_full_rank(model, None)
    torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-9, atol=1e-9)
    tncompile.save(compiled, tmp_path / "dlrm.tnc")
    with pytest.raises(tncompile.ModelFileError, match=r"the file ran \['full_ranks'\]"):
        tncompile.load(tmp_path / "dlrm.tnc", model=DLRM().double())
    again = tncompile.load(tmp_path / "dlrm.tnc", model=DLRM().double(),
                           passes=full_rank_pipeline())  # the pipeline it was compiled with
    assert torch.equal(again(*inputs), compiled(*inputs))


def test_rank_adaptation_cuts_and_collapses_bags():
    torch.manual_seed(0)
    compiled = tncompile.compile(DLRM(), target_ratio=0.1)
    inputs, label = _batch()
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.05, allow_layer_removal=True)
    with torch.no_grad():
        ctl.layers["bags.1"].gates[0].zero_()            # every rank of a bond off: the bag collapses
        ctl.layers["bags.0"].gates[1][5:] = 0.0          # half a bond off: cut
    before = compiled(*inputs)
    event = ctl.truncate()
    assert event.removed == ["bags.1"] and "bags.0" in event.truncated
    assert isinstance(compiled.model.get_submodule("bags.1"), CollapsedLayer)
    torch.testing.assert_close(compiled(*inputs), before, rtol=1e-5, atol=1e-5)
    loss = F.binary_cross_entropy_with_logits(compiled(*inputs), label)
    loss.backward()
    opt.step()


class BagsThroughExport(nn.Module):
    """fx cannot trace it (a branch on a shape), so tncompile uses torch.export."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(5000, 16, mode="sum")
        self.fixed = nn.EmbeddingBag(3000, 16, mode="mean")

    def forward(self, ids, offsets, weights, fixed_ids):
        out = self.bag(ids, offsets, per_sample_weights=weights) + self.fixed(fixed_ids)
        return out if fixed_ids.shape[-1] > 1 else -out


def test_bags_are_outlined_from_an_export_trace():
    model = BagsThroughExport().double()
    g = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 5000, (12,), generator=g), torch.tensor([0, 3, 3, 8]),
            torch.rand(12, generator=g, dtype=f64), torch.randint(0, 3000, (4, 3), generator=g))
    compiled = compile_full_rank(model, args)
    assert compiled.program.inputs.frontend == "export"
    layers = compiled.tensorized_modules()
    assert isinstance(layers["bag"], TTMEmbeddingBag) and isinstance(layers["fixed"], TTMEmbeddingBag)
    torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-9, atol=1e-9)
    other = (torch.randint(0, 5000, (7,), generator=g), torch.tensor([0, 2, 7]), torch.rand(7, generator=g, dtype=f64),
             torch.randint(0, 3000, (3, 3), generator=g))
    torch.testing.assert_close(compiled(*other), model(*other), rtol=1e-9, atol=1e-9)


OFFSET_CASES = {  # name -> offsets for the 5 ids [4, 9, 9, 31, 2]
    "ok": torch.tensor([0, 2]),
    "ends-early": torch.tensor([0, 2, 3]),            # with include_last_offset: ids 3.. belong to no bag
    "last-is-the-end": torch.tensor([0, 2, 5]),
    "int32": torch.tensor([0, 2], dtype=torch.int32),
    "empty-bags": torch.tensor([0, 0, 2, 2]),
    "beyond-the-input": torch.tensor([0, 7]),
    "first-not-zero": torch.tensor([1, 3]),
    "negative": torch.tensor([0, -1]),
    "unsorted": torch.tensor([0, 3, 2]),
    "float": torch.tensor([0.0, 2.0]),
    "2-d": torch.tensor([[0, 2]]),
    "none": torch.tensor([], dtype=torch.long),
}


ACCEPTED = {"ok", "ends-early", "last-is-the-end", "int32", "empty-bags", "none"}  # by nn.EmbeddingBag (CPU)


@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("mode", ["sum", "max"])
@pytest.mark.parametrize("case", list(OFFSET_CASES))
def test_offsets_are_checked_and_reduced_as_nn_embedding_bag_does(case, mode, include_last_offset):
    """Every offsets tensor nn.EmbeddingBag accepts gives its result; every one it rejects is an
    error naming TTMEmbeddingBag. (The rejected ones are not run through nn.EmbeddingBag here:
    negative or unsorted offsets make it read out of bounds, or crash the process.)"""
    tt = _bag(mode, include_last_offset=include_last_offset)
    ids, offsets = torch.tensor([4, 9, 9, 31, 2]), OFFSET_CASES[case]
    accepted = case in ACCEPTED and not (case == "none" and include_last_offset)
    if not accepted:
        with pytest.raises((ValueError, TypeError), match="TTMEmbeddingBag"):
            tt(ids, offsets)
        return
    if case == "none":  # no bags; nn.EmbeddingBag returns (0, D) here, or crashes reading past them
        assert tt(ids, offsets).shape == (0, 12)
        return
    want = tt.to_dense_module()(ids, offsets)
    torch.testing.assert_close(tt(ids, offsets), want)
