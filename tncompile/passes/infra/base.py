"""Pass infrastructure: ``Pass``, a registry, and an ordered, editable ``Pipeline``.

Modelled on torch.fx's ``PassBase``: a pass may state what it needs of the
program (:meth:`Pass.requires`) and what it guarantees after running
(:meth:`Pass.ensures`); the pipeline checks both around every run, lints the
graph, records the pass in the program's history (time, size, and how often
each of its rewrite rules matched) and, with a dump directory, writes the IR.
"""
from __future__ import annotations

import inspect
import os
from collections import Counter
from pathlib import Path
from time import perf_counter
from typing import Callable, Iterable, Iterator


from ...errors import PassError, TNCompileError
from ...ir.program import CompileContext, PassRecord, Program
from .progress import progress as progress_bar
from ...runtime.kernels.executor import generated_code_dump
from ...files import write_replacing

__all__ = ["Pass", "FunctionPass", "Pipeline", "register_pass", "get_pass", "registered_passes",
           "normalize_name"]


def normalize_name(name: str) -> str:
    """Pass names compare with ``-`` and ``_`` alike (``assign-ranks == assign_ranks``)."""
    return name.strip().replace("-", "_")


class Pass:
    """A rewrite of a :class:`~tncompile.ir.Program`.

    Subclasses set ``name`` and implement :meth:`run`, which may rewrite
    ``program.graph_module`` in place with ordinary fx tools (and return
    ``None`` or the program) or return a new program. ``run(self, program, ctx)``
    also gets the running compile's :class:`~tncompile.ir.CompileContext` (calibration
    statistics, a load's decisions, the dump directory), as torch.fx's and tinygrad's
    rewrites get theirs; ``run(self, program)`` is called without it.

    Optional checks, as in torch.fx's ``PassBase``: :meth:`requires` raises
    when the program is not what the pass needs (e.g. an earlier pass did not
    run), :meth:`ensures` raises when the pass did not deliver what it
    promises. Rewrites built from rules (:mod:`.rules`) count their matches
    in :attr:`matches`, which the history and the dump show.
    """

    name: str = ""

    def requires(self, program: Program) -> None:
        """Raise (``ValueError`` saying what is missing) if ``program`` is not fit for this pass."""

    def ensures(self, program: Program) -> None:
        """Raise if the pass did not leave ``program`` as it promises."""

    def run(self, program: Program, ctx: CompileContext) -> Program | None:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.run")

    @property
    def matches(self) -> Counter:
        """``rule name -> times it matched`` in the latest run (reset by the pipeline)."""
        if "_matches" not in self.__dict__:
            self._matches = Counter()
        return self._matches

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionPass(Pass):
    """A pass made from a function ``program -> program | None`` (or
    ``(program, ctx) -> program | None``: it gets the compile's context too)."""

    def __init__(self, fn: Callable[..., Program | None], name: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__

    def run(self, program: Program, ctx: CompileContext) -> Program | None:
        return self.fn(program, ctx) if takes_context(self.fn) else self.fn(program)


def takes_context(run: Callable) -> bool:
    """Whether a pass's ``run`` (bound) or a pass function takes the compile's context: a
    second required positional parameter (or ``*args``). ``run(program)`` -- the form
    DESIGN.md gives users -- is called without it, as is ``f(program, verbose=False)``."""
    try:
        params = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: the documented one-argument form
        return False
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return len(required) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


_REGISTRY: dict[str, Callable[[], Pass]] = {}


def register_pass(obj=None, *, name: str | None = None, overwrite: bool = False):
    """Register a pass class (or a function) under its name.

    Use as ``@register_pass`` on a ``Pass`` subclass or a function
    ``program -> program``, or call ``register_pass(MyPass)``. Registered
    names can be used in ``compile(passes=[...])`` and pipeline edits.
    """

    def do(target):
        if isinstance(target, type) and issubclass(target, Pass):
            key, factory = name or target.name, target
        elif isinstance(target, Pass):
            key, factory = name or target.name, (lambda t=target: t)
        elif callable(target):
            key = name or target.__name__
            factory = (lambda f=target, k=key: FunctionPass(f, k))
        else:
            raise TypeError(f"register_pass takes a Pass subclass, a Pass or a function, got {target!r}")
        if not key:
            raise ValueError(f"{target!r} has no name; set a class attribute name = '...'")
        key = normalize_name(key)
        if key in _REGISTRY and not overwrite:
            raise ValueError(f"a pass named {key!r} is already registered; pass overwrite=True to replace it")
        _REGISTRY[key] = factory
        return target

    return do if obj is None else do(obj)


def registered_passes() -> list[str]:
    return sorted(_REGISTRY)


def get_pass(name: str) -> Pass:
    """A new instance of the registered pass ``name``."""
    key = normalize_name(name)
    if key not in _REGISTRY:
        raise ValueError(f"unknown pass {name!r}; registered passes: {', '.join(registered_passes())}. "
                         f"Register your own with tncompile.register_pass.")
    return _REGISTRY[key]()


def _as_pass(p: Pass | str | Callable) -> Pass:
    if isinstance(p, Pass):
        if not p.name:
            raise ValueError(f"{p!r} has no name; set a class attribute name = '...'")
        return p
    if isinstance(p, str):
        return get_pass(p)
    if isinstance(p, type) and issubclass(p, Pass):
        return p()
    if callable(p):
        return FunctionPass(p)
    raise TypeError(f"a pipeline entry must be a Pass, a registered pass name or a function, got {p!r}")


class Pipeline:
    """An ordered list of passes, edited by name.

    Every edit returns the pipeline, so edits chain:
    ``default_pipeline().insert_after("tensorize", MyPass()).remove("...")``.
    """

    def __init__(self, passes: Iterable[Pass | str | Callable] = ()):
        self.passes: list[Pass] = [_as_pass(p) for p in passes]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def index(self, name: str) -> int:
        key = normalize_name(name)
        for i, p in enumerate(self.passes):
            if normalize_name(p.name) == key:
                return i
        raise ValueError(f"no pass named {name!r} in the pipeline; it has: {', '.join(self.names)}")

    def insert_before(self, name: str, p: Pass | str | Callable) -> "Pipeline":
        self.passes.insert(self.index(name), _as_pass(p))
        return self

    def insert_after(self, name: str, p: Pass | str | Callable) -> "Pipeline":
        self.passes.insert(self.index(name) + 1, _as_pass(p))
        return self

    def replace(self, name: str, p: Pass | str | Callable) -> "Pipeline":
        self.passes[self.index(name)] = _as_pass(p)
        return self

    def remove(self, name: str) -> "Pipeline":
        del self.passes[self.index(name)]
        return self

    def append(self, p: Pass | str | Callable) -> "Pipeline":
        self.passes.append(_as_pass(p))
        return self

    def __iter__(self) -> Iterator[Pass]:
        return iter(self.passes)

    def __len__(self) -> int:
        return len(self.passes)

    def __repr__(self) -> str:
        return f"Pipeline([{', '.join(self.names)}])"

    def run(self, program: Program, dump_dir: str | os.PathLike | None = None,
            progress: bool = True, context: CompileContext | None = None) -> Program:
        """Run every pass in order: check its ``requires``, run it, lint the
        graph, check its ``ensures``, record it in ``program.history``, dump.

        With ``dump_dir`` (or ``context.dump_dir``: ``compile(dump_dir=...)``, which the
        compiled model also hands the passes rank adaptation runs later) the IR is written
        as ``NN-<pass>.txt`` and ``.json`` after every pass, ``NN`` counting the program's
        whole history (``00-trace`` is the program before any pass), and, once layers are
        planned, the code their plans run as ``NN-<pass>.code.py``. Exceptions name the
        pass that raised.

        ``context`` (a compile's calibration statistics, a load's decisions, its dump
        directory; an empty one when ``None``) is handed to every pass whose ``run`` takes
        it (``run(program, ctx)``); the program never holds it.
        """
        ctx = context if context is not None else CompileContext()
        return self._run(program, dump_dir if dump_dir is not None else ctx.dump_dir, progress, ctx)

    def _run(self, program: Program, dump_dir, progress: bool, ctx: CompileContext) -> Program:
        out = Path(dump_dir) if dump_dir is not None else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            if not program.history:
                _write_dump(program, out, "00-trace")
        passes = progress_bar(self.passes, "passes", enabled=progress)
        began, earlier = perf_counter(), len(program.history)
        for p in passes:
            start = perf_counter()
            _name_the_stage(passes, p.name, program.history[earlier:], start - began)
            p.matches.clear()
            program = _run_checked(p, program, ctx)
            program.history.append(PassRecord(p.name, perf_counter() - start, program.num_params(),
                                              program.ratio, dict(p.matches)))
            if out is not None:
                _write_dump(program, out, f"{len(program.history):02d}-{p.name}")
        for listener in program.listeners:
            listener(program)
        return program


def _name_the_stage(bar, running: str, history: list[PassRecord], elapsed: float) -> None:
    """The bar says which pass runs, and which earlier pass took most of the time so far."""
    if not hasattr(bar, "set_postfix_str"):
        return
    slowest = max(history, key=lambda r: r.seconds, default=None) if elapsed > 0 else None
    share = f"; so far {slowest.name} {min(1.0, slowest.seconds / elapsed):.0%}" if slowest is not None else ""
    bar.set_postfix_str(f"{running}{share}", refresh=False)


def _run_checked(p: Pass, program: Program, ctx: CompileContext) -> Program:
    """``p.requires``, ``p.run`` (with ``ctx`` where it takes it), lint, ``p.ensures``;
    errors name the pass."""
    try:
        p.requires(program)
        result = p.run(program, ctx) if takes_context(p.run) else p.run(program)
        if result is not None:
            if not isinstance(result, Program):
                raise PassError(p.name, TypeError(
                    f"run() must return a Program or None, got {type(result).__name__}"))
            program = result
        try:
            program.graph.lint()
            outputs = sum(n.op == "output" for n in program.graph.nodes)
            if outputs != 1:
                raise RuntimeError(f"the graph has {outputs} output nodes, it needs exactly one "
                                   "(a pass may replace the output's arguments, never remove the node)")
            program.graph_module.recompile()
        except Exception as e:
            raise PassError(p.name, RuntimeError(f"left an invalid graph: {e}")) from e
        p.ensures(program)
    except (TNCompileError, KeyboardInterrupt):
        raise
    except (ValueError, TypeError) as e:  # user-facing input errors keep their type
        raise type(e)(f"pass {p.name!r}: {e}") from e
    except Exception as e:
        raise PassError(p.name, e) from e
    return program


def _write_dump(program: Program, out: Path, stem: str) -> None:
    """The program after a pass as ``<stem>.txt``, ``.json`` (and ``.code.py`` once layers
    are planned), each written whole by a temporary file renamed over it: a link planted at
    a dump's name is replaced, never written through."""
    write_replacing(out / f"{stem}.txt", program.dump("text"), mode=None)
    write_replacing(out / f"{stem}.json", program.dump("json"), mode=None)
    code = generated_code_dump((str(node.target), mod) for node, mod in program.modules())
    if code:  # once layers are planned: the Python each one runs, per bucket
        write_replacing(out / f"{stem}.code.py", code + "\n", mode=None)
