"""Distillation from a teacher (the user's original model) for :func:`tncompile.fit`.

Each step the teacher runs on the same inputs without autograd (in eval
mode, put back as it was afterwards); what the :class:`Distill` spec names is
read from both models -- the output's logits, its main tensor, the outputs of
modules matched by name (forward hooks), a pooled vector -- and the student's
loss is a weighted sum of:

- ``logits``: ``KL(softmax(t / T) || softmax(s / T)) * T^2`` over the last dim;
- ``output``: relative MSE ``mean((s - t)^2) / mean(t^2)`` of the main output tensor;
- ``hidden``: relative MSE of each matched module's output, averaged over the pairs
  (``hidden_blocks``: every block of the model's layer stacks, matched by name);
- ``pooled``: ``1 - cos(pool(s), pool(t))``, averaged over the batch;
- ``task``: the task loss ``loss_fn(outputs, targets)`` when there is one.

Relative errors make the terms scale-free, so weights of 1 mix sensibly.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .train_step import call_model
from ..errors import check_float

__all__ = ["Distill", "Teacher", "distill_loss", "main_tensor", "logits_of", "block_names"]


@dataclass
class Distill:
    """What the student learns from the teacher, and how much of each.

    Parameters
    ----------
    logits : float
        Weight of the temperature-softened KL divergence on the output's logits
        (``output.logits``, ``output["logits"]``, or the output tensor itself).
    temperature : float
        Softening temperature ``T`` of the logits term.
    output : float
        Weight of the relative MSE between the main output tensors (a model
        output's first tensor field other than ``loss``: ``last_hidden_state``,
        ``logits``; a tuple's first tensor; a tensor).
    hidden : dict or list of str, optional
        ``{student module name: teacher module name}``, or names present in
        both: their outputs (a tuple's first tensor) are matched by relative MSE.
        In graph mode only modules that run as calls of the traced graph (layers,
        ``torch.nn`` leaves) can be hooked; swap mode keeps every module.
    hidden_weight : float
        Weight of the hidden-state term (its pairs are averaged).
    hidden_blocks : bool
        Also match the output of every block of the teacher's repeated stacks
        (each item of an outermost ``nn.ModuleList`` / ``nn.Sequential`` of two
        or more modules of one class, such as HF's ``encoder.layer.N`` or
        ``model.layers.N``) with the student's module of the same name: what
        swap mode keeps. Layer-by-layer targets recover a compressed model
        faster than its output alone (all-MiniLM-L6-v2 at 0.3: cosine 0.705 vs
        0.696 and probe 0.762 vs 0.750 after 4 minutes).
    mask_padding : bool
        Leave padding out of the ``output`` and ``hidden`` terms: when a batch is
        a dict with an ``attention_mask`` of shape ``(batch, sequence)`` (HF
        tokenizers' padded batches), positions where it is 0 do not count in
        tensors whose leading dims are ``(batch, sequence)``.
    pool : callable, optional
        ``pool(output, inputs) -> (batch, dim)``: e.g. the attention-mask mean
        of ``last_hidden_state`` for sentence embeddings.
    pooled : float
        Weight of ``1 - cosine`` between the pooled vectors (needs ``pool``).
    task : float
        Weight of the task loss (``fit(loss_fn=...)``); ignored without one.

    ``Distill()`` with every weight left at zero means: KL on logits when the
    teacher's output has them, else relative MSE on the main output.
    """

    logits: float = 0.0
    temperature: float = 2.0
    output: float = 0.0
    hidden: Mapping[str, str] | Sequence[str] | None = None
    hidden_weight: float = 1.0
    hidden_blocks: bool = False
    mask_padding: bool = True
    pool: Callable[[Any, Any], torch.Tensor] | None = None
    pooled: float = 0.0
    task: float = 1.0

    def __post_init__(self) -> None:
        for name in ("logits", "output", "hidden_weight", "pooled", "task"):
            value = getattr(self, name)
            check_float(value, f"Distill.{name}", 0.0)
        check_float(self.temperature, "Distill.temperature", 0.0, low_open=True)
        if self.pooled and self.pool is None:
            raise ValueError("Distill.pooled needs pool=<callable(output, inputs) -> (batch, dim)>, e.g. the "
                             "attention-mask mean of last_hidden_state")
        for flag in ("hidden_blocks", "mask_padding"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"Distill.{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.pool is not None and not callable(self.pool):
            raise TypeError(f"Distill.pool must be callable as pool(output, inputs), got {type(self.pool).__name__}")
        self.hidden = _hidden_pairs(self.hidden)

    @property
    def pairs(self) -> dict[str, str]:
        return dict(self.hidden or {})

    def is_empty(self) -> bool:
        """No output-side term: ``Distill()`` then picks logits or the main output
        (``hidden_blocks`` alone adds to that default)."""
        return not (self.logits or self.output or self.pairs or self.pooled)


def _hidden_pairs(hidden: Any) -> dict[str, str]:
    if hidden is None:
        return {}
    if isinstance(hidden, str):
        hidden = [hidden]
    if isinstance(hidden, Mapping):
        pairs = dict(hidden)
    elif isinstance(hidden, Sequence):
        pairs = {name: name for name in hidden}
    else:
        raise TypeError(f"Distill.hidden must be a dict {{student module: teacher module}} or a list of module "
                        f"names, got {type(hidden).__name__}")
    for s, t in pairs.items():
        if not isinstance(s, str) or not isinstance(t, str):
            raise TypeError(f"Distill.hidden names must be strings, got {s!r}: {t!r}")
    return pairs


def block_names(model: nn.Module) -> list[str]:
    """Names of the blocks of ``model``'s repeated stacks: the items of each
    outermost ``nn.ModuleList`` / ``nn.Sequential`` holding two or more modules
    of one class that have submodules of their own (transformer layers, not a
    ``Sequential`` of two ``Linear``)."""
    names: list[str] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue  # inside a block already chosen (an MoE layer's experts)
        items = list(module)
        if len({type(m) for m in items}) != 1 or not all(any(True for _ in m.children()) for m in items):
            continue
        taken.extend(f"{name}.{i}" if name else str(i) for i in range(len(items)))
        names.extend(f"{name}.{i}" if name else str(i) for i in range(len(items)))
    return names


def main_tensor(output: Any, what: str = "output") -> torch.Tensor:
    """The main tensor of a model output: a tensor; a mapping's / ``ModelOutput``'s
    first tensor value other than ``loss``; a tuple's first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) or hasattr(output, "items"):
        for key, value in output.items():
            if key != "loss" and isinstance(value, torch.Tensor):
                return value
    if isinstance(output, (tuple, list)):
        for value in output:
            if isinstance(value, torch.Tensor):
                return value
    raise TypeError(f"distillation: the {what} holds no tensor to match ({type(output).__name__})")


def logits_of(output: Any) -> torch.Tensor | None:
    """``output.logits`` / ``output["logits"]``, a bare tensor, else ``None``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) or hasattr(output, "items"):
        value = output.get("logits") if hasattr(output, "get") else None
        return value if isinstance(value, torch.Tensor) else None
    return None


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _capture(model: nn.Module, names: Sequence[str], store: dict[str, torch.Tensor], role: str) -> list:
    handles = []
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"Distill.hidden: the {role} has no module named {name!r}") from None

        def hook(mod, args, out, name=name):
            store[name] = main_tensor(out, f"output of {role} module {name!r}")
        handles.append(module.register_forward_hook(hook))
    return handles


class Teacher:
    """Runs the teacher and keeps what the student is matched against.

    The teacher is never modified: no autograd, hooks removed on :meth:`close`,
    its training flag put back. ``record(inputs)`` returns a dict of tensors
    (part of the step's targets, so a captured step copies them like any target).
    """

    def __init__(self, teacher: nn.Module, student: nn.Module, spec: Distill | None):
        if not isinstance(teacher, nn.Module):
            raise TypeError(f"fit: teacher must be an nn.Module (the original model), got {type(teacher).__name__}")
        if teacher is student:
            raise ValueError("fit: the teacher is the student itself; pass the original model (compile without "
                             "inplace=True keeps it)")
        mine = {id(p) for p in student.parameters()}
        shared = [n for n, p in teacher.named_parameters() if id(p) in mine]
        if shared:
            raise ValueError(f"fit: the teacher shares parameters with the student ({shared[:3]}); training would "
                             "change the teacher. Distill from an unmodified copy of the original model "
                             "(compile without inplace=True)")
        self.teacher, self.student = teacher, student
        if spec is not None and not isinstance(spec, Distill):
            raise TypeError(f"fit: distill must be a tncompile.Distill, got {type(spec).__name__}")
        self.spec = dataclasses.replace(spec) if spec is not None else Distill()  # resolving never edits the user's
        self.teacher_hidden: dict[str, torch.Tensor] = {}
        self.student_hidden: dict[str, torch.Tensor] = {}
        self._resolved = not self.spec.is_empty()  # hidden_blocks alone keeps the default output term
        if self.spec.hidden_blocks:
            blocks = block_names(teacher)
            if not blocks:
                raise ValueError(f"Distill.hidden_blocks: {type(teacher).__name__} has no repeated stack of blocks "
                                 "(an nn.ModuleList of layers); name the modules to match with hidden= instead")
            missing = [b for b in blocks if not _has_module(student, b)]
            if missing:
                raise ValueError(f"Distill.hidden_blocks: the student has no module {missing[0]!r} (of "
                                 f"{len(missing)} blocks); a graph-mode CompiledModel keeps only its layers. "
                                 "Compile with mode='swap', or match layers by name with hidden=")
            self.spec.hidden = {**{b: b for b in blocks}, **self.spec.pairs}
        pairs = self.spec.pairs
        self._handles = (_capture(teacher, list(dict.fromkeys(pairs.values())), self.teacher_hidden, "teacher")
                         + _capture(student, list(pairs), self.student_hidden, "student"))
        self._was_training = teacher.training

    def record(self, inputs: Any) -> dict[str, Any]:
        """The teacher's side of one batch (no autograd)."""
        self.teacher_hidden.clear()
        self.teacher.eval()
        with torch.no_grad():
            out = call_model(self.teacher, inputs)
        if not self._resolved:  # Distill(): logits when the output has them, else the main output
            self.spec.logits = 1.0 if logits_of(out) is not None and not isinstance(out, torch.Tensor) else 0.0
            self.spec.output = 0.0 if self.spec.logits else 1.0
            self._resolved = True
        rec: dict[str, Any] = {}
        if self.spec.logits:
            logits = logits_of(out)
            if logits is None:
                raise ValueError("Distill.logits: the teacher's output has no logits (a tensor, .logits or "
                                 "['logits']); use output= or hidden= instead")
            rec["logits"] = logits
        if self.spec.output:
            rec["output"] = main_tensor(out, "teacher's output")
        if self.spec.pairs:
            missing = [t for t in self.spec.pairs.values() if t not in self.teacher_hidden]
            if missing:
                raise ValueError(f"Distill.hidden: teacher modules {missing} did not run on this batch")
            rec["hidden"] = {t: self.teacher_hidden[t] for t in self.spec.pairs.values()}
        if self.spec.pooled:
            rec["pooled"] = self.spec.pool(out, inputs)
        return rec

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.teacher.train(self._was_training)


def _relative_mse(s: torch.Tensor, t: torch.Tensor, what: str, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``mean((s - t)^2) / mean(t^2)``; with a ``(batch, sequence)`` mask matching the
    tensors' leading dims, over the masked-in positions only (no data-dependent shapes)."""
    if s.shape != t.shape:
        raise ValueError(f"distillation: {what} has shape {tuple(s.shape)} in the student and {tuple(t.shape)} "
                         "in the teacher")
    t = t.to(s.dtype)
    tiny = torch.finfo(s.dtype).tiny
    if mask is not None and s.dim() >= 3 and tuple(s.shape[:2]) == tuple(mask.shape):
        m = mask.to(s.dtype).reshape(*mask.shape, *([1] * (s.dim() - 2)))
        return ((s - t).pow(2) * m).sum() / (t.pow(2) * m).sum().clamp_min(tiny)
    return (s - t).pow(2).mean() / t.pow(2).mean().clamp_min(tiny)


def _padding_mask(inputs: Any) -> torch.Tensor | None:
    """The batch's ``attention_mask`` (``(batch, sequence)``, 1 = a real token), if it has one."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    return mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def distill_loss(teacher: Teacher, loss_fn: Callable | None) -> Callable[[Any, Any], torch.Tensor]:
    """``loss(outputs, (targets, teacher_record, inputs))`` for :class:`~.train_step.TrainStep`."""
    spec = teacher.spec

    def loss(outputs: Any, packed: Any) -> torch.Tensor:
        targets, rec, inputs = packed
        mask = _padding_mask(inputs) if spec.mask_padding else None
        terms = []
        if loss_fn is not None and spec.task:
            terms.append(spec.task * loss_fn(outputs, targets))
        if spec.logits:
            s = logits_of(outputs)
            if s is None:
                raise ValueError("Distill.logits: the student's output has no logits")
            temp = spec.temperature
            kl = F.kl_div(F.log_softmax(s.float() / temp, -1), F.log_softmax(rec["logits"].float() / temp, -1),
                          reduction="none", log_target=True).sum(-1).mean()
            terms.append(spec.logits * kl * temp * temp)
        if spec.output:
            terms.append(spec.output * _relative_mse(main_tensor(outputs, "student's output"), rec["output"],
                                                     "the main output", mask))
        if spec.pairs:
            hidden = []
            for s_name, t_name in spec.pairs.items():
                if s_name not in teacher.student_hidden:
                    raise ValueError(f"Distill.hidden: student module {s_name!r} did not run (graph mode calls only "
                                     "layers and torch.nn leaves; compile with mode='swap' to match any module)")
                hidden.append(_relative_mse(teacher.student_hidden[s_name], rec["hidden"][t_name],
                                            f"module {s_name!r}", mask))
            teacher.student_hidden.clear()
            terms.append(spec.hidden_weight * torch.stack(hidden).mean())
        if spec.pooled:
            s = spec.pool(outputs, inputs)
            terms.append(spec.pooled * (1 - F.cosine_similarity(s.float(), rec["pooled"].float(), dim=-1)).mean())
        if not terms:
            raise ValueError("fit: nothing to minimize: Distill has every weight at zero and there is no task loss")
        return torch.stack([t.float() for t in terms]).sum()
    return loss
