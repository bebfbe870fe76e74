"""The fast CPU allocator setting is on by default, once a TT layer runs on CPU, with an opt-out."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = r"""
import torch, tncompile
from tncompile.runtime import TTLinear, TTMEmbedding
from tncompile.runtime.kernels import cpu_allocator
before = cpu_allocator.retained()
torch.nn.Linear(8, 8)(torch.randn(2, 8))      # a dense layer alone changes nothing
dense_only = cpu_allocator.retained()
layer = TTLinear.from_linear(torch.nn.Linear(64, 48), rank=4) if "{kind}" == "linear" else \
    TTMEmbedding.from_embedding(torch.nn.Embedding(500, 32), rank=4)
inp = torch.randn(3, 64) if "{kind}" == "linear" else torch.randint(0, 500, (3,))
layer(inp)
print(before, dense_only, cpu_allocator.retained())
"""


def _run(kind: str, opt_out: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TNCOMPILE_RETAIN_FREED_MEMORY"}
    if opt_out is not None:
        env["TNCOMPILE_RETAIN_FREED_MEMORY"] = opt_out
    done = subprocess.run([sys.executable, "-c", SCRIPT.replace("{kind}", kind)], capture_output=True, text=True,
                          env=env, check=True, timeout=300)
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_first_cpu_forward_keeps_freed_memory(kind):
    assert _run(kind, None) == "False False True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("value", ["0", "off"])
def test_environment_variable_opts_out(value):
    assert _run("linear", value) == "False False False"


def test_importable_after_import_tncompile():
    import tncompile
    assert callable(tncompile.runtime.kernels.cpu_allocator.retain_freed_memory)


PEAK_SCRIPT = r"""
import torch
from tncompile.runtime.kernels.cpu_allocator import release_freed_memory, retain_freed_memory

def rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field))

retain_freed_memory()
building = [torch.ones(1 << 20) for _ in range(64)]   # 256 MB built, then freed: glibc keeps it
del building
if {release}:
    release_freed_memory()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = rss_kb("VmRSS")
step = [torch.ones(1 << 20) for _ in range(32)]       # what a training step needs: 128 MB
print((rss_kb("VmHWM") - base) // 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim, /proc")
def test_a_steps_peak_is_measured_only_once_freed_memory_is_given_back():
    """What the demo and bench_step_memory measure: without release_freed_memory the step reuses
    what building freed and its peak reads as nearly nothing (the demo printed 183x)."""
    def peak_mb(release: bool) -> int:
        done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT.replace("{release}", str(release))],
                              capture_output=True, text=True, check=True, timeout=300)
        return int(done.stdout.strip().splitlines()[-1])
    assert peak_mb(False) < 32
    assert peak_mb(True) >= 120


@pytest.mark.parametrize("switch", ["on", "tuning-off", "env-off"])
def test_report_says_whether_tncompile_changed_the_allocator(switch):
    """Issue 65 item 7: the process-wide ``mallopt`` is named where users look -- a measured
    report -- and ``tuning.RETAIN_FREED_MEMORY = False`` (or the environment variable) keeps
    glibc untouched. A fresh process each: the setting is once per process."""
    code = textwrap.dedent(f"""
        import torch, warnings, tncompile
        from tncompile.testing import mlp
        from tncompile.runtime.kernels import cpu_allocator
        warnings.simplefilter("ignore")
        if {switch == "tuning-off"!r}:
            tncompile.tuning.RETAIN_FREED_MEMORY = False
        c = tncompile.compile(mlp((64, 256, 256, 10)), 0.3)
        c(torch.randn(32, 64)).sum().backward()
        print(cpu_allocator.retained())
        print(str(c.report(torch.randn(32, 64))).splitlines()[-1])
    """)
    env = dict(os.environ)
    env.pop("TNCOMPILE_RETAIN_FREED_MEMORY", None)
    if switch == "env-off":
        env["TNCOMPILE_RETAIN_FREED_MEMORY"] = "0"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    retained, line = out.stdout.strip().splitlines()[-2:]
    if switch == "on":
        assert retained == "True" and line.startswith("CPU allocator: glibc keeps freed memory")
    else:
        assert retained == "False" and line == "CPU allocator: glibc's own, untouched by tncompile (opted out)"
