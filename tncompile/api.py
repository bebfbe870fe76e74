"""``tncompile.compile``: frontend -> pipeline -> CompiledModel."""
from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from . import tuning
from .calibration import collect_statistics
from .result.compiled import CompiledModel
from .result.model_api import LATER_DUMP_DIR, is_compressed
from .errors import BelowTargetWarning, CalibrationWarning, SlowerThanDenseWarning
from .ir.decisions import CompileDecisions
from .ir.program import CompileContext, Program, count_params
from .frontend.layers import is_compressible
from .frontend.tracing import split_example_inputs, trace
from .options import MEASURED_CORES, CompileOptions, check_target_ratio
from .passes import CollapseLayers, Pass, Pipeline, default_pipeline
from .swap.swapped import MIXIN_NAMES, attach, swappable_layers, unswappable_layers
from .swap.expert_params import expert_weights
from .passes.infra.selection import entries
from .swap.adapters import (adapted_model, adapter_exclusion, adapter_wrappers, adopt_compressed_bases,
                            check_adapter_wrappers)

__all__ = ["compile", "rebuild", "recordable_inputs", "is_plain_input"]

DUMP_ENV = "TNCOMPILE_DUMP"


def pipeline_of(passes: Pipeline | Sequence[Pass | str] | None) -> Pipeline:
    """The pipeline ``passes=`` names: ``None`` the default one; a Pipeline (copied); a list of
    pass names / Pass objects."""
    if passes is None:
        return default_pipeline()
    if isinstance(passes, Pipeline):
        return Pipeline(passes.passes)  # a copy: running never edits the caller's pipeline
    if isinstance(passes, (str, Pass)):
        passes = [passes]
    if not isinstance(passes, (list, tuple)):
        raise TypeError(f"passes must be a Pipeline, or a list of pass names / Pass objects, got "
                        f"{type(passes).__name__} {passes!r}; e.g. passes=tncompile.default_pipeline()"
                        ".insert_after('tensorize', MyPass())")
    return Pipeline(passes)


def pipeline_for(passes: Pipeline | Sequence[Pass | str] | None, options: CompileOptions) -> Pipeline:
    """:func:`pipeline_of`, with ``choose_cores`` after ``assign_ranks`` where the options
    ask for measured cores (``linear_cores="measured"``) and the passes do not run it."""
    pipeline = pipeline_of(passes)
    if options.linear_cores == MEASURED_CORES and "choose_cores" not in pipeline.names:
        if "assign_ranks" not in pipeline.names:
            raise ValueError("linear_cores='measured' chooses each layer's cores after assign_ranks, which the "
                             "passes= given do not run; add 'assign_ranks' and 'choose_cores' (or give an integer)")
        pipeline.insert_after("assign_ranks", "choose_cores")
    return pipeline


def compile(
    model: nn.Module,
    target_ratio: float = 0.05,
    example_inputs: Any = None,
    target_modules: str | Sequence[str] = "all",
    exclude_modules: str | Sequence[str] | None = None,
    rank_pattern: dict[str, int] | None = None,
    init: str = "svd",
    batch_sizes: Sequence[int] | None = None,
    passes: Pipeline | Sequence[Pass | str] | None = None,
    dump_dir: str | os.PathLike | None = None,
    inplace: bool = False,
    calibration: Iterable | None = None,
    *,
    allocation: str = "auto",
    linear_cores: int | str = 3,
    embedding_cores: int = 4,
    seed: int | None = 0,
    prefer: str = "speed",
    mode: str = "auto",
) -> CompiledModel | nn.Module:
    """Compile ``model`` into rank-adaptive TT / TTM form.

    Parameters
    ----------
    model : nn.Module
        Never mutated unless ``inplace=True``.
    target_ratio : float in (0, 1]
        ``params(compiled) / params(model)`` for the whole model; the result is
        never above it and, when the layouts allow, within 10% below.
    example_inputs : tuple, dict or Tensor, optional
        Inputs to trace with; required when torch.fx cannot trace the model
        (tncompile then uses ``torch.export`` and the compiled model takes
        exactly this structure of inputs).
    target_modules, exclude_modules : "all", list of name suffixes, or "re:<regex>"
        Which ``nn.Linear`` / ``nn.Embedding`` / HF ``Conv1D`` layers to compress.
    rank_pattern : dict, optional
        ``{name suffix or "re:<regex>": rank}`` fixed ranks for some layers.
    init : {"svd", "random"}
        TT-SVD of the dense weights, or a fresh draw (from ``seed``) whose matrix has
        exactly the mean square of the dense weight as the model initialized it (an HF
        model's ``initializer_range``; PyTorch's default for a zero or meta weight).
    batch_sizes : sequence of int, optional
        Batch sizes to plan contractions for ahead of time.
    passes : Pipeline or list of pass names / Pass objects, optional
        Defaults to :func:`tncompile.default_pipeline`.
    dump_dir : path, optional
        Write ``NN-<pass>.txt`` / ``.json`` after every pass (also set by the
        ``TNCOMPILE_DUMP`` environment variable).
    inplace : bool
        Swap the compressed layers into ``model`` itself (saves a copy).
    calibration : iterable of model inputs, optional
        For a pretrained model: a few batches of typical inputs (each a Tensor,
        tuple of args or dict of kwargs, as ``example_inputs``). The dense model
        runs on them once (eval mode, no autograd); then each linear network is
        fit to reproduce its layer's *outputs* on them and each embedding table
        to its rows weighted by how often they were looked up, instead of the
        plain weights (:mod:`tncompile.calibration`), and ranks are allocated by
        sensitivity (``allocation``). Needs ``init="svd"``.
    allocation : {"auto", "sensitivity", "uniform"}
        How ranks are shared among layers: ``"sensitivity"`` spends the budget
        where each parameter lowers the estimated output error most (needs
        ``calibration``); ``"uniform"`` gives every layer the same rank;
        ``"auto"``: sensitivity with calibration, else uniform.
    linear_cores, embedding_cores : int, or "measured" for linear_cores
        Cores per side of a TT linear (default 3) and cores of a TTM embedding (4).
        ``linear_cores="measured"``: each linear gets 1, 2 or 3 cores a side (a 2-, 4- or
        6-core network), whichever trains fastest on the model's device within the
        parameters its rank gave it, by timing (with ``calibration``: the best held-out
        fit among the nearly fastest); the report shows each choice (the
        ``choose_cores`` pass).
    seed : int or None
        Seed of ``init="random"``.
    prefer : {"speed", "size"}
        ``"speed"`` (default): no TT network gets a rank at which its planned
        forward cost over the traced rows exceeds its dense layer's (the layer
        gets a lower rank; the model may then end further below the target).
        ``"size"``: ranks grow as far as the budget allows; the report notes
        each network that costs more than its dense layer.
    mode : {"auto", "graph", "swap"}
        How the result is handed back (the analysis, passes, ranks and dumps
        are the same). ``"graph"``: a :class:`CompiledModel` running the
        traced graph (whole-graph rewrites: fused feed-forward, native
        dropout, CUDA-graph capture of the whole step). ``"swap"``: the
        user's own model object and class (a copy unless ``inplace=True``)
        with each compressed layer replaced in place (:mod:`tncompile.swap`):
        its own ``forward``, HF ``generate`` / ``config`` / masks / Trainer,
        plus ``ratio``, ``report()``, ``to_dense()``, ``program``. ``"auto"``
        (default): ``"swap"`` for models whose forward is not one static
        graph -- HuggingFace ``PreTrainedModel`` subclasses and models only
        ``torch.export`` could trace -- and ``"graph"`` for the rest.

    Returns
    -------
    CompiledModel, or in swap mode the user's model with its layers swapped
    """
    _check_model(model)
    check_target_ratio(target_ratio)
    adapted = adapter_wrappers(model)
    if adapted:  # LoRA adapters: the layers under them are compressed, the adapters kept (swap mode)
        mode = _check_adapted(model, mode)
        exclude_modules = [*entries(exclude_modules, "exclude_modules"), adapter_exclusion()]
    options = CompileOptions(target_ratio=target_ratio, target_modules=target_modules,
                             exclude_modules=exclude_modules, rank_pattern=rank_pattern, init=init,
                             batch_sizes=batch_sizes, linear_cores=linear_cores,
                             embedding_cores=embedding_cores, seed=seed, prefer=prefer, allocation=allocation)
    _check_calibration(calibration, options)
    pipeline = pipeline_for(passes, options)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be True or False, got {type(inplace).__name__} {inplace!r} "
                        "(True swaps the compressed layers into the model you pass)")
    _check_dump_dir(dump_dir)
    mode = _check_mode(mode, adapted_model(model) or model)
    dump_dir = dump_dir if dump_dir is not None else os.environ.get(DUMP_ENV) or None
    whole = model if inplace else copy.deepcopy(model)
    work = adapted_model(whole) or whole  # a PeftModel: the model it wraps
    stats = (collect_statistics(work, calibration, sensitivity=options.allocation != "uniform")
             if calibration is not None else None)
    compiled = _build(work, count_params(work), options, pipeline, mode, example_inputs, dump_dir, stats)
    if inplace and isinstance(compiled, CompiledModel):
        _put_layers_into(model, compiled.program)
    _warn_if_slower(compiled, options)
    _warn_if_below_target(compiled, options)
    _warn_if_calibration_is_thin(compiled.program)
    if adapted:
        adopt_compressed_bases(work)
    result = whole if adapted else compiled
    for finish in AFTER_COMPILE:   # e.g. the train layer's graph_calls under tuning.GRAPH_CALLS
        finish(result)
    return result


def rebuild(model: nn.Module, decisions: CompileDecisions, options: CompileOptions, pipeline: Pipeline,
            mode: str, example_inputs: Any, trusted_inputs: bool = True) -> CompiledModel | nn.Module:
    """What ``tncompile.load`` compiles: ``model`` (used in place) traced as ``compile``
    traced it, ``pipeline`` run with the saved ``decisions`` instead of deciding again
    (no calibration, no rank search, no decomposition: the caller loads the tensors),
    then the collapsed layers collapsed. Raises :class:`~tncompile.errors.ModelMismatchError`
    where ``model`` does not fit the decisions. ``trusted_inputs=False`` (a file's inputs): the
    model is traced on fake tensors only, never run on real data."""
    return _build(model, count_params(model), options, pipeline, mode, example_inputs, None, None, decisions,
                  trusted_inputs)


def _build(work: nn.Module, original_params: int, options: CompileOptions, pipeline: Pipeline, mode: str,
           example_inputs: Any, dump_dir, stats, decisions: CompileDecisions | None = None,
           trusted_inputs: bool = True):
    """Trace ``work``, run ``pipeline`` over it and hand it back in ``mode``."""
    layers = swappable_layers(work)  # before tracing: export's trace may not keep the module paths
    gm, inputs = trace(work, example_inputs, run_real=trusted_inputs)
    layers.update(expert_weights(gm, work))  # fused MoE parameters the trace found: swapped via their owner
    if mode == "auto":
        mode = _auto_mode(work, inputs.frontend, gm, layers)
    program = Program(gm, inputs, original_params, options)
    program.pipeline = pipeline.names
    program.example_inputs = recordable_inputs(example_inputs)
    swap = mode == "swap"
    context = CompileContext(stats, decisions, dump_dir, swap_layers=layers if swap else None,
                             swap_skipped=unswappable_layers(work) if swap else {})
    program = _run_pipeline(pipeline, program, context)
    compiled = attach(work, program, layers) if swap else CompiledModel(program)
    compiled.__dict__[LATER_DUMP_DIR] = dump_dir  # rank adaptation's passes dump here too
    return compiled


#: a meta example input of at most this many elements is recorded as ones of its shape (what a
#: saved model traces on when loaded; serialization's MAX_EXAMPLE_ELEMENTS bounds what it reads)
RECORDED_META_ELEMENTS = 1 << 16


def is_plain_input(value: Any) -> bool:
    """An example input a file can hold: a tensor, ``None``, a bool, a number or a short string."""
    return isinstance(value, (torch.Tensor, bool, int, float, type(None))) or (isinstance(value, str)
                                                                             and len(value) <= 64)


def recordable_inputs(example_inputs: Any) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of ``example_inputs`` as a file can hold them -- detached CPU copies
    of tensors, and plain values (``None``, bools, numbers, short strings) -- or ``None``
    where anything else is among them (``load`` then needs ``example_inputs=``).

    A tensor on the meta device (a model compiled on meta) has a shape and no values: it is
    recorded as ones of its shape and dtype (a valid token id, an attend-everywhere mask),
    which is all tracing reads -- unless it has over :data:`RECORDED_META_ELEMENTS` elements."""
    example = split_example_inputs(example_inputs)
    if example is None:
        return None
    args, kwargs = example
    leaves = [*args, *kwargs.values()]
    if not all(map(is_plain_input, leaves)) or any(isinstance(v, torch.Tensor) and v.is_meta
                                                   and v.numel() > RECORDED_META_ELEMENTS for v in leaves):
        return None

    def copy_of(v):
        if isinstance(v, torch.Tensor) and v.is_meta:
            return torch.ones(v.shape, dtype=v.dtype)
        return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
    return tuple(copy_of(a) for a in args), {k: copy_of(v) for k, v in kwargs.items()}


def _warn_if_calibration_is_thin(program: Program) -> None:
    """Networks fit to too few calibration rows (or fitting those much better than held-out
    ones) are said so, with how many rows to give."""
    thin, loose = [], []
    for name, summary in program.calibration_summary.items():
        rows, features = summary.get("rows"), summary.get("features")
        if rows is not None and rows < tuning.CALIBRATION_ROWS_PER_FEATURE * features:
            thin.append((name, rows, features))
        held, fit = summary.get("held_out_error"), summary.get("fit_error")
        if held is not None and fit is not None and held > 2 * fit + 1e-3:
            loose.append((name, fit, held))
    if not thin and not loose:
        return
    parts = []
    if thin:
        name, rows, features = max(thin, key=lambda t: t[2] / max(t[1], 1))
        parts.append(f"{len(thin)} layer(s) saw fewer rows than {tuning.CALIBRATION_ROWS_PER_FEATURE}x their input "
                     f"features ({name!r}: {rows:,} rows for {features:,} features), so their fit is poorly "
                     "determined")
    if loose:
        name, fit, held = max(loose, key=lambda t: t[2] / max(t[1], 1e-12))
        parts.append(f"{len(loose)} layer(s) fit their calibration rows much better than held-out ones ({name!r}: "
                     f"output error {fit:.3g} on the rows fit, {held:.3g} held out)")
    need = max(tuning.CALIBRATION_ROWS_PER_FEATURE * s.get("features", 0) for s in program.calibration_summary.values())
    warnings.warn(CalibrationWarning(
        f"tncompile.compile(calibration=...): {'; '.join(parts)}. The networks then match the calibration inputs, "
        f"not new ones: give at least {need:,} rows (samples x positions, e.g. tokens) per layer -- more batches "
        "of the data the model will see -- or compile without calibration (TT-SVD of the weights). "
        "compiled.report() shows each layer's held-out error."), stacklevel=3)


def _warn_if_below_target(compiled: nn.Module, options: CompileOptions) -> None:
    """A model clearly smaller than asked for (below ``target_ratio``'s band) is said so:
    which layers speed capped, or that the layouts' bounds stop the ranks, and the fix."""
    program = compiled.program
    band = (1 - tuning.UNIFORM_RANK_SLACK) * options.target_ratio
    ratio = program.num_params() / max(program.original_params, 1)
    if ratio >= band:
        return
    capped = program.speed_capped
    if capped:
        name, (cap, allowed) = next(iter(capped.items()))
        layers = "1 layer" if len(capped) == 1 else f"{len(capped)} layers"
        why = (f"prefer='speed' capped the ranks of {layers} where larger networks are estimated slower than "
               f"their dense layers on this device ({name!r}: rank {cap}, the budget allows {allowed}). "
               "prefer='size' spends the budget on ranks (compile(..., prefer='size')), or a larger batch "
               "(batch_sizes=) makes larger ranks pay")
    else:
        why = ("the networks reached their rank bounds (a network stays smaller than its dense weight, at most "
               "tuning.MAX_LAYER_RATIO of it): more cores per network (linear_cores=, embedding_cores=) or "
               "compressing fewer layers (exclude_modules=) gets closer to the target")
    warnings.warn(BelowTargetWarning(
        f"tncompile.compile: the model keeps {ratio:.4g} of its parameters, target_ratio={options.target_ratio:g} "
        f"asked for at most that and at least {band:.4g}: {why}. compiled.report() notes each layer."), stacklevel=3)


def _warn_if_slower(compiled: nn.Module, options: CompileOptions) -> None:
    """``prefer="speed"`` keeps layers dense only within ``target_ratio``: where what the
    ratio needs is estimated to train clearly slower than dense, say so, and what ratio
    keeping the slower layers dense gives."""
    speed = compiled.report().speed if options.prefer == "speed" else None
    if speed is None or speed.speedup >= tuning.SLOWER_WARNING_BELOW:
        return
    if speed.slower and speed.ratio_without_slower < 0.999:
        slower = "the slower layer" if len(speed.slower) == 1 else f"the {len(speed.slower)} slower layers"
        fix = (f"keeping {slower} dense gives ratio {speed.ratio_without_slower:.3g}: "
               f"compile(..., target_ratio={speed.ratio_without_slower:.3g}, "
               f"exclude_modules=compiled.report().speed.slower)")
    else:
        fix = "every compressed layer is estimated slower here: compression costs speed at this batch and device"
    batch = max(options.batch_sizes or [tuning.ASSUMED_ROWS])
    whose = "the compressed layer's" if speed.layers == 1 else f"the {speed.layers} compressed layers'"
    warnings.warn(SlowerThanDenseWarning(
        f"tncompile.compile: {whose} training step is estimated {1 / speed.speedup:.1f}x slower than as dense "
        f"layers on {speed.device} at a batch of {batch} samples (batch_sizes= sets it): the networks' fixed "
        f"per-kernel costs and memory traffic outweigh the multiply-adds they save, and "
        f"target_ratio={options.target_ratio:g} needs them compressed. {fix[0].upper()}{fix[1:]}. "
        f"compiled.report() has the estimates per layer."), stacklevel=3)

MODES = ("auto", "graph", "swap")

#: what later layers do to every model ``compile`` hands back (each registers itself at
#: import; this module imports none of them): ``finish(model) -> None``
AFTER_COMPILE: list = []


def _check_mode(mode: Any, model: nn.Module) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}: 'graph' returns a CompiledModel running "
                         "the traced graph, 'swap' the model you pass with its layers replaced in place")
    if mode == "swap":
        clash = _mixin_clash(model)
        if clash:
            raise ValueError(f"mode='swap' adds {list(MIXIN_NAMES)} to the model, but "
                             f"{type(model).__name__} already defines {clash}; use mode='graph'")
    return mode


def _run_pipeline(pipeline: Pipeline, program: Program, context: CompileContext) -> Program:
    """Run the compile pipeline with ``context`` (calibration statistics, a load's decisions)
    in reach of its passes: gone after (covariances are large and used only here).
    Rebuilding a saved model: then collapse what rank adaptation collapsed."""
    program = pipeline.run(program, context=context)
    decisions = context.decisions
    owners = [p for p in (decisions.collapsed if decisions is not None else [])
              if decisions.layers[p].tied_to is None]  # heads follow
    if owners:
        program = Pipeline([CollapseLayers({p: "collapsed by rank adaptation before saving" for p in owners})]
                           ).run(program, dump_dir=context.dump_dir, progress=False)
    program.compiled_ratio = program.ratio
    return program


def _mixin_clash(model: nn.Module) -> list[str]:
    """The compiled-model attributes that ``model``'s class already defines (swap mode would shadow them)."""
    return [name for name in MIXIN_NAMES if hasattr(type(model), name)]


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a HuggingFace ``transformers`` model (a ``PreTrainedModel``
    subclass), judged from its class hierarchy without importing ``transformers``."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
               for cls in type(model).__mro__)


def _auto_mode(model: nn.Module, frontend_used: str, gm, layers: dict[str, str]) -> str:
    """``mode="auto"``: swap for models whose forward is not one static graph -- HF
    models (caches, masks, ``generate``) and models only ``torch.export`` could trace
    (their Python control flow was specialized to the example inputs) -- graph for the
    rest (whole-graph rewrites and capture). Graph mode too where swap mode would keep
    dense a layer the trace can compress (an ``nn.EmbeddingBag`` subclass with its own
    forward) or the class already defines a name swap mode adds (``MIXIN_NAMES``)."""
    dynamic = is_hf_model(model) or frontend_used == "export"
    traced = {name for name, m in gm.named_modules() if name and is_compressible(m)}
    return "swap" if dynamic and not _mixin_clash(model) and traced <= set(layers) else "graph"


def _check_calibration(calibration: Any, options: CompileOptions) -> None:
    if calibration is None:
        if options.allocation == "sensitivity":
            raise ValueError("allocation='sensitivity' chooses ranks from calibration data; pass "
                             "calibration=<a few batches of inputs> too, or use allocation='uniform'")
        return
    if options.init != "svd":
        raise ValueError(f"calibration fits the networks to the model's own layers, starting from TT-SVD; it "
                         f"needs init='svd', got init={options.init!r} (init='random' is for training from scratch)")


def _check_adapted(model: nn.Module, mode: str) -> str:
    """A model carrying adapters compiles in swap mode, every adapter kind kept."""
    if mode == "graph":
        raise ValueError("tncompile.compile: a model carrying adapters compiles in swap mode (the adapters stay "
                         "modules of your model); pass mode='swap' or 'auto'")
    check_adapter_wrappers(model)
    return "swap"


def _check_model(model: Any) -> None:
    """What ``compile`` cannot take as a model, with the fix."""
    if is_compressed(model):  # either mode: a CompiledModel, or a model whose layers were swapped
        raise TypeError(f"model is already compressed by tncompile ({type(model).__name__}); compile the original "
                        "dense model again (or compiled.to_dense()) to compress it to another target_ratio, or "
                        "shrink it further by training with tncompile.RankController")
    if not isinstance(model, nn.Module):
        raise TypeError(f"tncompile.compile expects an nn.Module, got {type(model).__name__}")
    if is_compressible(model):
        kind = type(model).__name__
        single = ("tncompile.runtime.TTMEmbedding.from_embedding(layer, rank=...)" if isinstance(model, nn.Embedding)
                  else "tncompile.runtime.TTMEmbeddingBag.from_embedding_bag(layer, rank=...)"
                  if isinstance(model, nn.EmbeddingBag) else "tncompile.runtime.TTLinear.from_linear(layer, rank=...)")
        raise TypeError(f"the model is a single {kind}: compile() compresses the layers inside a model. "
                        f"Use {single} for one layer, or compile(nn.Sequential(layer), ...)")


def _check_dump_dir(dump_dir: Any) -> None:
    if dump_dir is None:
        return
    if not isinstance(dump_dir, (str, os.PathLike)):
        raise TypeError(f"dump_dir must be a directory path or None, got {type(dump_dir).__name__} {dump_dir!r}")
    if not str(dump_dir).strip():
        raise ValueError("dump_dir is empty; give a directory to write the IR after every pass into "
                         "(e.g. dump_dir='ir_dumps'), or None to not dump")
    if os.path.exists(dump_dir) and not os.path.isdir(dump_dir):
        raise ValueError(f"dump_dir {str(dump_dir)!r} is a file, not a directory; give a directory to "
                         "write the IR dumps into")


def _put_layers_into(model: nn.Module, program: Program) -> None:
    """Graph mode's ``inplace=True``: the compiled layers also into the user's own module tree
    (swap mode's :func:`~tncompile.swap.swapped.attach` makes the user's model the result)."""
    for node, mod in program.modules():
        try:
            current = model.get_submodule(node.target)
        except AttributeError:
            continue
        if current is not mod:
            model.set_submodule(node.target, mod)
