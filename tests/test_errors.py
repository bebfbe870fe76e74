"""Bad input: a clear error naming the argument or module, and the user's model untouched."""
import math

import pytest
import torch
from torch import nn

import tncompile
from tncompile.testing import mlp, small_encoder


@pytest.fixture
def model():
    m = mlp((64, 128, 10))
    m._snap = {k: v.clone() for k, v in m.state_dict().items()}
    yield m
    sd = m.state_dict()
    assert all(torch.equal(sd[k], m._snap[k]) for k in sd), "user's model was mutated"
    assert isinstance(m[0], nn.Linear)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, math.nan])
def test_bad_ratio_values(model, bad):
    with pytest.raises(ValueError, match="target_ratio must be in"):
        tncompile.compile(model, target_ratio=bad)


@pytest.mark.parametrize("bad", ["0.1", None, True])
def test_ratio_not_a_number(model, bad):
    with pytest.raises(TypeError, match="target_ratio must be a number"):
        tncompile.compile(model, target_ratio=bad)


def test_infeasible_ratio_names_smallest(model):
    with pytest.raises(ValueError, match=r"smallest possible ratio is 0\.\d+"):
        tncompile.compile(model, target_ratio=1e-5)


def test_target_modules_entry_matching_nothing(model):
    with pytest.raises(ValueError, match="target_modules entry 'attn' matches no compressible module"):
        tncompile.compile(model, target_ratio=0.3, target_modules=["attn"])
    with pytest.raises(ValueError, match="exclude_modules entry 're:foo.*'"):
        tncompile.compile(model, target_ratio=0.3, exclude_modules="re:foo.*")


def test_unknown_pass_name(model):
    with pytest.raises(ValueError, match="unknown pass 'tensorise'.*registered passes: .*tensorize"):
        tncompile.compile(model, target_ratio=0.3, passes=["tensorise"])


def test_pass_that_raises_is_named(model):
    class Broken(tncompile.Pass):
        name = "broken-pass"

        def run(self, program):
            raise RuntimeError("kaboom")

    pipe = tncompile.default_pipeline().insert_after("tensorize", Broken())
    with pytest.raises(tncompile.PassError, match="pass 'broken-pass' failed: RuntimeError: kaboom"):
        tncompile.compile(model, target_ratio=0.3, passes=pipe)


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
            return self.lin(x)
        return -self.lin(x)


def test_untraceable_without_example_inputs():
    m = Untraceable()
    with pytest.raises(tncompile.TraceError, match="torch.fx could not trace Untraceable.*Pass example_inputs"):
        tncompile.compile(m, target_ratio=0.5)
    assert isinstance(m.lin, nn.Linear)


class ShapeBranch(nn.Module):
    """fx cannot branch on a shape; torch.export can (it guards on it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        if x.shape[-1] == 64:
            return self.lin(x)
        return x


def test_untraceable_with_example_inputs_uses_export():
    m = ShapeBranch()
    c = tncompile.compile(m, mode="graph", target_ratio=0.5, example_inputs=(torch.randn(3, 64),))
    assert c.program.inputs.frontend == "export"
    assert c(torch.randn(5, 64)).shape == (5, 64)


def test_example_inputs_that_do_not_fit(model):
    with pytest.raises(ValueError, match="example_inputs do not fit Sequential"):
        tncompile.compile(model, target_ratio=0.3, example_inputs=(torch.randn(2, 65),))
    with pytest.raises(TypeError, match="example_inputs must be"):
        tncompile.compile(model, target_ratio=0.3, example_inputs="x")


def test_neither_tracer_works():
    with pytest.raises(tncompile.TraceError, match="torch.fx failed .* and torch.export"):
        tncompile.compile(Untraceable(), target_ratio=0.5, example_inputs=(torch.randn(3, 64),))


def test_nothing_to_compress():
    m = nn.Sequential(nn.ReLU(), nn.LayerNorm(8))
    with pytest.raises(ValueError, match="nothing to compress"):
        tncompile.compile(m, target_ratio=0.5)


def test_not_a_module():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        tncompile.compile(lambda x: x, target_ratio=0.5)


class WithEmbeddings(nn.Module):
    def __init__(self, **emb_kwargs):
        super().__init__()
        self.emb = nn.Embedding(2000, 64, **emb_kwargs)
        self.lin = nn.Linear(64, 256)

    def forward(self, ids):
        return self.lin(self.emb(ids))


def test_embedding_max_norm_left_dense_with_reason():
    c = tncompile.compile(WithEmbeddings(max_norm=1.0), target_ratio=0.95)
    assert isinstance(c.model.emb, nn.Embedding)
    assert "max_norm" in c.program.notes["emb"] and "max_norm" in str(c.report())


@pytest.mark.parametrize("bag", [False, True])
def test_a_sparse_gradient_table_is_compressed_with_dense_core_gradients_and_a_note(bag):
    """A recommender's ``sparse=True`` table compiles unedited: the compressed table's gradient
    is its cores' (dense, small); the note names the optimizers that fit it."""
    from tncompile.runtime.layers.embedding_bag import TTMEmbeddingBag
    from tncompile.runtime.layers.ttm_embedding import TTMEmbedding

    class Tables(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = (nn.EmbeddingBag(4096, 16, mode="sum", sparse=True) if bag
                        else nn.Embedding(4096, 16, sparse=True))
            self.lin = nn.Linear(16, 4)

        def forward(self, ids):
            return self.lin(self.emb(ids, torch.arange(ids.numel())) if bag else self.emb(ids))

    model = Tables()
    ids = torch.randint(0, 4096, (8,))
    c = tncompile.compile(model, target_ratio=0.1, example_inputs=(ids,))
    assert isinstance(c.model.emb, TTMEmbeddingBag if bag else TTMEmbedding)
    note = c.program.notes["emb"]
    assert "sparse=True" in note and "SparseAdam" in note and "sparse=True" in str(c.report())
    c(ids).sum().backward()
    grads = [p.grad for p in c.model.emb.parameters()]
    assert grads and all(g is not None and not g.is_sparse for g in grads)
    torch.optim.Adagrad(c.parameters(), lr=0.1).step()     # the optimizers a DLRM user takes fit it
    assert model.emb.sparse and model.emb.weight.grad is None   # the user's model is untouched


def test_the_speed_estimate_of_a_sparse_table_has_no_table_sized_gradient():
    """The report weighs a compressed table against its dense form as the user trains it:
    with ``sparse=True`` that step touches the looked-up rows only, not the whole table."""
    from tncompile.planning import DeviceSpeed, lookup_step_seconds
    from tncompile.planning.speed_model import REFERENCE
    from tncompile.formats import TTMLayout
    layout = TTMLayout.for_shape(1_000_000, 16, 4, ranks=16)
    speed = REFERENCE if isinstance(REFERENCE, DeviceSpeed) else DeviceSpeed.from_dict(REFERENCE)
    network, dense = lookup_step_seconds(layout, 128, speed)
    same_network, sparse_dense = lookup_step_seconds(layout, 128, speed, sparse=True)
    assert same_network == network and sparse_dense < dense / 20
    table_bytes = 2 * 1_000_000 * 16 * 4
    assert dense - sparse_dense == pytest.approx((table_bytes - 2 * 128 * 16 * 4) / speed.copy_bytes_per_s)
    class Bags(nn.Module):
        def __init__(self, sparse):
            super().__init__()
            self.bag = nn.EmbeddingBag(100_000, 16, mode="sum", sparse=sparse)

        def forward(self, ids, offsets):
            return self.bag(ids, offsets)
    rows = []
    for sparse in (True, False):
        c = tncompile.compile(Bags(sparse), target_ratio=0.1,
                              example_inputs=(torch.randint(0, 100_000, (64,)), torch.arange(0, 64, 2)))
        rows.append(next(r for r in c.report().rows if r.format == "TTM"))
    assert rows[0].time_dense < rows[1].time_dense / 10 and rows[0].time_now == pytest.approx(rows[1].time_now)


def test_wrong_call_structure_after_export():
    m = ShapeBranch()
    c = tncompile.compile(m, mode="graph", target_ratio=0.5, example_inputs=(torch.randn(3, 64),))
    with pytest.raises(TypeError, match="traced with 1 positional input"):
        c(torch.randn(3, 64), torch.randn(3, 64))


def test_bad_init_and_rank_pattern(model):
    with pytest.raises(ValueError, match="init must be"):
        tncompile.compile(model, target_ratio=0.3, init="zeros")
    with pytest.raises(ValueError, match="rank_pattern"):
        tncompile.compile(model, target_ratio=0.3, rank_pattern={"0": 0})


def test_save_rejects_non_compiled(tmp_path):
    with pytest.raises(TypeError, match="expects a model tncompile.compile returned"):
        tncompile.save(small_encoder(), tmp_path / "x")
    (tmp_path / "junk").write_bytes(b"")
    torch.save({"a": 1}, tmp_path / "junk")
    with pytest.raises(tncompile.ModelFileError, match="not a tncompile file"):
        tncompile.load(tmp_path / "junk", model=small_encoder())


@pytest.mark.parametrize("kw", [{}, {"linear_cores": 16}, {"exclude_modules": "all"}])
def test_nothing_tensorizable_is_an_error_not_ratio_one(kw):
    """Only small layers, too many cores, or everything excluded: the target cannot be
    met, and compile says why instead of returning the model at ratio 1.0."""
    small = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model = small if not kw else mlp((64, 128, 10))
    with pytest.raises(ValueError, match=r"no layer could be tensorized, so the model stays at ratio 1.*: "):
        tncompile.compile(model, target_ratio=0.1, **kw)
