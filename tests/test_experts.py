"""Mixture-of-experts weights: grouped products, TTExperts against the dense
experts it stands for, per-expert rank cuts, and MoE models end to end."""
import pytest
import torch
from torch import nn

import tncompile
from tncompile.formats.layout import TTLayout
from tncompile.passes import cut_ranks, replan_module
from tncompile.runtime.layers.experts import ExpertLinear, TTExperts
from tncompile.runtime.kernels.grouped import grouped_mm
from tncompile.ir.modules import module_at


def _random_tt(in_f, out_f, rank, experts):
    """A TTExperts with normal cores (gates at one)."""
    tt = TTExperts(TTLayout.for_shape(in_f, out_f, 2, ranks=rank, experts=experts))
    with torch.no_grad():
        for p in tt.cores:
            p.normal_()
    return tt


def _routing(rows_per_expert):
    offs = torch.tensor(rows_per_expert).cumsum(0).to(torch.int32)
    return offs, int(offs[-1])


def _loop(x, w, offs):
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[e])
        start = end
    return torch.cat(out)


def test_grouped_mm_matches_a_loop_of_products_forward_and_backward():
    offs, rows = _routing([3, 0, 5, 2])  # an expert without rows too
    x = torch.randn(rows, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.allclose(grouped_mm(x, w, offs), _loop(x, w, offs))
    torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offs), (x, w))
    torch.library.opcheck(torch.ops.tncompile.grouped_mm.default, (x.detach(), w.detach(), offs))


def test_grouped_mm_rejects_mismatched_shapes():
    offs, rows = _routing([2, 2])
    with pytest.raises(ValueError, match="do not fit"):
        grouped_mm(torch.randn(rows, 6), torch.randn(3, 6, 5), offs)


@pytest.mark.parametrize("transposed", [False, True])
def test_full_rank_tt_experts_equal_the_dense_experts(transposed):
    """At full rank each expert's network is its weight exactly (float64),
    through the per-expert CPU path and the rebuilt-matrices path alike."""
    torch.manual_seed(0)
    shape = (3, 6, 8) if transposed else (3, 8, 6)  # (experts, in, out) stored transposed
    dense = ExpertLinear(nn.Parameter(torch.randn(*shape, dtype=torch.float64)), transposed=transposed)
    layout = TTLayout.for_shape(6, 8, 2, experts=3)
    tt = TTExperts.from_experts(dense, rank=None, layout=layout.with_ranks(list(layout.rank_bounds())))
    offs, rows = _routing([4, 1, 3])
    x = torch.randn(rows, 6, dtype=torch.float64, requires_grad=True)
    want = dense(x, offs)
    got = tt(x, offs)
    assert torch.allclose(got, want, atol=1e-10)
    assert torch.allclose(grouped_mm(x, tt.weight().transpose(-2, -1), offs), want, atol=1e-10)
    assert torch.allclose(tt.to_dense_module()(x, offs), want, atol=1e-10)
    assert tt.to_dense_module().transposed == transposed
    (g_want,) = torch.autograd.grad(want.sum(), x)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    assert torch.allclose(g_got, g_want, atol=1e-10)


def test_tt_experts_gradcheck_cores_and_gates():
    torch.manual_seed(0)
    tt = TTExperts(TTLayout.for_shape(4, 6, 2, ranks=2, experts=2), dtype=torch.float64)
    with torch.no_grad():
        for p in tt.parameters():
            p.normal_()
    offs, rows = _routing([2, 3])
    x = torch.randn(rows, 4, dtype=torch.float64, requires_grad=True)
    values = [p.detach().clone().requires_grad_() for p in tt.parameters()]
    torch.autograd.gradcheck(lambda x, *ps: _functional(tt, x, offs, ps), (x, *values))


def _functional(tt, x, offs, values):
    return torch.func.functional_call(tt, {n: v for (n, _), v in zip(tt.named_parameters(), values)}, (x, offs))


def test_gates_are_per_expert():
    torch.manual_seed(0)
    tt = _random_tt(4, 6, 3, 2)
    offs, rows = _routing([2, 2])
    x = torch.randn(rows, 4)
    before = tt(x, offs)
    with torch.no_grad():
        tt.gates[1][0].zero_()  # switch expert 0's ranks of bond 1 off
    after = tt(x, offs)
    assert torch.equal(after[2:], before[2:])  # expert 1 untouched
    assert after[:2].abs().max() < 1e-6 and before[:2].abs().max() > 1e-3


def test_cut_keeps_each_experts_own_ranks_and_slices_optimizer_state_the_same_way():
    """Per-expert index sets: a pure permutation changes nothing, a cut keeps
    each expert's chosen ranks, and Cut.apply slices state like the parameter."""
    torch.manual_seed(0)
    tt = _random_tt(4, 6, 3, 2)
    with torch.no_grad():
        for g in tt.gates:
            g.uniform_(0.5, 1.5)
    offs, rows = _routing([3, 2])
    x = torch.randn(rows, 4)
    before = tt(x, offs)
    r = tt.layout.ranks
    assert cut_ranks(tt, [torch.arange(k).expand(2, k) for k in r]) == []  # keeps everything: no edit
    with torch.no_grad():  # expert 0 switches rank 2 of bond 1 off, expert 1 rank 0
        tt.gates[1][0, 2] = 0
        tt.gates[1][1, 0] = 0
    reference = tt(x, offs)
    old_gate = tt.gates[1]
    keep = [torch.arange(r[0]).expand(2, r[0]), torch.tensor([[1, 0], [2, 1]])] + \
           [torch.arange(k).expand(2, k) for k in r[2:]]
    cuts = cut_ranks(tt, keep)
    replan_module(tt)
    assert tt.layout.ranks[1] == 2 and tuple(tt.gates[1].shape) == (2, 2)
    assert torch.allclose(tt(x, offs), reference, atol=1e-6)
    gate_cut = next(c for c in cuts if c.old is old_gate)
    assert torch.equal(gate_cut.apply(old_gate.detach()), tt.gates[1].detach())
    assert torch.equal(tt.gates[1].detach(), torch.stack([old_gate[0, [1, 0]], old_gate[1, [2, 1]]]).detach())
    assert not torch.allclose(before, reference)


transformers = pytest.importorskip("transformers")

_DEC = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _moe(family):
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**_DEC, num_local_experts=4,
                                                                          num_experts_per_tok=2))
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **_DEC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128))


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_moe_models_reach_a_tenth_with_experts_in_the_report(family):
    torch.manual_seed(0)
    model = _moe(family).eval()
    ids = torch.randint(0, 1000, (2, 16))
    c = tncompile.compile(model, target_ratio=0.1, example_inputs={"input_ids": ids})
    assert c.ratio <= 0.1
    experts = {n: m for n, m in c.tensorized_modules().items() if isinstance(m, TTExperts)}
    assert sorted(n.rsplit(".", 1)[-1] for n in experts) == ["down_proj", "down_proj", "gate_up_proj", "gate_up_proj"]
    assert all(m.num_experts == 4 for m in experts.values())
    rows = {r.name: r for r in c.report().rows}
    for name in experts:
        assert rows[name].format == "TTx4" and rows[name].params < rows[name].dense_params
    assert "TTx4" in str(c.report())
    with torch.no_grad():
        assert torch.isfinite(c(input_ids=ids).logits).all()


def test_moe_trace_outlines_experts_without_changing_the_model():
    """The traced graph (experts as ExpertLinear calls) computes what the model does."""
    from tncompile.frontend.tracing import trace
    torch.manual_seed(0)
    model = _moe("mixtral").eval()
    ids = torch.randint(0, 1000, (2, 16))
    gm, _ = trace(model, {"input_ids": ids})
    outlined = [n for n, m in gm.named_modules() if isinstance(m, ExpertLinear)]
    assert len(outlined) == 4
    assert gm.get_submodule(outlined[0]).weight is model.get_parameter(outlined[0])  # the model's own parameter
    with torch.no_grad():
        assert torch.allclose(gm(input_ids=ids, use_cache=False).logits, model(input_ids=ids).logits, atol=1e-6)


@pytest.mark.parametrize("mode", ["graph", "swap"])
def test_moe_rank_adaptation_cuts_experts_to_the_target(mode):
    torch.manual_seed(0)
    model = _moe("mixtral")
    ids = torch.randint(0, 1000, (4, 16))
    c = tncompile.compile(model, target_ratio=0.2, example_inputs={"input_ids": ids}, mode=mode)
    opt = torch.optim.AdamW(c.parameters(), lr=3e-3)
    ctl = tncompile.RankController(c, opt, target_ratio=0.1, early_steps=4, late_steps=8)
    start = {n: sum(m.layout.ranks) for n, m in c.tensorized_modules().items() if isinstance(m, TTExperts)}
    for _ in range(12):
        logits = c(input_ids=ids).logits
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 1000), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        (loss + ctl.penalty(loss)).backward()
        opt.step()
        ctl.step()
    assert c.ratio <= 0.1
    assert all(sum(c.tensorized_modules()[n].layout.ranks) < r for n, r in start.items())
    if mode == "swap":  # the cut networks sit in the model's own experts modules
        assert all(module_at(c, n) is c.tensorized_modules()[n] for n in start)
    c.eval()
    with torch.no_grad():
        dense = c.to_dense().eval()(input_ids=ids).logits
        got = c(input_ids=ids).logits
    assert ((got - dense).norm() / dense.norm()) < 1e-5


def test_controller_cuts_each_experts_own_switched_off_rank():
    """Each expert switches a different rank of a bond off: the bond loses one
    rank, each expert its own, and the layer's output stays the same."""
    torch.manual_seed(0)
    c = tncompile.compile(_moe("mixtral"), target_ratio=0.3, example_inputs={"input_ids": torch.randint(0, 1000, (2, 16))})
    name, tt = next((n, m) for n, m in c.tensorized_modules().items() if isinstance(m, TTExperts))
    r = tt.layout.ranks[1]
    with torch.no_grad():
        for e in range(tt.num_experts):
            tt.gates[1][e, e] = 0.0
    ctl = tncompile.RankController(c, torch.optim.AdamW(c.parameters()), target_ratio=0.2, schedule="comera")
    assert ctl.active_ranks()[name][1] == r - 1
    offs, rows = _routing([3, 2, 0, 4])
    x = torch.randn(rows, tt.in_features)
    with torch.no_grad():
        reference = tt(x, offs)
    event = ctl.truncate()
    assert event.truncated[name][1][1] == r - 1
    assert tt.layout.ranks[1] == r - 1
    with torch.no_grad():
        assert torch.allclose(tt(x, offs), reference, atol=1e-6)


def test_tt_experts_under_torch_compile_fullgraph():
    torch.manual_seed(0)
    tt = _random_tt(8, 8, 2, 2)
    offs, rows = _routing([3, 2])
    x = torch.randn(rows, 8)
    compiled = torch.compile(tt, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x, offs), tt(x, offs), atol=1e-5)
