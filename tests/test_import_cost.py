"""``import tncompile`` and an eager compile-and-train never import ``torch._dynamo``
(1.5-3 s on these machines) -- only ``torch.compile`` does, when the user calls it -- nor
Triton (about 0.5 s), imported the first time a call could use it."""
import subprocess
import sys

import torch

from tncompile.runtime.native import constant_while_traced, never_traced


def test_eager_use_imports_neither_dynamo_nor_triton():
    """In a fresh process: ``import tncompile``, a compile and training steps (a new bucket
    planned on the way) import neither; Triton loads once its switch is on, and its loader
    fires where the backend is measured."""
    code = ("import sys, torch, tncompile\n"
            "from tncompile import tuning\n"
            "from tncompile.runtime.ways import backends\n"
            "heavy = ('torch._dynamo', 'triton', 'tncompile.runtime.triton')\n"
            "assert not [m for m in heavy if m in sys.modules], 'import tncompile'\n"
            "loader_on = backends._LOADERS['triton'][0]\n"
            "m = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 256), torch.nn.ReLU(),\n"
            "                        torch.nn.Linear(256, 64))\n"
            "c = tncompile.compile(m, target_ratio=0.3, prefer='size')\n"
            "c(torch.randint(0, 512, (4, 8))).sum().backward()\n"
            "c(torch.randint(0, 512, (40, 8))).sum().backward()   # a new bucket: planned now\n"
            "assert not [m for m in heavy if m in sys.modules], 'compile and train'\n"
            "assert 'triton' not in backends.registered(), 'loaded by a CPU call with the switch off'\n"
            "with tuning.override(TRITON_KERNELS=True):\n"
            "    backends.active(torch.zeros(1), 'thin_pair')\n"
            "assert 'triton' in backends.registered() and 'thin_pair' in backends.device_ops()\n"
            "assert not backends._LOADERS\n"
            "from tncompile.runtime.triton.backend import MEASURED_ON\n"
            "assert loader_on == MEASURED_ON, (loader_on, MEASURED_ON)\n")
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
