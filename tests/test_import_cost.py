"""``import tncompile`` and an eager compile-and-train never import ``torch._dynamo``
(1.5-3 s on these machines) -- only ``torch.compile`` does, when the user calls it."""
import subprocess
import sys

import torch

from tncompile.runtime.native import constant_while_traced, never_traced


def test_eager_use_never_imports_dynamo():
    code = ("import sys, torch, tncompile\n"
            "assert 'torch._dynamo' not in sys.modules, 'import tncompile'\n"
            "m = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 256), torch.nn.ReLU(),\n"
            "                        torch.nn.Linear(256, 64))\n"
            "c = tncompile.compile(m, target_ratio=0.3, prefer='size')\n"
            "c(torch.randint(0, 512, (4, 8))).sum().backward()\n"
            "c(torch.randint(0, 512, (40, 8))).sum().backward()   # a new bucket: planned now\n"
            "assert 'torch._dynamo' not in sys.modules, 'compile and train'\n")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_constant_mark_is_torchs_own():
    """Dynamo reads exactly what ``torch.compiler.assume_constant_result`` sets; ours must set
    the same (a torch that changes its mark fails here, not silently under compile)."""
    def theirs():
        return 1

    def ours():
        return 1
    assert torch.compiler.assume_constant_result(theirs) is theirs
    assert constant_while_traced(ours) is ours
    assert vars(ours) == vars(theirs) and vars(ours)


def test_never_traced_runs_the_function_and_dynamo_does_not_trace_it():
    """Eagerly the function itself; under ``torch.compile`` a graph break around it, as
    ``torch.compiler.disable`` gives (traced in, its op would join the graph)."""
    def host_side(x):
        return x.exp()
    ours, theirs = never_traced(host_side), torch.compiler.disable(host_side)
    x = torch.randn(3)
    assert torch.equal(ours(x), x.exp())
    for wrapped in (ours, theirs):
        explained = torch._dynamo.explain(lambda t: (wrapped(t * 2) + 1).sin())(x)
        assert explained.graph_break_count >= 1, explained
        assert not any("exp" in str(g.graph) for g in explained.graphs)
    traced_in = torch._dynamo.explain(lambda t: (host_side(t * 2) + 1).sin())(x)
    assert any("exp" in str(g.graph) for g in traced_in.graphs)    # the check can fail
