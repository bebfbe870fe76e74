"""What calibration inputs tell about each dense layer, gathered in one pass.

For a linear layer: the second moment of its inputs, ``C = X^T X / rows``
(``in x in``), which is all a fit to the layer's *outputs* needs:
``||X (W - W')^T||^2 / rows = tr((W - W') C (W - W')^T)``. Layers fed the same
tensor (an attention block's query, key and value) share one matrix. For an
embedding (or bag): how often each row was looked up. Nothing else is kept:
memory is the covariances plus the activations of one calibration batch.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..layers import is_embedding, is_embedding_bag, is_linear

__all__ = ["CalibrationStats", "InputMoment", "collect_statistics"]


@dataclass
class InputMoment:
    """Running ``sum x x^T`` (float64) over the rows a linear layer saw."""

    total: torch.Tensor
    rows: int = 0

    def second_moment(self) -> torch.Tensor:
        """``C = X^T X / rows``, shape ``(in, in)``, float64."""
        return self.total / max(self.rows, 1)

    def copy(self) -> "InputMoment":
        return InputMoment(self.total.clone(), self.rows)


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
    batches : int
        Calibration batches run.
    """

    moments: dict[int, InputMoment] = field(default_factory=dict)
    counts: dict[int, torch.Tensor] = field(default_factory=dict)
    batches: int = 0
    _weights: list = field(default_factory=list, repr=False)  # keeps the ids valid

    def moment_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``C`` of the linear layer holding ``weight``, or ``None`` if it never ran."""
        m = self.moments.get(id(weight))
        return None if m is None or m.rows == 0 else m.second_moment()

    def counts_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """Lookups per row of the table ``weight``, or ``None`` if it never ran."""
        return self.counts.get(id(weight))


class _Recorder:
    """Forward hooks on every dense layer; one calibration batch at a time.

    Within a batch each layer notes which input tensors it saw and each
    distinct tensor's ``x^T x`` is computed once. At the end of the batch the
    layers that saw the same tensors share one running sum: layers fed alike
    in every batch so far keep sharing; a layer whose inputs start to differ
    gets its own copy of the sum (identical up to then)."""

    def __init__(self, stats: CalibrationStats):
        self.stats = stats
        self.grams: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(x) -> (x, x^T x, rows)
        self.seen: dict[int, list[int]] = defaultdict(list)                  # id(weight) -> [id(x), ...]

    def linear_hook(self, weight: torch.Tensor):
        def hook(module, args):
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return
            if id(x) not in self.grams:
                flat = x.detach().reshape(-1, x.shape[-1])
                # float32 products of one batch, summed in float64 across batches
                gram = (flat.t() @ flat).to(torch.float64) if flat.dtype in (torch.float32, torch.float64) \
                    else (flat.float().t() @ flat.float()).double()
                self.grams[id(x)] = (x, gram, flat.shape[0])
            self.seen[id(weight)].append(id(x))
        return hook

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
                any_gram = self.grams[xs[0]][1]
                moment = InputMoment(torch.zeros_like(any_gram))
            elif users[moment_id] == set(keys):
                moment = first
            else:  # the layers sharing this sum were fed differently this time
                moment = first.copy()
            for x_id in xs:
                moment.total += self.grams[x_id][1]
                moment.rows += self.grams[x_id][2]
            for key in keys:
                moments[key] = moment
        self.grams.clear()
        self.seen.clear()
        self.stats.batches += 1


def _call(model: nn.Module, inputs: Any) -> None:
    if isinstance(inputs, Mapping):
        model(**inputs)
    elif isinstance(inputs, (tuple, list)):
        model(*inputs)
    else:
        model(inputs)


def collect_statistics(model: nn.Module, calibration: Iterable, *, progress: bool = True) -> CalibrationStats:
    """Run ``model`` on every calibration input (eval mode, no autograd) and
    gather :class:`CalibrationStats` for its ``nn.Linear`` / HF ``Conv1D`` /
    ``nn.Embedding`` / ``nn.EmbeddingBag`` layers.

    Parameters
    ----------
    model : nn.Module
        Left in the training mode it had; its parameters are not touched.
    calibration : iterable
        Model inputs, one batch per item: a Tensor (``model(x)``), a tuple
        (``model(*x)``) or a dict (``model(**x)``), as ``example_inputs``.

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
            stats._weights.append(module.weight)
        elif is_embedding(module) or is_embedding_bag(module):
            handles.append(module.register_forward_pre_hook(recorder.lookup_hook(module.weight,
                                                                                 module.weight.shape[0])))
            stats._weights.append(module.weight)
    was_training = model.training
    model.eval()
    try:
        total = len(calibration) if hasattr(calibration, "__len__") else None
        with torch.no_grad():
            for inputs in tqdm(calibration, total=total, desc="calibration", disable=not progress or None,
                               leave=False):
                try:
                    _call(model, inputs)
                finally:
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
