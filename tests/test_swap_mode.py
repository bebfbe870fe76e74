"""Swap mode: compile(mode="swap") hands back the user's own model object and class with its
compressed layers replaced in place; HF generate / masks / dropout / to_dense / save_pretrained
work as on the original, and rank-adaptive training keeps the model's layers and the program's
in step across cuts."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tncompile
from tncompile.runtime import TTLinear, TTMEmbedding, TTMTiedLinear
from tncompile.runtime.layers.experts import TTExperts
from tncompile.testing import mlp

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _bert():
    cfg = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _greedy(model, ids, n=8):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)


def test_gpt2_keeps_its_class_generates_and_merges_back(tmp_path):
    model = _gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, 500, (2, 8))
    c = tncompile.compile(model, target_ratio=0.4, example_inputs={"input_ids": ids, "use_cache": False},
                          mode="swap")
    assert isinstance(c, transformers.GPT2LMHeadModel) and type(c).__name__ == "GPT2LMHeadModel"
    assert c is not model and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(model.transformer.wte) is nn.Embedding  # the user's model is untouched
    assert isinstance(c.transformer.h[0].attn.c_attn, TTLinear) and isinstance(c.transformer.wte, TTMEmbedding)
    assert isinstance(c.lm_head, TTMTiedLinear) and c.lm_head.embedding is c.transformer.wte
    assert c.ratio <= 0.4 and set(c.tensorized_modules()) >= {"transformer.wte", "lm_head"}
    assert c.config is not None and "lm_head" in str(c.report())
    # generate with the KV cache: the same greedy tokens as the densified model
    dense = c.to_dense()
    assert type(dense) is transformers.GPT2LMHeadModel
    assert type(dense.transformer.h[0].attn.c_attn).__name__ == "Conv1D"  # GPT-2's own orientation
    assert dense.lm_head.weight is dense.transformer.wte.weight
    assert torch.equal(_greedy(c, ids), _greedy(dense, ids))
    # merge back: save_pretrained / from_pretrained of to_dense() gives the same logits
    dense.save_pretrained(tmp_path / "merged")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, c(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoders_generate_with_their_cache_like_the_densified_model(family):
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config, cls = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if family == "llama"
                   else (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
    torch.manual_seed(0)
    model = cls(config(**kw)).eval()
    ids = torch.randint(1, 300, (2, 6))
    c = tncompile.compile(model, target_ratio=0.4, example_inputs={"input_ids": ids})  # HF: swap mode
    assert type(c).__name__ == cls.__name__ and isinstance(c, cls)
    assert torch.equal(_greedy(c, ids), _greedy(c.to_dense(), ids))


def test_hf_gradient_checkpointing_gives_the_same_gradients():
    cfg = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    ids = torch.randint(0, 500, (4, 16))
    c = tncompile.compile(transformers.BertModel(cfg), target_ratio=0.4, example_inputs={"input_ids": ids}).train()

    def core_grads():
        c.zero_grad()
        c(input_ids=ids).last_hidden_state.square().mean().backward()
        return {n: m.cores[0].grad.clone() for n, m in c.tensorized_modules().items()
                if m.cores[0].grad is not None}  # (the pooler is not used here)

    plain = core_grads()
    c.gradient_checkpointing_enable()
    assert c.is_gradient_checkpointing and all(layer.gradient_checkpointing for layer in c.encoder.layer)
    calls = []
    for layer in c.encoder.layer:  # count the checkpointed calls: the layers really are recomputed
        layer._gradient_checkpointing_func = (lambda *a, hf=layer._gradient_checkpointing_func, **k:
                                              calls.append(1) or hf(*a, **k))
    checkpointed = core_grads()
    assert len(calls) == len(c.encoder.layer)
    assert plain.keys() == checkpointed.keys() and len(plain) > 4
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name])


def test_bert_masks_dropout_and_rank_adaptive_training():
    model = _bert()
    ids = torch.randint(0, 500, (4, 16))
    c = tncompile.compile(model, target_ratio=0.4, example_inputs={"input_ids": ids}, mode="swap")
    # masks and any keyword HF passes: the model's own forward runs
    mask = torch.ones_like(ids)
    mask[:, -4:] = 0
    c.eval()
    with torch.no_grad():
        full, masked = c(input_ids=ids).logits, c(input_ids=ids, attention_mask=mask).logits
        assert not torch.allclose(full, masked)
        assert torch.equal(c(input_ids=ids).logits, full)  # eval: no dropout
    c.train()
    assert not torch.equal(c(input_ids=ids).logits, c(input_ids=ids).logits)  # train: dropout
    # training with cuts: the model's layers are the program's after every cut
    opt = torch.optim.AdamW(tncompile.param_groups(c, lr=1e-3, gate_lr=5e-2))
    ctl = tncompile.RankController(c, opt, target_ratio=0.2, truncate_every=5)
    g = torch.Generator().manual_seed(0)
    data = [({"input_ids": torch.randint(0, 500, (8, 16), generator=g)}, torch.randint(0, 3, (8,), generator=g))
            for _ in range(30)]
    history = tncompile.fit(c, data, lambda out, y: F.cross_entropy(out.logits, y), opt, ctl,
                            early_steps=10, late_steps=20, progress=False)
    assert any(e["kind"] == "truncation" for e in history.events) and c.ratio <= 0.21
    layers = c.tensorized_modules()
    assert layers and all(c.get_submodule(path) is layer for path, layer in layers.items())
    assert {id(p) for p in c.parameters()} >= {id(p) for m in layers.values() for p in m.parameters()}
    c.eval()
    with torch.no_grad():
        torch.testing.assert_close(c.to_dense()(input_ids=ids).logits, c(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_plain_model_inplace_and_copies():
    model = mlp((64, 128, 10))
    x = torch.randn(3, 64)
    c = tncompile.compile(model, target_ratio=0.3, mode="swap", inplace=True)
    assert c is model and isinstance(model, nn.Sequential) and isinstance(model[0], TTLinear)
    twin = copy.deepcopy(c)
    assert type(twin) is type(c) and twin.ratio == c.ratio
    assert all(twin.get_submodule(k) is v for k, v in twin.tensorized_modules().items())
    assert twin.program.listeners[-1].model is twin  # cuts on the copy resync the copy
    torch.testing.assert_close(twin(x), c(x))
    assert type(c.to_dense()) is nn.Sequential


def test_bad_modes_are_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3, mode="inplace")

    model = _Reporting(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    with pytest.raises(ValueError, match=r"already defines \['report'\]"):
        tncompile.compile(model, target_ratio=0.3, mode="swap")
    assert isinstance(model[0], nn.Linear)


class _ShapeBranch(nn.Module):
    """torch.fx cannot branch on a size; torch.export can (it specializes the branch)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h) if x.shape[0] > 1 else self.b(h) * 2


class _Reporting(nn.Sequential):
    def report(self):
        return "mine"


def test_auto_mode_swaps_models_that_are_not_one_static_graph():
    ids = torch.randint(1, 500, (2, 8))
    hf = tncompile.compile(_gpt2(), target_ratio=0.4, example_inputs={"input_ids": ids})
    assert isinstance(hf, transformers.GPT2LMHeadModel) and tncompile.swap.is_swapped(hf)
    exported = tncompile.compile(_ShapeBranch(), target_ratio=0.5, example_inputs=(torch.randn(3, 64),))
    assert isinstance(exported, _ShapeBranch) and isinstance(exported.a, TTLinear)
    x = torch.randn(1, 64)  # its own forward runs: the branch the export trace fixed is taken again
    torch.testing.assert_close(exported(x), exported.to_dense()(x))
    assert isinstance(tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3), tncompile.CompiledModel)
    clash = _Reporting(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    assert isinstance(tncompile.compile(clash, target_ratio=0.3, example_inputs=(torch.randn(2, 64),)),
                      tncompile.CompiledModel)


# a small decoder config shared by the Gemma3 and Mixtral tests
_DECODER = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _gemma3():
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**_DECODER, head_dim=16, sliding_window=8)
    return transformers.Gemma3ForCausalLM(config).eval()


def test_layer_subclasses_with_their_own_forward_run_the_network(tmp_path):
    """Gemma's scaled embedding (an nn.Embedding subclass, its table tied to the head): its own
    forward runs, super().forward reaching the network; weight reads as shape/dtype/device only."""
    from tncompile.swap.subclass import NetworkWeight, network_of
    model = _gemma3()
    ids = torch.randint(1, 500, (2, 8))
    c = tncompile.compile(model, target_ratio=0.4, example_inputs={"input_ids": ids})
    embed = c.model.embed_tokens
    scaled = type(model.model.embed_tokens)
    assert isinstance(embed, scaled) and type(embed).__name__ == scaled.__name__ and type(embed) is not scaled
    assert isinstance(network_of(embed), TTMEmbedding) and c.lm_head.embedding is network_of(embed)
    assert isinstance(embed.weight, NetworkWeight) and embed.weight.shape == (500, 64)
    assert embed.weight.dtype == torch.float32
    with pytest.raises(AttributeError, match="mode='graph'"):
        embed.weight.sum()
    dense = c.to_dense()
    assert type(dense.model.embed_tokens) is scaled and dense.lm_head.weight is dense.model.embed_tokens.weight
    assert _greedy(c, ids).tolist() == _greedy(dense, ids).tolist()
    tncompile.save(c, tmp_path / "gemma.tnc")
    loaded = tncompile.load(tmp_path / "gemma.tnc", model=_gemma3())
    twin = copy.deepcopy(c)
    with torch.no_grad():
        want = c(ids).logits
        for other in (loaded, twin):
            assert torch.equal(other(ids).logits, want)
    c.train()  # a cut replaces the network inside the user's object
    opt = torch.optim.AdamW(c.parameters(), lr=1e-3)
    ctl = tncompile.RankController(c, opt, target_ratio=0.2, early_steps=1, late_steps=3)
    for _ in range(4):
        loss = c(ids, labels=ids).loss
        opt.zero_grad()
        (loss + ctl.penalty(loss)).backward()
        opt.step()
        ctl.step()
    assert c.ratio <= 0.2 and network_of(c.model.embed_tokens) is c.tensorized_modules()["model.embed_tokens"]


def _mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config).eval()


def test_mixtral_experts_are_swapped_through_their_owner(tmp_path):
    """Fused 3-D expert parameters: the owner's class gains a property per swapped name that
    rebuilds the dense tensor from its TT network; its own forward (and generate) run as
    before, to_dense gives parameters back, files and folders reload exactly."""
    model = _mixtral()
    ids = torch.randint(1, 500, (2, 8))
    c = tncompile.compile(model, target_ratio=0.3, example_inputs={"input_ids": ids})
    assert isinstance(c, transformers.MixtralForCausalLM) and c.ratio <= 0.3
    experts = c.model.layers[0].mlp.experts
    own_class = type(model.model.layers[0].mlp.experts)
    assert isinstance(experts, own_class) and type(experts).__name__ == own_class.__name__
    assert type(experts) is not own_class
    assert isinstance(experts._modules["gate_up_proj"], TTExperts) and "gate_up_proj" not in experts._parameters
    assert experts.gate_up_proj.shape == model.model.layers[0].mlp.experts.gate_up_proj.shape
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, nn.Parameter)  # the user's model untouched
    dense = c.to_dense()
    assert type(dense.model.layers[0].mlp.experts) is own_class
    assert isinstance(dense.model.layers[0].mlp.experts.gate_up_proj, nn.Parameter)
    assert _greedy(c, ids).tolist() == _greedy(dense, ids).tolist()
    c.train()
    c(ids, labels=ids).loss.backward()
    assert experts._modules["down_proj"].cores[0].grad.abs().sum() > 0
    c.eval()
    tncompile.save(c, tmp_path / "moe.tnc")
    loaded = tncompile.load(tmp_path / "moe.tnc", model=_mixtral())
    c.save_pretrained(tmp_path / "folder")
    again = tncompile.load(tmp_path / "folder", model=transformers.MixtralForCausalLM)
    twin = copy.deepcopy(c)
    with torch.no_grad():
        want = c(ids).logits
        for other in (loaded, again.eval(), twin):
            assert torch.equal(other(ids).logits, want)


def test_a_saved_swapped_model_loads_onto_a_fresh_model_and_resumes(tmp_path):
    """tncompile.save of a swap-mode BERT after cuts; tncompile.load(path, model=fresh) puts the
    layers into a fresh model of the same class, with the same outputs and training state."""
    model = _bert()
    ids = torch.randint(0, 500, (4, 16))
    c = tncompile.compile(model, target_ratio=0.4, example_inputs={"input_ids": ids}, mode="swap")
    opt = torch.optim.AdamW(tncompile.param_groups(c, lr=1e-3, gate_lr=5e-2))
    ctl = tncompile.RankController(c, opt, target_ratio=0.25, truncate_every=4)
    g = torch.Generator().manual_seed(0)
    data = [({"input_ids": torch.randint(0, 500, (8, 16), generator=g)}, torch.randint(0, 3, (8,), generator=g))
            for _ in range(12)]
    tncompile.fit(c, data, lambda out, y: F.cross_entropy(out.logits, y), opt, ctl, early_steps=4, late_steps=8,
                  progress=False, checkpoint_path=tmp_path / "ckpt.tnc", checkpoint_every=12)
    path = tmp_path / "ckpt.tnc"
    with pytest.raises(tncompile.ModelFileError, match="pass the dense model it was saved from"):
        tncompile.load(path)
    with pytest.raises(tncompile.ModelMismatchError, match="saved from a BertForSequenceClassification"):
        tncompile.load(path, model=mlp((64, 128, 10)))
    fresh = _bert()
    loaded = tncompile.load(path, model=fresh)
    assert loaded is fresh and isinstance(loaded, transformers.BertForSequenceClassification)
    assert loaded.ratio == pytest.approx(c.ratio)
    assert {k: tuple(v.layout.ranks) for k, v in loaded.tensorized_modules().items()} == \
        {k: tuple(v.layout.ranks) for k, v in c.tensorized_modules().items()}
    c.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, c(input_ids=ids).logits)
    # the program's graph holds the model's own tensors: training the model trains what it counts
    own = {id(p) for p in loaded.parameters()}
    assert {id(p) for p in loaded.program.graph_module.parameters()} <= own
    opt2 = torch.optim.AdamW(tncompile.param_groups(loaded, lr=1e-3, gate_lr=5e-2))
    ctl2 = tncompile.RankController(loaded, opt2, target_ratio=0.25, truncate_every=4)
    extra = tncompile.resume(loaded, opt2, ctl2)
    assert "history" in extra and ctl2.steps_done == ctl.steps_done
    loaded.train()
    tncompile.fit(loaded, data[:4], lambda out, y: F.cross_entropy(out.logits, y), opt2, ctl2,
                  early_steps=4, late_steps=12, progress=False)
    assert all(loaded.get_submodule(k) is v for k, v in loaded.tensorized_modules().items())


def test_save_pretrained_reloads_exactly_through_load_and_from_pretrained(tmp_path):
    """Reloading looked fine and was wrong: HF's save_pretrained of a compressed model wrote TT
    cores under names no dense model has, and from_pretrained built a randomly initialized model.
    The folder now declares its layer table (quantization_config): both loaders rebuild it."""
    model = _bert().eval()
    ids = torch.randint(0, 500, (4, 16))
    c = tncompile.compile(model, target_ratio=0.3, example_inputs={"input_ids": ids}, mode="swap")
    with torch.no_grad():                                   # weights no fresh compile would have
        for p in c.parameters():
            p.add_(0.01 * torch.randn_like(p))
    folder = tmp_path / "compressed"
    c.save_pretrained(folder)
    assert (folder / "model.safetensors").exists() and (folder / "config.json").exists()
    with pytest.raises(tncompile.ModelFileError, match="pass its model class"):
        tncompile.load(folder)
    c.eval()
    for loaded in (tncompile.load(folder, model=transformers.BertForSequenceClassification),
                   transformers.BertForSequenceClassification.from_pretrained(folder)):
        assert isinstance(loaded, transformers.BertForSequenceClassification)
        assert loaded.ratio == pytest.approx(c.ratio) and loaded.config.num_labels == 3
        loaded.eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, c(input_ids=ids).logits, rtol=0, atol=0)
    # a folder holding a sharded dense save would be read by from_pretrained instead: refused
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(FileExistsError, match="index.json"):
        c.save_pretrained(tmp_path / "sharded")
    with pytest.raises(TypeError, match="unexpected keyword"):
        c.save_pretrained(tmp_path / "other", shard_everything=True)


def test_dry_run_checks_a_swapped_models_step():
    model = _bert()
    ids = torch.randint(0, 500, (2, 8))
    c = tncompile.compile(model, target_ratio=0.4, example_inputs={"input_ids": ids}, mode="swap")
    opt = torch.optim.AdamW(tncompile.param_groups(c, lr=1e-3))
    ctl = tncompile.RankController(c, opt, target_ratio=0.3)
    report = tncompile.dry_run(c, opt, lambda out, y: F.cross_entropy(out.logits, y), {"input_ids": ids},
                               torch.randint(0, 3, (2,)), controller=ctl)
    assert report.ok and report.stages == ["early", "late"]
    assert all(c.get_submodule(k) is v for k, v in c.tensorized_modules().items())  # untouched by the dry run


def test_gpt2_activation_runs_pytorchs_tanh_gelu_and_to_dense_gives_it_back(tmp_path):
    """GPT-2's gelu_new (the tanh formula written out, ~8 kernels each way) runs as one
    nn.GELU(approximate="tanh") in swap mode: the same outputs and gradients; to_dense()
    and the user's model keep HF's module; save / load swaps it again."""
    from tncompile.swap.lowering import TanhGELU
    model = _gpt2().train()
    ids = torch.randint(1, 500, (2, 8))
    c = tncompile.compile(model, target_ratio=0.4, example_inputs={"input_ids": ids, "use_cache": False})
    assert all(type(b.mlp.act) is TanhGELU for b in c.transformer.h)
    assert type(model.transformer.h[0].mlp.act).__name__ == "NewGELUActivation"
    counts = next(r.matches for r in c.program.history if r.name == "canonicalize")
    assert counts["gelu-tanh-formula"] == 2  # the traced graph's two formulas: the same decision
    dense = c.to_dense().eval()
    assert type(dense.transformer.h[0].mlp.act).__name__ == "NewGELUActivation"
    c.eval()
    with torch.no_grad():
        torch.testing.assert_close(c(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    act, original = c.transformer.h[0].mlp.act, dense.transformer.h[0].mlp.act
    grads = [torch.autograd.grad(f(x).square().sum(), x)[0] for f in (act, original)]
    torch.testing.assert_close(grads[0], grads[1])
    c.save_pretrained(tmp_path / "c")
    loaded = tncompile.load(tmp_path / "c", model=transformers.GPT2LMHeadModel)
    assert type(loaded.transformer.h[0].mlp.act) is TanhGELU
