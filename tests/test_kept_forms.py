"""Merged inference forms never outlive the weights they were made from.

Without autograd a layer keeps merged forms of its cores (``runtime.derived``): a TT
linear's factors, a lookup's half tables, a tied head's table and half tables. One tiny
Mixtral with tied embeddings holds every kind of compressed layer (TT linears, a TTM
embedding, the head tied to it, TT experts); in graph and swap mode it runs without
autograd at many rows and at one (so every kept form is made), its weights change by
one update path, and its outputs without autograd must then equal its own with autograd
(the network contracted afresh) and its ``to_dense()`` model's. Each update is checked to
change the outputs, so no test passes because nothing changed."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tncompile
from tncompile.runtime import TTMEmbedding, TTMTiedLinear, TTLinear
from tncompile.runtime.layers.derived import kept, weights_epoch
from tncompile.runtime.layers.experts import TTExperts

transformers = pytest.importorskip("transformers")

_CONFIG = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)
IDS = torch.randint(1, 500, (2, 8), generator=torch.Generator().manual_seed(1))


def _mixtral() -> nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**_CONFIG)).eval()


@pytest.fixture(scope="module", params=["graph", "swap"])
def compiled(request):
    c = tncompile.compile(_mixtral(), target_ratio=0.4, example_inputs={"input_ids": IDS}, mode=request.param,
                          prefer="size")
    kinds = {type(m) for m in c.tensorized_modules().values()}
    assert {TTLinear, TTMEmbedding, TTMTiedLinear, TTExperts} <= kinds
    return c


def _logits(model, ids):
    out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out[0]


def _without_autograd(model) -> list[torch.Tensor]:
    """Logits at 16 rows and at one row per sequence (a tied head's merged table, its half tables)."""
    model.eval()
    with torch.no_grad():
        return [_logits(model, IDS), _logits(model, IDS[:, :1])]


def _check_current(model, before: list[torch.Tensor]) -> None:
    got = _without_autograd(model)
    with torch.enable_grad():
        fresh = [_logits(model, IDS).detach(), _logits(model, IDS[:, :1]).detach()]  # no kept forms with autograd
    dense = model.to_dense().eval()
    with torch.no_grad():
        want = [_logits(dense, IDS), _logits(dense, IDS[:, :1])]
    for g, b, f, w in zip(got, before, fresh, want):
        assert (g - b).abs().max() > 1e-3, "the update did not change the outputs: the test would prove nothing"
        assert (g - f).abs().max() < 1e-5
        assert (g - w).abs().max() < 1e-5


def _train(model, opt, steps: int = 3) -> None:
    model.train()
    for _ in range(steps):
        _logits(model, IDS).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


UPDATES = {
    "adamw fused": lambda m: _train(m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)),
    "adamw foreach": lambda m: _train(m, torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)),
    "adamw for-loop": lambda m: _train(m, torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)),
    "sgd fused": lambda m: _train(m, torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, fused=True)),
    "sgd": lambda m: _train(m, torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)),
}


@pytest.mark.parametrize("update", list(UPDATES))
def test_optimizer_steps_reach_the_outputs(compiled, update):
    model = copy.deepcopy(compiled)
    before = _without_autograd(model)
    UPDATES[update](model)
    _check_current(model, before)


def test_writes_through_p_data_reach_the_outputs(compiled):
    """``p.data.copy_`` (an EMA swapped in for evaluation) bumps no version counter."""
    model = copy.deepcopy(compiled)
    before = _without_autograd(model)
    g = torch.Generator().manual_seed(3)
    for p in model.parameters():
        p.data.copy_(p.data * (1 + 0.3 * torch.rand(p.shape, generator=g)))
    _check_current(model, before)


def test_in_place_edits_without_autograd_reach_the_outputs(compiled):
    model = copy.deepcopy(compiled)
    before = _without_autograd(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    _check_current(model, before)


def test_load_state_dict_reaches_the_outputs(compiled):
    model, other = copy.deepcopy(compiled), copy.deepcopy(compiled)
    before = _without_autograd(model)
    _train(other, torch.optim.AdamW(other.parameters(), lr=1e-2, fused=True))
    model.load_state_dict(other.state_dict())
    _check_current(model, before)
    model = copy.deepcopy(compiled)
    before = _without_autograd(model)
    model.load_state_dict(other.state_dict(), assign=True)  # new parameter objects
    _check_current(model, before)


def test_rank_cuts_reach_the_outputs(compiled):
    model = copy.deepcopy(compiled)
    before = _without_autograd(model)
    ranks = {n: m.layout.ranks for n, m in model.tensorized_modules().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ctl = tncompile.RankController(model, opt, target_ratio=0.25, early_steps=1, late_steps=3)
    model.train()
    for _ in range(4):
        loss = _logits(model, IDS).pow(2).mean()
        opt.zero_grad()
        (loss + ctl.penalty(loss)).backward()
        opt.step()
        ctl.step()
    assert ranks != {n: m.layout.ranks for n, m in model.tensorized_modules().items()}
    _check_current(model, before)


def test_train_step_updates_reach_the_outputs(compiled):
    """``TrainStep`` (eager on the CPU; ``test_cuda`` replays its captured graph, which bumps
    no version counter either) with the fused AdamW."""
    model = copy.deepcopy(compiled)
    before = _without_autograd(model)
    model.train()
    step = tncompile.TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                               lambda out, _: out.logits.pow(2).mean(), cuda_graph=False)
    for _ in range(3):
        step({"input_ids": IDS}, None)
    _check_current(model, before)


def test_a_kept_form_is_made_again_whenever_its_tensors_may_have_changed():
    layer = nn.Module()
    t = torch.randn(3, 4)
    made = []

    def make():
        made.append(1)
        return t.sum()

    first = kept(layer, "_form", [t], make)
    assert kept(layer, "_form", [t], make) is first and len(made) == 1          # reused
    with torch.no_grad():
        t.add_(0.0)                                                              # a version bump
    kept(layer, "_form", [t], make)
    kept(layer, "_form", [t], make, key=("other",))                              # another key
    kept(layer, "_form", [t.clone()], make, key=("other",))                      # new storage
    kept(layer, "_form", [t.double()], make, key=("other",))                     # another dtype
    assert len(made) == 5
    p = nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    kept(layer, "_p", [p], make)
    epoch, version = weights_epoch(), p._version
    p.grad = torch.ones(4)
    opt.step()
    assert p._version == version and weights_epoch() > epoch  # what versions alone cannot see
    kept(layer, "_p", [p], make)
    assert len(made) == 7


def test_train_eval_and_load_state_dict_move_the_epoch():
    from tncompile.formats.layout import TTLayout
    layer = TTLinear(TTLayout.for_shape(8, 6, 2, ranks=2))
    epoch = weights_epoch()
    layer.eval()
    assert weights_epoch() > epoch
    epoch = weights_epoch()
    layer.load_state_dict(layer.state_dict())
    assert weights_epoch() > epoch


def test_new_parameters_at_the_freed_addresses_reach_the_outputs(monkeypatch):
    """A layer's network replaced by new parameters of the same shapes (a PEFT merge that
    keeps a layer's ranks does it): their shapes and version counters equal the old ones',
    and the allocator may hand them the freed addresses -- forced here, as it happened in
    CI. The kept forms must still be made again."""
    from tncompile.formats import TTLayout
    from tncompile.runtime.layers import derived
    monkeypatch.setattr(derived, "storage_address", lambda t: 0)
    torch.manual_seed(0)
    layer = TTLinear(TTLayout.for_shape(64, 64, 2, ranks=4))
    layer.set_cores([torch.randn_like(c) for c in layer.cores])
    layer.eval()
    x = torch.randn(5, 64)
    with torch.no_grad():
        before = layer(x)
    cores = [torch.randn_like(c) for c in layer.cores]
    layer._init_params(layer.layout, x.device, x.dtype)
    layer.set_cores(cores)
    with torch.no_grad():
        got = layer(x)
    fresh = layer(x).detach()                          # with autograd: contracted afresh
    assert (got - before).abs().max() > 1e-3, "the new cores did not change the outputs"
    torch.testing.assert_close(got, fresh, rtol=1e-5, atol=1e-5)
