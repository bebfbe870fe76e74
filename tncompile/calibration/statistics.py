"""What calibration inputs tell about each dense layer, gathered in one pass.

For a linear layer: the second moment of its inputs, ``C = X^T X / rows``
(``in x in``), which is all a fit to the layer's *outputs* needs:
``||X (W - W')^T||^2 / rows = tr((W - W') C (W - W')^T)``. Layers fed the same
tensor (an attention block's query, key and value) share one matrix. For an
embedding (or bag): how often each row was looked up. Nothing else is kept:
memory is the covariances plus the activations of one calibration batch.

With ``sensitivity=True`` each batch also runs backward once, to weigh each
layer by how much the *model's* outputs move when the layer's output does: a
relative error ``e`` in layer ``l``'s output ``Y`` (spread evenly over its
entries) moves the model's outputs ``F`` by about
``e ||Y||^2 ||dF/dY||_F^2 / numel(Y)`` (first order). The Jacobian's Frobenius
norm comes from one vector-Jacobian product per batch with a random sign vector
``v`` (Hutchinson: ``E||J^T v||^2 = ||J||_F^2``), every layer at once; each
floating output of the model is scaled by its norm, so the sum is of *relative*
output errors. :mod:`.allocation` spends the parameter budget with these weights.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import tuning
from ..frontend.layers import is_embedding, is_embedding_bag, is_linear
from ..ir.calls import call_model
from ..passes.infra.progress import progress as progress_bar
from .layer_fit import normalized_root

__all__ = ["CalibrationStats", "InputMoment", "collect_statistics"]


@dataclass
class InputMoment:
    """Running ``sum x x^T`` (float64) over the rows a linear layer saw: those the fit uses
    (``total``, ``rows``) and those held out to judge it (``held_total``, ``held_rows``:
    every ``tuning.CALIBRATION_HOLD_OUT``-th sample of a batch, or of the batches when a
    batch has fewer samples)."""

    total: torch.Tensor
    rows: int = 0
    held_total: torch.Tensor | None = None
    held_rows: int = 0
    #: ``(ridge, rows, total's version) -> Cholesky root`` of the normalized moment: layers fed
    #: the same input (query, key, value) and both calibration passes share one factorization
    _root: dict = field(default_factory=dict, repr=False, compare=False)

    def second_moment(self) -> torch.Tensor:
        """``C = X^T X / rows``, shape ``(in, in)``, float64."""
        return self.total / max(self.rows, 1)

    def normalized_root(self, ridge: float) -> torch.Tensor:
        """``L`` with ``L L^T`` = ``C`` normalized to mean eigenvalue 1 plus ``ridge * I``
        (:func:`~.layer_fit.normalized_root`), computed once per state of the sums."""
        key = (float(ridge), self.rows, self.total._version)
        if key not in self._root:
            self._root.clear()
            self._root[key] = normalized_root(self.second_moment(), ridge)
        return self._root[key]

    def held_out_moment(self) -> torch.Tensor | None:
        """``C`` of the held-out rows, or ``None`` when none were held out."""
        return None if self.held_total is None or self.held_rows == 0 else self.held_total / self.held_rows

    def copy(self) -> "InputMoment":
        return InputMoment(self.total.clone(), self.rows,
                           None if self.held_total is None else self.held_total.clone(), self.held_rows)


@dataclass
class CalibrationStats:
    """Per-layer statistics of a model on calibration inputs, keyed by the
    identity of the layer's weight ``Parameter`` (the same object the passes
    see, whatever the layer is called in the traced graph).

    Attributes
    ----------
    moments : dict
        ``id(weight) -> InputMoment`` of every linear layer that ran.
    counts : dict
        ``id(weight) -> int64 tensor (num_embeddings,)``: lookups per row.
    sensitivity : dict
        ``("linear" | "table", id(weight)) -> float``: the model outputs' squared
        relative change per unit relative error of the layer's output, summed
        over batches (empty unless collected with ``sensitivity=True``).
    batches : int
        Calibration batches run.
    """

    moments: dict[int, InputMoment] = field(default_factory=dict)
    counts: dict[int, torch.Tensor] = field(default_factory=dict)
    sensitivity: dict[tuple[str, int], float] = field(default_factory=dict)
    batches: int = 0
    _weights: list = field(default_factory=list, repr=False)  # keeps the ids valid

    def moment_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``C`` of the linear layer holding ``weight``, or ``None`` if it never ran."""
        m = self.moments.get(id(weight))
        return None if m is None or m.rows == 0 else m.second_moment()

    def held_out_moment_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``C`` of the rows held out from the fit, or ``None`` (none held out, never ran)."""
        m = self.moments.get(id(weight))
        return None if m is None else m.held_out_moment()

    def rows_of(self, weight: torch.Tensor) -> int:
        """Rows (samples times positions) the fit of the layer holding ``weight`` saw."""
        m = self.moments.get(id(weight))
        return 0 if m is None else m.rows

    def counts_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """Lookups per row of the table ``weight``, or ``None`` if it never ran."""
        return self.counts.get(id(weight))

    def sensitivity_of(self, weight: torch.Tensor, role: str) -> float | None:
        """Output sensitivity of the ``role`` (``"linear"`` or ``"table"``) layer
        holding ``weight``; ``None`` if not measured. 0.0: its output never
        reached the model's outputs."""
        if not self.sensitivity:
            return None
        return self.sensitivity.get((role, id(weight)), 0.0)


class _Recorder:
    """Forward hooks on every dense layer; one calibration batch at a time.

    Within a batch each layer notes which input tensors it saw and each
    distinct tensor's ``x^T x`` is computed once. At the end of the batch the
    layers that saw the same tensors share one running sum: layers fed alike
    in every batch so far keep sharing; a layer whose inputs start to differ
    gets its own copy of the sum (identical up to then)."""

    def __init__(self, stats: CalibrationStats):
        self.stats = stats
        self.grams: dict[int, tuple] = {}  # id(x) -> (x, fit x^T x, rows, held-out x^T x, rows)
        self.seen: dict[int, list[int]] = defaultdict(list)                  # id(weight) -> [id(x), ...]
        self.outputs: list[tuple[tuple[str, int], torch.Tensor]] = []         # (role, id(weight)), output
        self.signs = torch.Generator().manual_seed(0)                         # Hutchinson vectors

    def output_hook(self, role: str, weight: torch.Tensor):
        """Keeps the layer's output for :meth:`measure_sensitivity`; an output that
        does not require grad (frozen weights) is replaced by an equal leaf that does."""
        def hook(module, args, out):
            if not isinstance(out, torch.Tensor) or not out.is_floating_point() or not torch.is_grad_enabled():
                return None
            replaced = None
            if not out.requires_grad:
                out = replaced = out.detach().requires_grad_(True)
            self.outputs.append(((role, id(weight)), out))
            return replaced
        return hook

    def measure_sensitivity(self, model_output: Any) -> None:
        """One vector-Jacobian product from the model's floating outputs (each over
        its norm, times random signs) back to every recorded layer output."""
        outputs, self.outputs = self.outputs, []
        finals = [f for f in _floating_tensors(model_output) if f.requires_grad]
        if not finals or not outputs:
            return
        probe = sum((f * self._signs_like(f)).sum() / f.detach().norm().clamp_min(torch.finfo(f.dtype).tiny)
                    for f in finals)
        grads = torch.autograd.grad(probe, [y for _, y in outputs], allow_unused=True)
        for (key, y), g in zip(outputs, grads):
            moved = 0.0 if g is None else float(g.detach().double().pow(2).sum())
            energy = float(y.detach().double().pow(2).sum())
            self.stats.sensitivity[key] = self.stats.sensitivity.get(key, 0.0) + energy * moved / y.numel()

    def _signs_like(self, t: torch.Tensor) -> torch.Tensor:
        signs = torch.randint(0, 2, t.shape, generator=self.signs).to(device=t.device, dtype=t.dtype)
        return signs * 2 - 1

    def linear_hook(self, weight: torch.Tensor):
        def hook(module, args):
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return
            if id(x) not in self.grams:
                held = self._held_out_samples(x)
                fit, out = (x.detach(), None) if held is None else (x.detach()[~held], x.detach()[held])
                self.grams[id(x)] = (x, *_gram(fit), *(_gram(out) if out is not None else (None, 0)))
            self.seen[id(weight)].append(id(x))
        return hook

    def _held_out_samples(self, x: torch.Tensor) -> torch.Tensor | None:
        """Which samples (leading dim) of ``x`` are held out: every HOLD_OUT-th of the batch,
        or the whole batch every HOLD_OUT-th batch when it has fewer samples."""
        every = tuning.CALIBRATION_HOLD_OUT
        if x.dim() < 2 or every < 2:
            return None
        n = x.shape[0]
        if n >= every:
            return torch.arange(n, device=x.device) % every == every - 1
        if self.stats.batches % every == every - 1:
            return torch.ones(n, dtype=torch.bool, device=x.device)
        return None

    def lookup_hook(self, weight: torch.Tensor, num_rows: int):
        def hook(module, args):
            ids = args[0] if args else None
            if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
                return
            counts = torch.bincount(ids.detach().reshape(-1).long().cpu(), minlength=num_rows)[:num_rows]
            prev = self.stats.counts.get(id(weight))
            self.stats.counts[id(weight)] = counts if prev is None else prev + counts
        return hook

    def end_batch(self) -> None:
        moments = self.stats.moments
        users: dict[int, set[int]] = defaultdict(set)  # id(moment) -> weights summing into it
        for key, moment in moments.items():
            users[id(moment)].add(key)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for key, xs in self.seen.items():
            current = moments.get(key)
            groups[(id(current) if current is not None else None, tuple(sorted(xs)))].append(key)
        for (moment_id, xs), keys in groups.items():
            first = moments.get(keys[0])
            if first is None:
                features = self.grams[xs[0]][0].shape[-1]
                moment = InputMoment(torch.zeros(features, features, dtype=torch.float64,
                                                  device=self.grams[xs[0]][0].device))
            elif users[moment_id] == set(keys):
                moment = first
            else:  # the layers sharing this sum were fed differently this time
                moment = first.copy()
            for x_id in xs:
                _, gram, rows, held_gram, held_rows = self.grams[x_id]
                if gram is not None:
                    moment.total += gram
                    moment.rows += rows
                if held_gram is not None:
                    moment.held_total = held_gram.clone() if moment.held_total is None \
                        else moment.held_total + held_gram
                    moment.held_rows += held_rows
            for key in keys:
                moments[key] = moment
        self.grams.clear()
        self.seen.clear()
        self.stats.batches += 1


def _gram(x: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``(x^T x in float64, rows)`` of ``x``'s rows (float32 products of one batch, summed
    in float64 across batches); ``(None, 0)`` without rows."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        return None, 0
    gram = (flat.t() @ flat).to(torch.float64) if flat.dtype in (torch.float32, torch.float64) \
        else (flat.float().t() @ flat.float()).double()
    return gram, flat.shape[0]


def _floating_tensors(output: Any, depth: int = 0) -> list[torch.Tensor]:
    """The floating tensors of a model's output (a tensor, tuple/list, dict or HF
    ``ModelOutput``, two levels deep), ``loss`` left out: it depends on labels."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() and output.numel() else []
    if depth >= 2:
        return []
    if isinstance(output, Mapping):
        items = [v for k, v in output.items() if k != "loss"]
    elif isinstance(output, (tuple, list)):
        items = list(output)
    else:
        return []
    return [t for item in items for t in _floating_tensors(item, depth + 1)]


def collect_statistics(model: nn.Module, calibration: Iterable, *, progress: bool = True,
                       sensitivity: bool = False) -> CalibrationStats:
    """Run ``model`` on every calibration input (eval mode) and gather
    :class:`CalibrationStats` for its ``nn.Linear`` / HF ``Conv1D`` /
    ``nn.Embedding`` / ``nn.EmbeddingBag`` layers.

    Parameters
    ----------
    model : nn.Module
        Left in the training mode it had; its parameters (and their ``.grad``)
        are not touched.
    calibration : iterable
        Model inputs, one batch per item: a Tensor (``model(x)``), a tuple
        (``model(*x)``) or a dict (``model(**x)``), as ``example_inputs``.
    sensitivity : bool
        Also measure each layer's output sensitivity (one backward per batch,
        keeping one batch's activations; ``torch.autograd.grad`` into the layer
        outputs only). Without it the pass runs without autograd.

    Raises
    ------
    TypeError
        ``calibration`` is not an iterable of inputs.
    ValueError
        It yielded no batch, or no compressible layer ran on it.
    """
    if not isinstance(calibration, Iterable) or isinstance(calibration, (str, bytes, torch.Tensor, Mapping)):
        raise TypeError(f"calibration must be an iterable of model inputs (a list of batches, a DataLoader of "
                        f"inputs), got {type(calibration).__name__}; e.g. calibration=[batch1, batch2] where each "
                        "batch is what you would pass to model(...): a tensor, a tuple of args or a dict of kwargs")
    stats = CalibrationStats()
    recorder = _Recorder(stats)
    handles = []
    for module in model.modules():
        if is_linear(module):
            handles.append(module.register_forward_pre_hook(recorder.linear_hook(module.weight)))
            role = "linear"
        elif is_embedding(module) or is_embedding_bag(module):
            handles.append(module.register_forward_pre_hook(recorder.lookup_hook(module.weight,
                                                                                 module.weight.shape[0])))
            role = "table"
        else:
            continue
        stats._weights.append(module.weight)
        if sensitivity:
            handles.append(module.register_forward_hook(recorder.output_hook(role, module.weight)))
    was_training = model.training
    model.eval()
    try:
        total = len(calibration) if hasattr(calibration, "__len__") else None
        with torch.set_grad_enabled(sensitivity):
            for inputs in progress_bar(calibration, "calibration (layer statistics)", total=total,
                                        enabled=progress):
                try:
                    output = call_model(model, inputs)
                    if sensitivity:
                        recorder.measure_sensitivity(output)
                    del output
                finally:
                    recorder.outputs.clear()
                    recorder.end_batch()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if stats.batches == 0:
        raise ValueError("calibration yielded no batches; give a few batches of typical inputs "
                         "(e.g. 8 batches of 32 sentences)")
    if not stats.moments and not stats.counts:
        raise ValueError("no nn.Linear / nn.Embedding layer ran on the calibration inputs; check that they are "
                         "what the model takes")
    return stats
