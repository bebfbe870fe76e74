"""canonicalize: every spelling of GELU, ReLU, dropout and linear becomes one form;
later passes match rules over those forms, count their matches, and check what they need."""
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import tncompile
from tncompile.ir import InputSpec, Program
from tncompile.passes import Canonicalize, Pat, Pipeline, Rule, apply_rules
from tncompile.runtime.fused.dropout import FastDropout, dropout
from tncompile.testing import mlp, small_encoder

aten = torch.ops.aten


def _program(module: nn.Module) -> Program:
    gm = fx.symbolic_trace(module)
    return Program(gm, InputSpec("fx"), max(1, sum(p.numel() for p in module.parameters())))


def _canonical(module: nn.Module) -> tuple[Program, dict]:
    program = Pipeline([Canonicalize()]).run(_program(module), progress=False)
    return program, program.history[-1].matches


def _calls(program: Program) -> list:
    return [n.target for n in program.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


class Spellings(nn.Module):
    """GELU and ReLU spelled every way, each feeding the next."""

    def __init__(self):
        super().__init__()
        self.gelu = nn.GELU(approximate="tanh")
        self.relu = nn.ReLU()

    def forward(self, x):
        a = self.gelu(x)
        b = F.gelu(a, approximate="tanh")
        c = torch.ops.aten.gelu.default(b)
        d = self.relu(c)
        e = F.relu(d)
        f = torch.ops.aten.relu.default(e)
        g = f.relu()
        h = torch.relu_(g * 1.0)      # in place on a value nothing else reads
        return h + 1


def test_every_activation_spelling_becomes_one_form():
    model = Spellings()
    x = torch.randn(4, 8)
    program, matches = _canonical(model)
    calls = _calls(program)
    assert calls.count(F.gelu) == 3 and calls.count(torch.relu) == 5
    assert not {aten.gelu.default, aten.relu.default, torch.relu_, "relu", "gelu", "relu_"} & set(calls)
    assert matches["gelu-module"] == 1 and matches["gelu-function"] == 1  # F.gelu(a, approximate=) already is
    assert matches["relu-module"] == 1 and matches["relu-function"] == 2
    assert matches["relu-method"] == 1 and matches["relu-inplace"] == 1
    gelus = [n for n in program.graph.nodes if n.target is F.gelu]
    assert [n.kwargs["approximate"] for n in gelus] == ["tanh", "tanh", "none"]
    torch.testing.assert_close(program.graph_module(x), model(x), rtol=0, atol=0)


class SharedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = x * 2
        z = self.relu(y)      # y is read again below: in place is observable
        return z + y


def test_in_place_with_other_readers_is_left_alone():
    model = SharedInPlace()
    program, matches = _canonical(model)
    assert matches["relu-module"] == 0
    x = torch.randn(5)
    torch.testing.assert_close(program.graph_module(x), model(x))


class Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        x = self.drop(x)
        x = F.dropout(x, 0.2, True)
        x = torch.dropout(x, 0.1, True)
        return torch.ops.aten.dropout.default(x, 0.4, False)


def test_dropout_spellings_then_lowering():
    program, matches = _canonical(Dropouts())
    assert matches["dropout-function"] == 0 and matches["dropout-torch"] == 2  # fx already spells F.dropout by name
    funcs = [n for n in program.graph.nodes if n.target is F.dropout]
    assert [(n.kwargs["p"], n.kwargs["training"], n.kwargs["inplace"]) for n in funcs] == \
        [(0.2, True, False), (0.1, True, False), (0.4, False, False)]
    assert isinstance(program.graph_module.get_submodule("drop"), nn.Dropout)  # modules stay modules
    program = Pipeline(["lower_dropout"]).run(program, progress=False)
    assert program.history[-1].matches == {"dropout-module": 1, "dropout-function": 3, "attention-dropout": 0,
                                           "attention-function": 0}
    assert type(program.graph_module.get_submodule("drop")) is FastDropout
    assert [n.target for n in program.graph.nodes if n.op == "call_function"] == [dropout] * 3


class FunctionalLinear(nn.Module):
    """A layer calling F.linear on its own weight and bias (fx copies them into a bare module)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.randn(96, 64) / 8)
        self.proj.bias = nn.Parameter(torch.randn(96))
        self.shared = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        h = F.linear(x, self.proj.weight, self.proj.bias)
        return F.linear(h[..., :64], self.shared)   # not a module's weight: stays functional


def test_functional_linear_on_a_module_weight_becomes_the_module():
    model = FunctionalLinear()
    program, matches = _canonical(model)
    assert matches["linear-module"] == 1
    lin = program.graph_module.get_submodule("proj")
    assert type(lin) is nn.Linear and lin.weight is model.proj.weight and lin.bias is model.proj.bias
    assert [n.op for n in program.graph.nodes if n.target in ("proj", F.linear)] == ["call_module", "call_function"]
    x = torch.randn(3, 64)
    torch.testing.assert_close(program.graph_module(x), model(x), rtol=0, atol=0)
    # ... and so it is compressed like any nn.Linear
    compiled = tncompile.compile(model, target_ratio=0.6)
    assert "proj" in compiled.tensorized_modules()


def test_export_graph_dropout_is_lowered():
    """torch.export spells functional dropout aten.dropout.default: the frontend makes it a
    dropout module that follows train()/eval(), which lower_dropout swaps for the native one."""
    from transformers import BertConfig, BertModel
    cfg = BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=32)
    ids = torch.randint(0, 300, (2, 8))
    cfg._attn_implementation = "eager"  # whose attention calls nn.functional.dropout
    compiled = tncompile.compile(BertModel(cfg), mode="graph", target_ratio=0.5, example_inputs={"input_ids": ids})
    targets = [n.target for n in compiled.model.graph.nodes if n.op == "call_function"]
    assert aten.dropout.default not in targets
    from tncompile.runtime.fused.dropout import FastDropout
    record = {r.name: r for r in compiled.program.history}
    assert record["lower_dropout"].matches["dropout-module"] >= 4   # embeddings, attention, 2 outputs
    # eager attention (aten matmul / div / add / softmax, then that dropout, then matmul) fuses,
    # keeping the lowered dropout module
    assert record["fuse_attention"].matches["attention"] == 1
    attention = compiled.model.get_submodule("encoder.layer.0.attention.self.fused_attention.dropout")
    assert type(attention) is FastDropout and attention.p == cfg.attention_probs_dropout_prob


def test_rules_need_canonical_forms():
    program = _program(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)))
    with pytest.raises(ValueError, match="run the canonicalize pass before it"):
        Pipeline(["lower_dropout"]).run(program, progress=False)
    with pytest.raises(ValueError, match="fuse_feed_forward matches canonical ops only"):
        tncompile.compile(mlp((64, 128, 10)), target_ratio=0.3,
                          passes=["tensorize", "assign_ranks", "decompose", "fuse_feed_forward"])


def test_match_counts_in_the_dump(tmp_path):
    compiled = tncompile.compile(small_encoder(), target_ratio=0.3, dump_dir=tmp_path)
    text = (tmp_path / "08-lower_dropout.txt").read_text()
    assert "# matches 01-canonicalize: gelu-module 0, gelu-function 2," in text
    assert "# matches 07-fuse_feed_forward: tt-act-tt 2" in text
    assert "# matches 08-lower_dropout: dropout-module 4, dropout-function 0, attention-dropout 0" in text
    assert compiled.program.history[6].matches == {"tt-act-tt": 2}


def test_a_user_rule():
    """The rule helper is public: a pass of a few lines rewrites x * 1.0 to x."""
    import operator

    def skip(m):
        m.root.replace_all_uses_with(m["x"])
        m.erase_unused()

    class DropTimesOne(tncompile.Pass):
        name = "drop-times-one"

        def run(self, program):
            rule = Rule("mul-one", Pat.call(operator.mul, args=[Pat.any("x"), 1.0], nargs=2), skip)
            apply_rules(program.graph_module, [rule], self.matches)

    program = Pipeline([DropTimesOne()]).run(_program(Spellings()), progress=False)
    assert program.history[-1].matches == {"mul-one": 1}
    assert operator.mul not in _calls(program)


class _TanhFormula(nn.Module):
    """GPT-2's ``gelu_new`` written out, in one of its operand orders, optionally with an
    intermediate read by something else."""

    def __init__(self, flipped: bool = False, leak: bool = False, cubic: float = 0.044715):
        super().__init__()
        self.flipped, self.leak, self.cubic = flipped, leak, cubic

    def forward(self, x):
        import math
        if self.flipped:
            inner = (self.cubic * torch.pow(x, 3.0) + x) * math.sqrt(2.0 / math.pi)
            out = (torch.tanh(inner) + 1.0) * (x * 0.5)
        else:
            inner = math.sqrt(2.0 / math.pi) * (x + self.cubic * torch.pow(x, 3.0))
            out = 0.5 * x * (1.0 + torch.tanh(inner))
        return out + inner if self.leak else out


@pytest.mark.parametrize("flipped", [False, True], ids=["gpt2-order", "flipped-operands"])
def test_the_tanh_gelu_formula_becomes_one_gelu(flipped):
    module = _TanhFormula(flipped)
    program, matches = _canonical(module)
    assert matches["gelu-tanh-formula"] == 1
    assert _calls(program) == [F.gelu] and program.graph_module.code.count("approximate = 'tanh'") == 1
    x = torch.randn(5, 7, dtype=torch.float64)
    torch.testing.assert_close(program.graph_module(x), module(x))
    # torch.export's aten spelling (HF GPT-2 traced in graph mode) too
    exported = torch.export.export(module, (torch.randn(3, 4),)).module()
    gm = fx.GraphModule(exported, exported.graph)
    program = Pipeline([Canonicalize()]).run(Program(gm, InputSpec("export"), 1), progress=False)
    assert program.history[-1].matches["gelu-tanh-formula"] == 1


def test_a_formula_read_elsewhere_or_with_other_constants_is_left_alone():
    for module in (_TanhFormula(leak=True), _TanhFormula(cubic=0.05)):
        program, matches = _canonical(module)
        assert matches["gelu-tanh-formula"] == 0 and F.gelu not in _calls(program)
