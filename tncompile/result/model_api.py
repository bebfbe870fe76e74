"""What every compressed model answers, graph mode or swap mode: one base for both.

:class:`~.compiled.CompiledModel` (graph mode) and :class:`~tncompile.swap.swapped.SwapMixin`
(swap mode: the user's own class) share ``program``'s readers -- ``ratio``, ``report()``,
``tensorized_modules()`` -- from here; ``program`` and ``to_dense()`` are each mode's own.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..errors import check_materialized
from ..ir.program import Program
from ..passes import Pipeline, Replan, TruncateRanks
from ..runtime.kernels.cpu_allocator import describe as describe_allocator
from ..runtime.layers import TNModule, owning_layers
from .host_time import measure_layer_times, summarize
from .report import Report, build_report

#: names of the traced inputs a save_pretrained folder keeps beside the weights: not state
EXAMPLE_PREFIX = "tncompile/example."
#: where a compressed model keeps ``compile(dump_dir=...)`` for the passes run after compiling
LATER_DUMP_DIR = "_tncompile_dump_dir"

__all__ = ["CompressedModelAPI", "is_compressed", "saved_ranks", "EXAMPLE_PREFIX", "LATER_DUMP_DIR"]


class CompressedModelAPI:
    """The result API of a compressed model (see the module doc)."""

    @property
    def program(self) -> Program:
        raise NotImplementedError

    def _run_passes(self, passes: list) -> Program:
        """Run ``passes`` on this model's program after compiling (rank cuts, replans),
        dumping the IR after each where ``compile(dump_dir=...)`` asked for dumps."""
        return Pipeline(passes).run(self.program, dump_dir=self.__dict__.get(LATER_DUMP_DIR), progress=False)

    @property
    def ratio(self) -> float:
        """``params(compiled) / params(original)``, tied parameters counted once."""
        return self.program.ratio

    def report(self, inputs: Any = None, *, steps: int = 5) -> Report:
        """Per layer: format, modes, ranks, params dense -> compiled, ratio, FLOPs per token.

        With ``inputs`` (one batch as the model takes it: a tensor, a tuple of positional
        inputs or a dict of keyword inputs), each compressed layer's forward + backward is
        also measured on the input it gets in the model, beside a dense layer of its shape:
        the time until the calls return (*host*: on a GPU, the dispatch an eager step pays
        per layer) and, on a GPU, until the device is done (*wall*); median of ``steps``
        (:mod:`.host_time`). The model is left as it was."""
        report = build_report(self.program)
        if inputs is not None:
            check_materialized(self, "report(inputs)")
            times = measure_layer_times(self, inputs, steps=steps)
            for row in report.rows:
                row.measured = times.get(row.name)
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
            report.measured = summarize(times, device)
            if device.type == "cpu":
                report.process_notes.append(describe_allocator())
        return report

    def tensorized_modules(self) -> dict[str, TNModule]:
        """``name -> TT/TTM layer`` for every compressed layer, named by its path in the
        original model (``compiled.tensorized_modules()["layers.0.ff1"]``)."""
        return {node.target: m for node, m in self.program.modules() if isinstance(m, TNModule)}

    def to_dense(self) -> nn.Module:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, and a state saved after rank cuts loads too.

        Where ``state_dict``'s rank gates of a layer are shorter than the layer's, the layer is
        first cut to those ranks; where they are longer (a best checkpoint saved before a later
        cut), the layer grows to them, within its layout's bounds -- then the loaded values
        overwrite it. That is what a plain ``transformers.Trainer`` needs to resume from, or
        load the best of, the checkpoints of a rank-adaptive run. Resizing replaces the layer's
        parameter objects: build the optimizer and ``RankController`` after loading (Trainer
        does). The traced inputs a ``save_pretrained`` folder holds beside the weights are
        not state and are skipped. Ranks outside the layout's bounds: ``ValueError`` naming
        the layer."""
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith(EXAMPLE_PREFIX)}
        keep = saved_ranks(self, state_dict)
        if keep:  # each bond to the saved rank: its leading ranks kept, or (growing) the last repeated
            layers = self.tensorized_modules()
            self._run_passes([TruncateRanks({name: [torch.arange(r).clamp(max=have - 1) for r, have in
                                                zip(ranks, layers[name].layout.ranks)]
                                            for name, ranks in keep.items()}), Replan()])
        if not strict:   # a tied tensor the state holds under its other name is loaded, not missing
            aliases = _aliases(self)
            state_dict = {**{alias: state_dict[name] for name in state_dict for alias in aliases.get(name, ())
                             if alias not in state_dict}, **state_dict}
        return super().load_state_dict(state_dict, strict, assign)


def _names_by_tensor(model: nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> its state names``: a tied tensor has several (a head tied to its
    embedding), of which a checkpoint such as safetensors' keeps one."""
    names: dict[int, list[str]] = {}
    for n, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(n)
    return names


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """``state name -> the other names of its tensor`` for every tensor two names share."""
    return {n: [o for o in group if o != n] for group in _names_by_tensor(model).values() if len(group) > 1
            for n in group}


def saved_ranks(model: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """``layer -> ranks`` of each compressed layer whose gates in ``state_dict`` differ in
    length from its own (the ranks a rank-adaptive run had cut it to, or had before a cut)."""
    names = _names_by_tensor(model)   # a state may hold a tied tensor under any of its names

    def saved(t: torch.Tensor) -> Any:
        return next((state_dict[n] for n in names.get(id(t), ()) if n in state_dict), None)
    keep = {}
    for layer, m in owning_layers(model.tensorized_modules()).items():   # a tied head grows with its embedding
        gates = [saved(g) for g in m.gates._parameters.values()]
        if any(not isinstance(g, torch.Tensor) or g.dim() == 0 for g in gates):
            continue  # not in the state (a tied alias, another structure): load_state_dict reports it
        ranks = tuple(int(g.shape[-1]) for g in gates)
        if ranks == tuple(m.layout.ranks):
            continue
        bounds = m.layout.rank_bounds()
        if len(ranks) != len(bounds) or any(not 1 <= r <= b for r, b in zip(ranks, bounds)):
            raise ValueError(f"load_state_dict: {layer!r} has ranks {ranks} in the state, outside what its layout "
                             f"allows ({tuple(bounds)}): the state is of another model")
        if any(r > have for r, have in zip(ranks, m.layout.ranks)):
            _check_growth(layer, m, ranks, [saved(c) for c in m.cores._parameters.values()])
        keep[layer] = ranks
    return keep


def _check_growth(layer: str, m: TNModule, ranks: tuple[int, ...], cores: list) -> None:
    """A layer grows only to ranks whose cores the state itself holds, and never past its
    dense size: gates alone (10 KB) must not make it larger."""
    grown = m.layout.with_ranks(ranks)
    if grown.num_params() > grown.dense_params:
        raise ValueError(f"load_state_dict: {layer!r} would grow to ranks {ranks}, {grown.num_params():,} parameters, "
                         f"more than its dense form's {grown.dense_params:,}: the state is not one this model saved")
    lead = (grown.copies,) if getattr(m, "stacked", 0) else ()
    expected = [lead + tuple(shape) for shape in grown.core_shapes()]
    held = [tuple(c.shape) if isinstance(c, torch.Tensor) else None for c in cores]
    if held != expected:
        first = next(k for k, (h, e) in enumerate(zip(held, expected)) if h != e)
        raise ValueError(f"load_state_dict: {layer!r} has ranks {ranks} in the state but "
                         f"{'no core ' + str(first) if held[first] is None else f'core {first} of shape {held[first]}'}"
                         f" there (expected {expected[first]}): a layer grows only to ranks whose cores the state "
                         "holds")


def is_compressed(model: Any) -> bool:
    """Whether ``model`` is what ``tncompile.compile`` or ``load`` returned (either mode)."""
    return isinstance(model, CompressedModelAPI)
