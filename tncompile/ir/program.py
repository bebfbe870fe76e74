"""Graph-level IR: a ``torch.fx.GraphModule`` plus what tncompile knows about it."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import fx, nn

from . import printers
from .modules import count_params, module_at
from ..runtime.fused.graph_functions import keep_functions_when_pickled

__all__ = ["Program", "CompileContext", "InputSpec", "PassRecord", "count_params", "module_at"]


def _describe_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}[{','.join(map(str, v.shape))}]"
    return repr(v)


@dataclass
class InputSpec:
    """How the traced graph is called.

    Attributes
    ----------
    frontend : str
        ``"fx"`` (the graph takes the model's own signature) or ``"export"``
        (the graph takes exactly the structure of ``example_inputs``).
    arg_count : int
        Positional arguments the exported graph takes.
    kwarg_names : tuple of str
        Keyword arguments the exported graph takes.
    constants : dict
        Non-tensor keyword inputs specialized at trace time; callers may
        omit them and may not change them.
    described : dict
        ``name -> "dtype[shape]"`` of the example inputs, for the dump.
    shapes : tuple
        ``torch.export``'s shape constraints on the tensor inputs, in the
        order the graph takes them: ``(name, dims)``, each dim an ``int`` (the
        trace fixed it: the model's code made it static, e.g. ``len(x)``) or
        ``(symbol, low, high)`` (``high`` ``None`` when unbounded). Checked on
        every call: a graph run at shapes it was not traced for can return wrong
        values without an error.
    """

    frontend: str
    arg_count: int = 0
    kwarg_names: tuple[str, ...] = ()
    constants: dict[str, Any] = field(default_factory=dict)
    described: dict[str, str] = field(default_factory=dict)
    shapes: tuple = ()

    @classmethod
    def from_example(cls, frontend: str, args: tuple, kwargs: dict) -> "InputSpec":
        described = {f"arg{i}": _describe_value(a) for i, a in enumerate(args)}
        described.update({k: _describe_value(v) for k, v in kwargs.items()})
        constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        return cls(frontend, len(args), tuple(kwargs), constants, described)

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Check a call against the traced structure and fill in constants."""
        if self.frontend != "export":
            return args, kwargs
        if len(args) != self.arg_count:
            raise TypeError(f"compiled model was traced with {self.arg_count} positional "
                            f"input(s), got {len(args)}; traced inputs: {self._traced()}")
        unknown = [k for k in kwargs if k not in self.kwarg_names]
        if unknown:
            raise TypeError(f"compiled model got keyword input(s) {unknown} it was not traced with; "
                            f"traced inputs: {self._traced()}. Recompile with example_inputs "
                            f"that include them.")
        bound = dict(kwargs)
        for k in self.kwarg_names:
            if k in self.constants:
                if k in bound and bound[k] != self.constants[k]:
                    raise ValueError(f"input {k!r} was specialized to {self.constants[k]!r} at "
                                     f"trace time, got {bound[k]!r}; recompile with that value")
                bound[k] = self.constants[k]
            elif k not in bound:
                raise TypeError(f"compiled model is missing input {k!r}; traced inputs: {self._traced()}")
        kwargs = {k: bound[k] for k in self.kwarg_names}
        if self.shapes:
            self.check_shapes(args, kwargs)
        return args, kwargs

    def check_shapes(self, args: tuple, kwargs: dict) -> None:
        """Raise ``ValueError`` naming the constraint when a tensor input breaks
        one of :attr:`shapes` (a fixed size, a range, two sizes that must agree)."""
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if len(tensors) != len(self.shapes):
            return  # another structure: the graph's own checks report it
        seen: dict[str, tuple[str, int, int]] = {}
        for t, (name, dims) in zip(tensors, self.shapes):
            if t.dim() != len(dims):
                raise ValueError(f"input {name!r} was traced with {len(dims)} dims, got shape {tuple(t.shape)}")
            for i, (size, want) in enumerate(zip(t.shape, dims)):
                if isinstance(want, int):
                    if size != want:
                        raise ValueError(
                            f"input {name!r} dim {i} is {size}, but the trace fixed it to {want}: the model's code "
                            f"made that size static (e.g. len(x), x.shape[{i}] used as a number, or a size-1 example "
                            f"dim). Compile with example_inputs of the size you run, or make the code shape-generic.")
                    continue
                symbol, low, high = want
                # a lower bound of 2 is export's 0/1 specialization, which lets size 1 through as PyTorch does
                too_small = size < low and not (low == 2 and size == 1)
                if too_small or (high is not None and size > high):
                    raise ValueError(f"input {name!r} dim {i} is {size}, outside the range [{low}, "
                                     f"{'inf' if high is None else high}] the model was traced for")
                if not symbol:
                    continue
                if symbol in seen and seen[symbol][2] != size:
                    other, j, other_size = seen[symbol]
                    raise ValueError(f"input {name!r} dim {i} is {size} but input {other!r} dim {j} is {other_size}: "
                                     "the trace requires them equal")
                seen.setdefault(symbol, (name, i, size))

    def _traced(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in self.described.items()) or "()"


@dataclass
class PassRecord:
    """One entry of a program's pass history."""

    name: str
    seconds: float
    params: int
    ratio: float
    matches: dict[str, int] = field(default_factory=dict)  # rewrite rule -> times it matched


@dataclass
class CompileContext:
    """What one compile hands its passes and no program keeps: given to
    :meth:`~tncompile.passes.Pipeline.run`, which hands it to each pass
    (``Pass.run(program, ctx)``, as torch.fx's and tinygrad's rewrites get their context);
    the program never holds it (the statistics are large, the decisions belong to one load).

    Attributes
    ----------
    calibration : CalibrationStats or None
        ``compile(calibration=...)``: what the dense layers did on the calibration inputs
        (:mod:`tncompile.calibration`).
    decisions : CompileDecisions or None
        ``tncompile.load``: the saved model's recorded layers, replayed by ``tensorize``,
        ``assign_ranks``, ``decompose`` and ``plan_contractions`` (:mod:`.decisions`).
    dump_dir : str, os.PathLike or None
        ``compile(dump_dir=...)``: where the pipeline writes the IR after every pass. The
        compiled model keeps it for the passes rank adaptation runs later.
    swap_layers : dict or None
        Swap mode (``compile(mode="swap")``): ``path -> kind`` of the compressible layers
        of the user's own module tree, the only ones ``tensorize`` may compress (their
        networks go back into that tree; the swapped model keeps the map); ``None`` in
        graph mode.
    swap_skipped : dict
        Swap mode: ``path -> why`` for compressible layers of the user's tree it keeps dense.
    """

    calibration: Any = None
    decisions: Any = None
    dump_dir: str | os.PathLike | None = None
    swap_layers: dict[str, str] | None = None
    swap_skipped: dict[str, str] = field(default_factory=dict)


class Program:
    """A model as tncompile sees it.

    Attributes
    ----------
    graph_module : torch.fx.GraphModule
        The dataflow. Compressible layers are ``call_module`` leaves; after
        tensorization their modules are TT / TTM layers.
    inputs : InputSpec
        How the graph is called.
    original_params : int
        Parameters of the model before compilation (tied counted once).
    options : CompileOptions
        What the passes were asked to do.
    notes : dict
        ``module name -> reason`` for every compressible layer left dense.
    history : list of PassRecord
        Passes run so far, in order (at compile time and during training).
    compiled_ratio : float or None
        The ratio when compilation finished (rank adaptation shrinks from there).
    listeners : list of callables
        Called with the program after every pipeline run on it (swap mode puts the
        program's current layers back into the user's model).
    calibration_summary : dict
        ``layer -> {"estimated_error", "svd_error", "fit_error"}``: relative output
        errors on the calibration inputs (rank allocation's estimate at the chosen
        rank, TT-SVD's, the calibrated fit's).
    speed_estimates : dict
        ``{"speed": DeviceSpeed, "rows": {layer: rows}}``: what ``assign_ranks`` timed
        each TT linear's training step with (the report's estimated times); empty
        before it runs and in a loaded model.
    core_choices : dict
        ``layer -> {"rows", "chosen", "candidates"}``: what ``choose_cores`` measured for
        each linear (``compile(linear_cores="measured")``); empty otherwise.
    pipeline : list of str
        The names of the passes ``compile`` ran (what ``tncompile.load`` runs again).
    example_inputs : tuple or None
        ``(args, kwargs)`` the graph was traced with (detached copies), when every one is a
        tensor or a plain value (a file records them, so ``load`` traces the same way).
    collapsed_layouts, collapsed_ties : dict
        ``path -> layout`` of every layer rank adaptation collapsed (and ``head -> embedding``
        for a collapsed tied head): what rebuilds it from a file.
    """

    def __init__(self, graph_module: fx.GraphModule, inputs: InputSpec, original_params: int,
                 options: Any = None):
        self.graph_module = graph_module
        self.inputs = inputs
        self.original_params = int(original_params)
        self.options = options
        self.notes: dict[str, str] = {}
        self.history: list[PassRecord] = []
        self.compiled_ratio: float | None = None
        self.listeners: list = []
        self.calibration_summary: dict[str, dict[str, float]] = {}
        self.speed_estimates: dict = {}
        self.core_choices: dict[str, dict] = {}   # choose_cores: layer -> its candidates, timed
        self.speed_capped: dict[str, tuple[int, int]] = {}  # prefer="speed": layer -> (rank cap, budget's rank)
        self.pipeline: list[str] = []
        self.example_inputs: tuple | None = None
        self.collapsed_layouts: dict[str, Any] = {}
        self.collapsed_ties: dict[str, str] = {}

    def __getstate__(self) -> dict:
        # fx pickles the graph module as its source and traces it again on load: keep
        # tncompile's graph functions whole there
        keep_functions_when_pickled(self.graph_module)
        return self.__dict__

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def modules(self) -> Iterator[tuple[fx.Node, nn.Module]]:
        """``(node, module)`` for every ``call_module`` node, and for every
        ``get_attr`` node that passes a whole module to a function (the
        layers of a fused feed-forward call)."""
        for node in self.graph.nodes:
            if node.op == "call_module":
                yield node, self.graph_module.get_submodule(node.target)
            elif node.op == "get_attr":
                mod = module_at(self.graph_module, node.target)
                if mod is not None:
                    yield node, mod

    def num_params(self) -> int:
        """Parameters of the program; a layer awaiting decomposition counts as
        the network it will become once its ranks are assigned."""
        pending = {id(m): m for _, m in self.modules() if getattr(m, "is_pending", False)}
        if not pending:
            return count_params(self.graph_module)
        skip = {id(m.weight) for m in pending.values()}
        rest = {id(p): p for p in self.graph_module.parameters() if id(p) not in skip}
        return sum(p.numel() for p in rest.values()) + sum(m.projected_params() for m in pending.values())

    @property
    def ratio(self) -> float:
        """``params(now) / params(original)`` (1.0 for a model without parameters)."""
        return self.num_params() / self.original_params if self.original_params else 1.0

    def dump(self, fmt: str = "text") -> str:
        """Render as ``"text"`` (for people), ``"json"`` (for tools) or ``"dot"`` (graphviz)."""
        renderers = {"text": printers.to_text, "json": printers.to_json, "dot": printers.to_dot}
        if fmt not in renderers:
            raise ValueError(f"unknown dump format {fmt!r}; use one of {sorted(renderers)}")
        return renderers[fmt](self)

    def __str__(self) -> str:
        return self.dump("text")
