"""``dry_run``: will this training step capture as a CUDA graph? Answered on any machine.

A CUDA graph replays a fixed sequence of kernels on fixed memory, so the step
it captures may not read a value back to the host (``.item()``, ``bool(t)``,
``int(t.max())``), make a tensor whose size depends on the data
(``torch.unique``, ``nonzero``, boolean masks), draw random numbers on the CPU,
copy between host and device, or run a CPU kernel. :func:`dry_run` runs
*exactly* the body :class:`~tncompile.train.TrainStep` captures -- forward, rank
penalty, backward, gradient clipping and the capturable optimizer step -- on
fake copies of the model, optimizer, controller and batch, and reports every
such op with the module it ran in and the source line it came from.

How it sees a GPU without one: the copies are ``FakeTensor``\\ s (shapes, dtypes
and devices, no data) under ``torch._subclasses.fake_tensor.FakeTensorMode``,
where reading a value raises ``DataDependentOutputException`` and a
data-sized output raises ``DynamicOutputShapeException``; an op-level
observer above it records those and every other hazard, then lets the run go
on so that one report lists them all. The fake device is ``meta``, not
``cuda``: a CPU-only PyTorch aborts in autograd on fake CUDA tensors (it has
no CUDA device guard). tncompile's code picks its path by "CPU or not", so
``meta`` takes exactly the path CUDA takes (``tuning.TRITON_KERNELS`` included: tncompile's
Triton ops run their fake kernels there, the backends' ``device_ops``) -- and the dry run
checks that no tncompile CPU kernel ran. Limits: ``amp="bf16"`` runs tncompile's autocast
handling, but the casts themselves need a CUDA build of PyTorch to emulate;
the first (warm-up) run of a stage is not checked, as ``TrainStep`` runs it
eagerly before capture.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import linecache
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensor, FakeTensorMode)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..runtime.native import loader as native
from ..runtime.ways import backends
from .ddp import DDP_WARMUP_STEPS, is_ddp, unwrap
from .train_step import TrainStep, checking_on_meta, make_capturable

__all__ = ["dry_run", "DryRunReport", "Hazard", "CaptureError"]

aten = torch.ops.aten

_TORCH_DIR = str(Path(torch.__file__).parent)
_SKIPPED = {str(Path(__file__)), str(Path(native.__file__))}  # this module, and native.watch's wrapper

# ops whose output size depends on tensor values (they raise under FakeTensorMode)
_DYNAMIC = {"nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
            "argwhere", "nonzero_static", "repeat_interleave"}
_HOST_READS = {"_local_scalar_dense", "equal", "is_nonzero"}
_RANDOM = {"random_", "uniform_", "normal_", "bernoulli", "bernoulli_", "exponential_", "geometric_", "cauchy_",
           "log_normal_", "randint", "randint_like", "randn", "randn_like", "rand", "rand_like", "randperm",
           "multinomial", "native_dropout", "normal"}


class CaptureError(RuntimeError):
    """A step that would not capture as a CUDA graph (the message lists why)."""


@dataclass
class Hazard:
    """One op that would break (or silently corrupt) CUDA-graph capture.

    Attributes
    ----------
    kind : str
        ``"host sync"``, ``"dynamic shape"``, ``"cpu randomness"``,
        ``"host-device copy"``, ``"host tensor"``, ``"cpu kernel"``,
        ``"optimizer"``, ``"ddp"`` or ``"error"``.
    op : str
        The ATen (or tncompile) op, e.g. ``aten._local_scalar_dense``.
    where : str
        ``file:line in function: source`` of the innermost frame outside PyTorch.
    module : str
        The innermost module running (``model.token_embedding``), ``""`` outside forward.
    phase : str
        ``forward``, ``rank penalty``, ``backward``, ``gradient clipping`` or ``optimizer step``.
    stage : str
        The controller's stage (``early`` / ``late``), or ``step`` without a controller.
    """

    kind: str
    op: str
    where: str
    module: str
    phase: str
    stage: str

    def __str__(self) -> str:
        inside = f" in {self.module}" if self.module else ""
        return f"[{self.stage}/{self.phase}] {self.kind}: {self.op}{inside} at {self.where}"


@dataclass
class DryRunReport:
    """What :func:`dry_run` found. ``ok`` is true when nothing would break capture."""

    hazards: list[Hazard] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)
    ops: int = 0
    amp: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.hazards

    def raise_if_unsafe(self) -> "DryRunReport":
        """Raise :class:`CaptureError` listing every hazard; return self when there is none."""
        if self.hazards:
            raise CaptureError(str(self))
        return self

    def __str__(self) -> str:
        head = (f"dry run of the captured training step ({', '.join(self.stages)}; {self.ops} ops checked): "
                + ("capturable" if self.ok else f"{len(self.hazards)} op(s) would break CUDA-graph capture"))
        return "\n".join([head, *(f"  {h}" for h in self.hazards), *(f"  note: {n}" for n in self.notes)])


# ----------------------------------------------------------------- where an op came from
def _location() -> tuple[str, str]:
    """``(where, phase)``: the innermost frame outside PyTorch and this module, and the step phase."""
    frames = traceback.extract_stack()[:-3]
    phase = "forward"
    for f in frames:
        name, file = f.name, f.filename
        if file.startswith(_TORCH_DIR):
            if "/optim/" in file and name in ("step", "wrapper"):
                phase = "optimizer step"
            elif name in ("clip_grad_norm_", "clip_grads_with_norm_"):
                phase = "gradient clipping"
            elif name in ("backward", "_engine_run_backward") and phase == "forward":
                phase = "backward"
        elif name in ("penalty", "late_objective", "early_penalty") and phase == "forward":
            phase = "rank penalty"
    return _innermost_outside_torch(frames), phase


def _innermost_outside_torch(frames) -> str:
    """``file:line in function: source`` of the innermost frame outside PyTorch and this module."""
    for f in reversed(frames):
        if not f.filename.startswith(_TORCH_DIR) and f.filename not in _SKIPPED:
            line = f.line or linecache.getline(f.filename, f.lineno).strip()
            return f"{f.filename}:{f.lineno} in {f.name}: {line}"
    return "(inside PyTorch)"


class _Observer(TorchDispatchMode):
    """Records capture hazards of every op, above ``FakeTensorMode``."""

    def __init__(self, report: DryRunReport, modules: list[str]):
        super().__init__()
        self.report, self.modules = report, modules
        self.stage = "step"
        self.checking = False

    def native_call(self, name: str) -> None:
        """A tncompile CPU kernel was called (reported by ``runtime.native.watch``)."""
        self._record("cpu kernel", name)

    def _record(self, kind: str, func) -> None:
        if not self.checking:
            return
        where, phase = _location()
        self.report.hazards.append(Hazard(kind, str(func), where, self.modules[-1] if self.modules else "",
                                          phase, self.stage))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.checking:
            self.report.ops += 1
        name = func.__name__.split(".")[0]
        namespace = getattr(func, "namespace", "aten")
        tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
        if namespace == "tncompile" and name not in backends.device_ops():  # a native kernel reached the dispatcher
            self._record("cpu kernel", func)
        if any(not isinstance(t, FakeTensor) for t in tensors):
            self._record("host tensor", func)  # a real tensor from outside the step: baked in or copied
        if name in _RANDOM and _on_cpu(func, tensors, kwargs):
            self._record("cpu randomness", func)
        if name in ("_to_copy", "copy_", "to") and _crosses_devices(func, args, kwargs):
            self._record("host-device copy", func)
        if name in _HOST_READS:
            self._record("host sync", func)
            return _placeholder_scalar(tensors)
        if name in _DYNAMIC and not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
            self._record("dynamic shape", func)
            return _placeholder_tensor(name, args, kwargs)
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException:
            self._record("host sync", func)
            return _placeholder_scalar(tensors)
        except DynamicOutputShapeException:
            self._record("dynamic shape", func)
            return _placeholder_tensor(name, args, kwargs)


def _flat(args, kwargs) -> Iterator[Any]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _on_cpu(func, tensors, kwargs) -> bool:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device).type == "cpu"
    return bool(tensors) and tensors[0].device.type == "cpu"


def _crosses_devices(func, args, kwargs) -> bool:
    tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
    devices = {t.device.type for t in tensors}
    if kwargs.get("device") is not None:
        devices.add(torch.device(kwargs["device"]).type)
    return len(devices) > 1


def _placeholder_scalar(tensors):
    """A stand-in for a value read to the host (the run goes on to find more hazards)."""
    t = tensors[0] if tensors else None
    if t is None or t.dtype == torch.bool:
        return False
    return 0.0 if t.is_floating_point() else 0


def _placeholder_tensor(name: str, args, kwargs):
    """A stand-in result of a data-sized op: the largest size it could have."""
    x = args[0]
    if name in ("unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"):
        flat = x.reshape(-1)
        return (flat.clone(), torch.zeros(x.shape, dtype=torch.long, device=x.device),
                torch.ones(flat.shape, dtype=torch.long, device=x.device))
    if name in ("nonzero", "argwhere", "nonzero_static"):
        return torch.zeros((x.numel(), x.dim()), dtype=torch.long, device=x.device)
    if name in ("masked_select", "repeat_interleave"):
        return x.reshape(-1).clone()
    return x.clone()


# ----------------------------------------------------------------- fake copies
@contextlib.contextmanager
def _meta_is_a_capture_device() -> Iterator[None]:
    """Let capturable / foreach optimizer code accept ``meta`` tensors, as it
    accepts CUDA ones (only inside the dry run)."""
    patched = []

    def with_meta(original: Callable) -> Callable:
        def devices(*a, **k):
            return [*original(*a, **k), "meta"]
        return devices

    modules = [m for name, m in list(sys.modules.items())
               if m is not None and name.startswith(("torch.optim", "torch.utils._foreach_utils", "torch.nn.utils"))]
    for module in modules:
        for attr in ("_get_capturable_supported_devices", "_get_foreach_kernels_supported_devices"):
            original = getattr(module, attr, None)
            if callable(original):
                patched.append((module, attr, original))
                setattr(module, attr, with_meta(original))
    try:
        yield
    finally:
        for module, attr, original in patched:
            setattr(module, attr, original)


def _fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    with mode:
        f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(f, requires_grad=t.requires_grad)
    return f


def _module_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Parameters, buffers and tensors held as plain attributes (export's constants)."""
    for m in model.modules():
        yield from m._parameters.values()
        yield from m._buffers.values()
        yield from (v for v in vars(m).values() if isinstance(v, torch.Tensor))


def _fake_optimizer(mode, optimizer: torch.optim.Optimizer, memo: dict) -> torch.optim.Optimizer:
    groups = [{**g, "params": [memo[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer)).parameters
    fake = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    for p, state in optimizer.state.items():
        fake.state[memo[id(p)]] = {k: (_fake(mode, v) if isinstance(v, torch.Tensor) else v)
                                   for k, v in state.items()}
    return fake


def _fake_copies(compiled: nn.Module, optimizer, controller, inputs, targets, mode: FakeTensorMode):
    memo: dict[int, Any] = {}
    for t in _module_tensors(compiled):
        if t is not None and id(t) not in memo:
            memo[id(t)] = _fake(mode, t)
    fake_opt = _fake_optimizer(mode, optimizer, memo)
    memo[id(optimizer)] = fake_opt
    if controller is not None:
        for v in vars(controller).values():
            if isinstance(v, torch.Tensor):
                memo[id(v)] = _fake(mode, v)
    fake_compiled, fake_ctl = copy.deepcopy((compiled, controller), memo)
    batch = tree_map(lambda v: _fake(mode, v) if isinstance(v, torch.Tensor) else v, (inputs, targets))
    return fake_compiled, fake_opt, fake_ctl, batch


# ----------------------------------------------------------------- the dry run
def dry_run(compiled: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, inputs: Any, targets: Any,
            *, controller=None, amp: str | None = None, grad_clip: float | None = None,
            stages: tuple[str, ...] | None = None) -> DryRunReport:
    """Run the training step :class:`TrainStep` would capture, on fake device
    copies, and report every op that would break CUDA-graph capture.

    Nothing of the arguments is changed: the model, optimizer, controller
    and batch are copied (as fake tensors: no memory, no data).

    Parameters
    ----------
    compiled : nn.Module
        A compiled model (or any module), as given to ``TrainStep``; a
        ``DistributedModel`` / DDP wrapper is checked through the model it
        wraps, plus what capture needs of DDP (see the report's notes).
    optimizer : torch.optim.Optimizer
        It is switched to its capturable mode in the copy, as ``TrainStep`` does.
    loss_fn, inputs, targets
        As for ``TrainStep``: ``loss_fn(compiled(inputs), targets)``.
    controller : RankController, optional
        Its penalty runs inside the step; both stages are checked.
    amp : {None, "bf16"}
        Run under autocast as ``TrainStep(amp=...)`` does (see the module doc).
    grad_clip : float, optional
        Clip gradients inside the step, as ``TrainStep(grad_clip=...)``.
    stages : tuple of str, optional
        Which controller stages to check (default: ``("early", "late")``
        from the controller's current stage on; ``("step",)`` without one).

    Returns
    -------
    DryRunReport
        ``report.ok``; ``report.hazards`` (kind, op, module, source line,
        phase, stage); ``str(report)``; ``report.raise_if_unsafe()``.
    """
    wrapper = compiled if unwrap(compiled) is not compiled else None
    compiled = unwrap(compiled)
    if controller is not None and getattr(controller, "compiled", None) is not compiled:
        raise ValueError("dry_run: the controller was built for a different model")
    _check_optimizer(optimizer, compiled)
    if stages is None:
        stages = ("step",) if controller is None else (("early", "late") if controller.stage == "early" else ("late",))
    stages = _checked_stages(stages, controller)
    report = DryRunReport(stages=list(stages), amp=amp)
    if wrapper is not None:
        _check_wrapper(wrapper, controller, report, stages[0])
    if amp is not None and not torch.cuda.is_available():
        report.notes.append("amp: this PyTorch has no CUDA, so autocast's casts are not emulated; "
                            "tncompile's autocast handling ran")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    modules: list[str] = []
    observer = _Observer(report, modules)
    model, opt, ctl, (fake_inputs, fake_targets) = _fake_copies(compiled, optimizer, controller, inputs, targets,
                                                                mode)
    names = {id(m): n for n, m in model.named_modules()}

    def enter(module, args) -> None:  # hooks must return None: a value would replace args / outputs
        modules.append(names.get(id(module), type(module).__name__))

    def leave(module, args, output) -> None:
        if modules:
            modules.pop()

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave)
    try:
        with _meta_is_a_capture_device(), native.watch(observer.native_call):
            for group in opt.param_groups:  # fused kernels have no meta form for every optimizer (SGD's):
                if group.get("fused"):      # the copy steps with foreach, capture-safe as the fused kernel is
                    group["fused"], group["foreach"] = False, True
            try:
                make_capturable(opt)
            except TypeError as e:
                report.hazards.append(Hazard("optimizer", type(opt).__name__, str(e), "", "optimizer step",
                                             stages[0]))
                return report
            with checking_on_meta():
                step = TrainStep(model, opt, loss_fn, controller=ctl, cuda_graph=False, amp=amp, grad_clip=grad_clip)
            step.use_graphs = True         # the captured path's settings (autocast without cast cache)
            step.autocast_device = "cuda"  # as on the GPU; a no-op on a PyTorch without CUDA
            with mode, observer:
                for stage in stages:
                    observer.stage = stage
                    if ctl is not None and stage == "late" and ctl.stage == "early":
                        if ctl.smoothed_loss() is None:  # the early stage never reached its penalty
                            report.notes.append("late stage not checked: the early stage did not complete")
                            break
                        ctl.start_late_stage()
                    for checking in (False, True):  # warm-up (eager before capture), then the captured body
                        observer.checking = checking
                        _run_body(step, fake_inputs, fake_targets, report, observer)
    finally:
        pre.remove()
        post.remove()
    return report


def _check_optimizer(optimizer, compiled: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"dry_run: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    own = {id(p) for p in compiled.parameters()}
    foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    if foreign:
        raise ValueError(f"dry_run: the optimizer holds {len(foreign)} parameter(s) that are not this model's "
                         f"(shapes {foreign[:3]}); build it from the model you check, e.g. "
                         "torch.optim.AdamW(compiled.parameters())")


def _checked_stages(stages: Any, controller) -> tuple[str, ...]:
    """``stages`` as a non-empty tuple of the stage names this step has: ``"step"`` without a
    controller, ``"early"`` / ``"late"`` with one (an empty check would report a pass)."""
    allowed = ("step",) if controller is None else ("early", "late")
    if isinstance(stages, str):
        raise TypeError(f"dry_run: stages must be a tuple of stage names, e.g. stages=({stages!r},), "
                        f"not the string {stages!r}")
    if not isinstance(stages, (tuple, list)) or not stages:
        raise ValueError(f"dry_run: stages must be a non-empty tuple drawn from {allowed}, got {stages!r}: "
                         "checking nothing would report the step capturable")
    unknown = [s for s in stages if s not in allowed]
    if unknown:
        raise ValueError(f"dry_run: unknown stage(s) {unknown}; with{'out' if controller is None else ''} a "
                         f"controller the stages are {allowed}")
    if len(set(stages)) != len(stages):
        raise ValueError(f"dry_run: stages {tuple(stages)} repeats a stage")
    return tuple(stages)


def _check_wrapper(wrapper: nn.Module, controller, report: DryRunReport, stage: str) -> None:
    """A DDP / DistributedModel wrapper: what capture needs of it (its own all-reduces need a
    process group and real tensors, so the step checked is that of the model it wraps)."""
    if not is_ddp(wrapper):
        return
    if controller is not None and not hasattr(wrapper, "after_step"):
        report.hazards.append(Hazard(
            "ddp", "DistributedDataParallel", "a plain DDP wrapper keeps reducing the parameters a rank cut "
            "replaces: wrap the compiled model in tncompile.distributed.DistributedModel", "", "rank cut", stage))
        return
    report.notes.append(f"DDP: the step of the wrapped model was checked (DDP's gradient all-reduces need a "
                        f"process group); TrainStep builds DDP on its capture stream and runs {DDP_WARMUP_STEPS} "
                        "eager DDP steps before each capture, and again after every cut (a new DDP wrapper)")


def _run_body(step: TrainStep, inputs, targets, report: DryRunReport, observer: _Observer) -> None:
    try:
        step._body(inputs, targets, set_to_none=False)
    except Exception as e:  # noqa: BLE001 - reported, not raised: the report says what broke
        if observer.checking or not report.hazards:
            where, phase = _location_of(e)
            report.hazards.append(Hazard("error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", where,
                                         "", phase, observer.stage))


def _location_of(e: BaseException) -> tuple[str, str]:
    return _innermost_outside_torch(traceback.extract_tb(e.__traceback__)), "step"
