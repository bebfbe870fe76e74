"""The ops a TT layer traces as under torch.compile: tncompile::gate_cores and tncompile::ttm_lookup.

Each against what it stands for (the eager layer, the dense table), float64
gradcheck, ``torch.library.opcheck`` (fake kernel, autograd registration,
schema), with and without the native kernels, and on fake tensors.
"""
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tncompile.runtime import TTMEmbedding
from tncompile.runtime.kernels.gated_cores import gate_cores
from tncompile.runtime.native import native_kernels
from tncompile.runtime.kernels.traced_lookup import ttm_lookup

f64 = torch.float64


def _embedding(num_cores: int, padding_idx, rank: int = 5) -> TTMEmbedding:
    torch.manual_seed(0)
    layer = TTMEmbedding.from_embedding(nn.Embedding(1000, 48, padding_idx=padding_idx).double(), rank=rank,
                                        num_cores=num_cores)
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.5, 1.5)  # gates away from one, so a dropped gate shows
    return layer


def _ids(n: int) -> torch.Tensor:
    ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(1))
    ids[:5] = 3  # repeats (deduplicated inside) and the padding row
    return ids


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("num_cores", [2, 3, 4, 5])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_ttm_lookup_matches_the_layer_at_every_split(num_cores, padding_idx, native):
    layer = _embedding(num_cores, padding_idx)
    ids = _ids(300)
    cores, gates = list(layer.cores), list(layer.gates)
    table = layer.weight().detach()
    with native_kernels(native):
        reference = layer(ids)
        for split in range(1, num_cores):
            out = ttm_lookup(ids, cores, gates, split, 1000, 48, padding_idx)[0]
            torch.testing.assert_close(out, table[ids])  # the padding row too, as nn.Embedding returns it
            grad = torch.randn_like(out)
            got = torch.autograd.grad(out, cores + gates, grad)
            want = torch.autograd.grad(reference, cores + gates, grad, retain_graph=True)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)


@pytest.mark.parametrize("num_cores", [2, 4, 5])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_ttm_lookup_gradcheck_and_opcheck(num_cores, padding_idx):
    layer = _embedding(num_cores, padding_idx, rank=3)
    ids = _ids(20)
    if padding_idx is not None:  # padding positions send no gradient on purpose: not the derivative
        ids = ids[ids != padding_idx]
    params = tuple(layer.cores) + tuple(layer.gates)
    split = num_cores // 2

    def lookup(*p):
        return ttm_lookup(ids, list(p[:num_cores]), list(p[num_cores:]), split, 1000, 48, padding_idx)[0]
    assert torch.autograd.gradcheck(lookup, params)
    torch.library.opcheck(torch.ops.tncompile.ttm_lookup.default,
                          (ids, list(layer.cores), list(layer.gates), split, 1000, 48, padding_idx))


def test_ttm_lookup_padding_positions_send_no_gradient():
    layer = _embedding(4, 3)
    ids = torch.tensor([3, 3, 3])
    out = ttm_lookup(ids, list(layer.cores), list(layer.gates), 2, 1000, 48, 3)[0]
    torch.testing.assert_close(out, layer.weight().detach()[ids])
    grads = torch.autograd.grad(out.sum(), list(layer.cores) + list(layer.gates))
    assert all(not g.any() for g in grads)


def test_ttm_lookup_checks_ids_at_run_time():
    layer = _embedding(4, None)
    with pytest.raises(IndexError, match="id 1000 out of range"):
        ttm_lookup(torch.tensor([1, 1000]), list(layer.cores), list(layer.gates), 2, 1000, 48, None)


def test_ttm_lookup_on_fake_tensors_gives_the_table_dtype_and_shapes():
    layer = _embedding(4, None).float()
    cores, gates = [c.detach() for c in layer.cores], [g.detach() for g in layer.gates]
    with FakeTensorMode() as mode:
        ids = mode.from_tensor(_ids(30))
        out, left, right = ttm_lookup(ids, [mode.from_tensor(c) for c in cores], [mode.from_tensor(g) for g in gates],
                                      2, 1000, 48, None)
    real = layer.half_tables(2)
    assert out.shape == (30, 48) and out.dtype == torch.float32
    assert left.shape == real[0].shape and right.shape == real[1].shape


def test_gate_cores_is_core_times_gate_and_gradchecks():
    g = torch.Generator().manual_seed(0)
    cores = [torch.randn(1, 4, 3, dtype=f64, generator=g, requires_grad=True),
             torch.randn(3, 2, 5, 2, dtype=f64, generator=g, requires_grad=True)]
    gates = [torch.rand(3, dtype=f64, generator=g, requires_grad=True),
             torch.rand(2, dtype=f64, generator=g, requires_grad=True)]
    for got, c, gate in zip(gate_cores(cores, gates), cores, gates):
        torch.testing.assert_close(got, c * gate)
    assert torch.autograd.gradcheck(lambda *p: gate_cores(list(p[:2]), list(p[2:])), tuple(cores + gates))
    torch.library.opcheck(torch.ops.tncompile.gate_cores.default, (cores, gates))


def test_gates_and_lookup_trace_as_one_op_each():
    """Under torch.compile a TTM layer's forward holds one tncompile::ttm_lookup and a
    TT linear's one tncompile::gate_cores, not a mul per core (each an inductor kernel)."""
    from tncompile.runtime import TTLinear
    layer = TTLinear.from_linear(nn.Linear(64, 48), rank=4)
    emb = TTMEmbedding.from_embedding(nn.Embedding(500, 32), rank=4)
    x, ids = torch.randn(40, 64), torch.randint(0, 500, (40,))  # row counts never planned: planned while tracing
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm
    torch.compile(lambda x, ids: layer(x).sum() + emb(ids).sum(), backend=backend, fullgraph=True)(x, ids)
    assert seen.count("tncompile.gate_cores.default") == 1
    assert seen.count("tncompile.ttm_lookup.default") == 1
    assert not any(t in ("<built-in function mul>", "aten.mul.Tensor") for t in seen)


@pytest.mark.parametrize("dtype,block", [(torch.float32, 2), (torch.float32, 4), (torch.bfloat16, 2),
                                         (torch.float64, 2), (torch.float16, 8), (torch.float64, 1)])
def test_a_narrow_blocks_swap_moves_bytes_exactly_as_the_permute(dtype, block):
    """The half tables' merge moves a column mode's few elements as one wide element (bytes
    only): equal bit for bit to the permute for every width it takes, NaN patterns included,
    and its gradient is the same move back."""
    from tncompile.runtime.kernels.traced_lookup import _BlockSwap
    x = torch.randn(6 * 5 * 7 * block, dtype=torch.float64).to(dtype)
    x[::5] = float("nan")                                    # any bit pattern moves as it is
    expected = x.reshape(6, 5, 7, block).permute(0, 2, 1, 3)
    out = _BlockSwap.apply(x, 6, 5, 7, block)
    assert out.shape == (6, 7, 5, block) and out.is_contiguous()
    assert torch.equal(out.view(-1).view(torch.uint8),
                       expected.contiguous().view(-1).view(torch.uint8))
    leaf = torch.randn(6 * 5 * 7 * block, dtype=torch.float64).to(dtype).requires_grad_()
    weights = torch.randn(6, 7, 5, block, dtype=torch.float64).to(dtype)
    (_BlockSwap.apply(leaf, 6, 5, 7, block) * weights).sum().backward()   # the gradient moves back exactly
    assert torch.equal(leaf.grad, weights.permute(0, 2, 1, 3).reshape(-1))
    if dtype == torch.float64:
        small = torch.randn(2 * 3 * 4 * block, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: _BlockSwap.apply(t, 2, 3, 4, block), (small,))


@pytest.mark.parametrize("block", [2, 3])
def test_the_block_swap_runs_only_where_the_native_cpu_kernels_apply(block):
    """The byte move is a CPU speed-up (measured there): with the native kernels off (the
    CUDA path's ops), under autograd's float64 checks of other widths and for widths it
    cannot move as one element, :func:`_swap_middle` is the plain permute, same values."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from tncompile.runtime.kernels.traced_lookup import _swap_middle
    from tncompile.runtime.native import native_kernels, native_ops

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    def moved_as_wide_elements(enabled: bool) -> bool:
        x = torch.randn(5 * 7 * block, 6, requires_grad=True).t()       # strided, as a gradient may come
        with native_kernels(enabled), Ops() as ops:
            out = _swap_middle(x, (2, 3), 5, 7, block)
        expected = x.reshape(2, 3, 5, 7, block).transpose(2, 3)
        assert out.shape == (2, 3, 7, 5, block) and out.is_contiguous() and torch.equal(out, expected)
        gradcheck_x = x.detach().double().requires_grad_()
        with native_kernels(enabled):
            assert torch.autograd.gradcheck(lambda t: _swap_middle(t, (2, 3), 5, 7, block), (gradcheck_x,))
        return "aten.view.dtype" in ops.seen
    assert not moved_as_wide_elements(False)
    if block == 2 and native_ops() is not None:
        assert moved_as_wide_elements(True)
    assert not (block == 3 and moved_as_wide_elements(True))
