"""``tncompile.save`` / ``load``: a compressed model as tensors and a table of data (``resume``,
which restores a checkpoint's training state, is :mod:`tncompile.train.checkpoint`).

Format 3 is a safetensors file. Its tensors are the compressed model's ``state_dict``
(standard names; a tensor two names share is stored once) and, in a checkpoint, the
optimizer's state, the random streams and ``extra``. Its metadata holds a JSON manifest
of data only: the format version, the layer table (:mod:`.layer_table`: each compressed
layer's path, kind, modes, ranks and tensor names), the compile settings and the names of
the passes that ran, the state's names, the example inputs the model was traced with, and
the training state as plain data (:mod:`.plain`). No graph, no object state, no class to
import, no plan, nothing that becomes code.

Structure comes from the user's own code: :func:`load` takes the dense model (or a
callable that builds it), traces it as ``compile`` did and runs the recorded pipeline
with the table's decisions instead of deciding again (:func:`tncompile.api.rebuild`);
every tensor is then checked against the rebuilt model -- exact names, shapes, dtypes and
sharing -- and loaded. Everything about the file that is wrong is a
:class:`~tncompile.errors.ModelFileError` (a file that does not fit the model given: its
subclass :class:`~tncompile.errors.ModelMismatchError`).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..api import is_plain_input, rebuild
from ..result.model_api import EXAMPLE_PREFIX, is_compressed
from ..errors import ModelFileError, ModelMismatchError, PassError, TraceError, is_int
from ..options import CompileOptions
from ..passes import BUILTIN_PASSES, Pass, Pipeline, get_pass
from ..passes.infra.base import normalize_name
from ..runtime.layers.module_kinds import is_sharded
from ..swap.swapped import is_swapped, user_class
from ..train.checkpoint import check_training_state, training_state
from . import plain
from .container import digest, encode_container, read_container, write_atomically
from .fields import boolean, choice, exact_keys, integer, module_path, names, number
from .layer_table import decisions_from_rows, decisions_of, table_rows

__all__ = ["save", "manifest_of", "check_manifest_header", "SavedModel", "FORMAT", "VERSION",
           "MAX_EXAMPLE_ELEMENTS", "EXAMPLE", "rebuild_saved", "checked_state", "load_checked_state"]

FORMAT = "tncompile"
VERSION = 3
MODES = ("graph", "swap")
MAX_PASSES = 64
PASS_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: most elements of all example inputs together: load runs the model on them while tracing
MAX_EXAMPLE_ELEMENTS = 1 << 16
_TRAINING = "tncompile/training"
EXAMPLE = EXAMPLE_PREFIX.rstrip(".")  # plain.encode names its tensors EXAMPLE.<n>
_KEYS = {"format", "version", "mode", "model_class", "pipeline", "options", "original_params", "compiled_ratio",
         "example_inputs", "layers", "state", "training", "train_mode"}


# ----------------------------------------------------------------- save
def save(compiled: nn.Module, path: str | os.PathLike, *, optimizer: torch.optim.Optimizer | None = None,
         controller=None, extra: dict[str, Any] | None = None, rng: bool = True) -> None:
    """Write ``compiled`` (graph or swap mode) to ``path``; with what resuming needs.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer, optional
        Its state, keyed by parameter name (restored by :func:`resume`).
    controller : RankController, optional
        Its schedule, targets and loss average.
    extra : dict, optional
        Plain data: ``None``, bools, numbers, strings, tensors, and lists, tuples and
        dicts of them (``tncompile.fit`` stores its history and scheduler state here).
        Anything else raises ``TypeError`` naming where it is: files hold no code.
    rng : bool
        Save the CPU (and initialized CUDA) random generators' states, so a resumed
        run draws the same dropout masks.

    The write is atomic: a temporary file in the same directory is renamed over
    ``path`` only once complete, so a crash leaves any previous file intact.
    """
    compiled = _saved_model(compiled)
    path = _file_path(path, "save")
    _check_destination(path)
    training = training_state(compiled, optimizer, controller, extra, rng)
    tensors: dict[str, torch.Tensor] = {}
    manifest = manifest_of(compiled, tensors)
    manifest["training"] = None if training is None else plain.encode(training, tensors, _TRAINING,
                                                                        "the training state")
    text_ = json.dumps(manifest)
    metadata = {"format": FORMAT, "version": str(VERSION), "manifest": text_, "sha256": digest(tensors, text_)}
    header, body = encode_container(tensors, metadata)
    write_atomically(path, header, body)


def manifest_of(compiled: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The manifest of ``compiled`` (no training state); its state's tensors and example
    inputs go into ``tensors``."""
    program = compiled.program
    swap = is_swapped(compiled)
    state, aliases = _model_state(compiled, tensors)
    return {
        "format": FORMAT, "version": VERSION, "mode": "swap" if swap else "graph",
        "model_class": (user_class(compiled) if swap else type(compiled.model)).__name__,
        "pipeline": list(program.pipeline),
        "options": _options_row(program.options),
        "original_params": program.original_params,
        "compiled_ratio": program.compiled_ratio,
        "example_inputs": plain.encode(program.example_inputs, tensors, EXAMPLE)
        if program.example_inputs is not None else None,
        "layers": table_rows(decisions_of(program), program, compiled),
        "state": {"names": state, "aliases": aliases},
        "training": None,
        "train_mode": compiled.training,
    }


def _saved_model(compiled: Any) -> nn.Module:
    while not is_compressed(compiled) \
            and isinstance(getattr(compiled, "module", None), nn.Module):
        compiled = compiled.module  # a DDP / DistributedModel wrapper: save what it wraps
    if not is_compressed(compiled):
        raise TypeError(f"tncompile.save expects a model tncompile.compile returned, got {type(compiled).__name__}")
    if is_sharded(compiled):  # save_on_rank0 gathers the shards on every process first
        raise ValueError("tncompile.save: the model is sharded by FSDP2 (its parameters are DTensor shards); "
                         "call tncompile.distributed.save_on_rank0(compiled, path, optimizer=...) on every "
                         "process: it gathers the shards and rank 0 writes the file")
    return compiled


def _check_destination(path: Path) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise IsADirectoryError(f"tncompile.save: {str(path)!r} is a directory; give a file path, "
                                f"e.g. {str(path / 'model.tnc')!r}")
    if not directory.is_dir():
        raise FileNotFoundError(f"tncompile.save: the directory {str(directory)!r} of {str(path)!r} does not "
                                "exist; create it first (os.makedirs)")


def _model_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, str]]:
    """The state's names, and ``name -> first name`` of each tensor another name already holds."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    state = []
    for name, t in model.state_dict(keep_vars=True).items():
        state.append(name)
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            tensors[name] = t.detach()
    return state, aliases


def _options_row(options: CompileOptions) -> dict[str, Any]:
    return {"target_ratio": options.target_ratio, "prefer": options.prefer, "init": options.init,
            "batch_sizes": list(options.batch_sizes) if options.batch_sizes else None,
            "linear_cores": options.linear_cores, "embedding_cores": options.embedding_cores}


# ----------------------------------------------------------------- reading a file
class SavedModel:
    """A model file's checked contents (:func:`read_model_file`)."""

    def __init__(self, path: Path, manifest: dict, tensors: dict[str, torch.Tensor]):
        self.path = path
        where = str(path)
        self.mode = choice(manifest["mode"], MODES, f"{where}: mode")
        self.train_mode = boolean(manifest["train_mode"], f"{where}: train_mode")
        self.model_class = module_path(manifest["model_class"], f"{where}: model_class")
        self.pipeline = _pipeline_names(manifest["pipeline"], where)
        self.options = _options(manifest["options"], where)
        self.original_params = integer(manifest["original_params"], 0, 2**53, f"{where}: original_params")
        self.compiled_ratio = (None if manifest["compiled_ratio"] is None
                               else number(manifest["compiled_ratio"], 0.0, 1e9, f"{where}: compiled_ratio"))
        used: set[str] = set()
        self.example_inputs = _example(manifest["example_inputs"], tensors, where, used)
        self.decisions = decisions_from_rows(manifest["layers"], tensors, where)
        self.state, self.aliases = _state(manifest["state"], tensors, where, used)
        self.training = (None if manifest["training"] is None else check_training_state(
            plain.decode(manifest["training"], tensors, f"{where}: training", used), where))
        extra = sorted(set(tensors) - used)
        if extra:
            raise ModelFileError(f"{where}: the tensor {extra[0]!r} (of {len(extra)}) is in no part of the manifest")
        self.tensors = tensors


def read_model_file(path: Path) -> SavedModel:
    """The file's manifest and tensors, every field checked (no model is touched)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if not (len(head) == 9 and head[8:9] == b"{"):
        if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
            raise ModelFileError(f"{path} is not a tncompile file: it is a pickle (tncompile's format 1 wrote them, "
                                 "torch.save does). Loading a pickle runs the code it carries; this tncompile reads "
                                 "format 3 only: compile your model, load_state_dict weights you trust, tncompile.save")
        raise ModelFileError(f"{path} is not a tncompile file (save it with tncompile.save)")
    metadata, tensors = read_container(path)
    if metadata.get("format") != FORMAT:
        raise ModelFileError(f"{path} is not a tncompile file (save it with tncompile.save)")
    version = metadata.get("version", "")
    if version != str(VERSION):
        newer = version.isdigit() and int(version) > VERSION
        raise ModelFileError(
            f"{path} is a tncompile model file of format {version!r:.20}; this tncompile reads format {VERSION} only"
            + (": upgrade tncompile" if newer else
               " (format 2 stored the whole program, which loading would have to trust; format 3 holds data only): "
               "re-save it -- compile your model, load_state_dict the old model's weights, tncompile.save"))
    text_ = metadata.get("manifest")
    if metadata.get("sha256") != digest(tensors, text_ if isinstance(text_, str) else None):
        raise ModelFileError(f"{path} is damaged: its contents do not match the checksum saved with them")
    try:
        manifest = json.loads(text_)
    except (TypeError, ValueError, RecursionError) as e:
        raise ModelFileError(f"{path} is damaged: its manifest cannot be read ({type(e).__name__}: {e})") from e
    check_manifest_header(manifest, f"{path}: the manifest")
    return SavedModel(path, manifest, tensors)


def check_manifest_header(manifest: Any, where: str) -> None:
    """The manifest's keys are exactly the format's, and it names this format and version."""
    exact_keys(manifest, _KEYS, where)
    if manifest["format"] != FORMAT or manifest["version"] != VERSION or isinstance(manifest["version"], bool):
        raise ModelFileError(f"{where} says format {manifest['format']!r:.40} version {manifest['version']!r:.20}; "
                             f"this tncompile reads {FORMAT!r} {VERSION}"
                             + (": upgrade tncompile" if is_int(manifest["version"]) and manifest["version"] > VERSION
                                else ""))


def dense_model(model: Any, path: Path) -> nn.Module:
    """The dense model to rebuild onto: ``model`` itself, or what calling it returns."""
    if not isinstance(model, nn.Module) and callable(model):
        model = model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"tncompile.load({str(path)!r}, model=...): model must be the dense nn.Module the file was "
                        f"saved from, or a callable that builds it; got {type(model).__name__}")
    if is_compressed(model):
        raise ModelMismatchError(f"tncompile.load({str(path)!r}, model=...): the model is already compressed; pass a "
                                 "fresh dense model")
    return model


def rebuild_saved(saved: SavedModel, dense: nn.Module, passes: Sequence[Pass] | None, example_inputs: Any,
                  load_tensors: bool = True) -> nn.Module:
    """Rebuild ``saved`` on ``dense`` and load its tensors (see the module doc); without
    ``load_tensors``, the structure only (the caller checks and loads them)."""
    where = str(saved.path)
    if type(dense).__name__ != saved.model_class:
        raise ModelMismatchError(f"{where} was saved from a {saved.model_class}, the model given is a "
                                 f"{type(dense).__name__}: pass the dense model it was saved from")
    pipeline = _pipeline(saved.pipeline, passes, where)
    example = example_inputs
    if example is None and saved.example_inputs is not None:  # compile took a tuple of args or a dict of kwargs
        args, kwargs = saved.example_inputs
        elements = sum(t.numel() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        if elements > MAX_EXAMPLE_ELEMENTS:
            raise ModelFileError(f"{where}: example inputs of {elements:,} elements (at most {MAX_EXAMPLE_ELEMENTS:,}: "
                                 "load runs the model on them); pass example_inputs= to load it")
        example = kwargs if kwargs else args
    try:
        with _global_state_kept():
            compiled = rebuild(dense, saved.decisions, saved.options, pipeline, saved.mode, example)
    except ModelFileError as e:
        raise type(e)(f"{where}: {e}") from e
    except PassError as e:
        raise ModelFileError(f"{where}: rebuilding with the file's pipeline {saved.pipeline} failed: {e}") from e
    except (TraceError, ValueError, TypeError, RuntimeError, IndexError) as e:
        if example_inputs is not None:
            raise
        raise ModelFileError(f"{where}: tracing the model given on the file's example inputs failed ({type(e).__name__}: "
                             f"{e}); pass example_inputs= to load it, or check it is the model the file was saved "
                             "from") from e
    program = compiled.program
    if program.original_params != saved.original_params:
        raise ModelMismatchError(f"{where}: the model given has {program.original_params:,} parameters, the one "
                                 f"saved had {saved.original_params:,}: build it with the same configuration")
    program.compiled_ratio = saved.compiled_ratio
    if program.example_inputs is None:  # traced on meta copies (from_pretrained): keep the file's
        program.example_inputs = saved.example_inputs
    if load_tensors:
        load_checked_state(compiled, saved, where)
    compiled.train(saved.train_mode)
    compiled.training_state = saved.training
    return compiled


@contextlib.contextmanager
def _global_state_kept():
    """Rebuilding traces the user's model, which may run it (dropout draws, a model that sets
    a default dtype): the caller's random stream, grad mode and default dtype are put back."""
    grad, dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(dtype)


def checked_state(model: nn.Module, saved: SavedModel, where: str, cast: bool = False) -> dict[str, torch.Tensor]:
    """The file's value for every state name of ``model``: names, order, shapes, dtypes
    (float to float where ``cast``) and sharing exactly as ``model`` has them."""
    expected = model.state_dict(keep_vars=True)
    if list(expected) != saved.state:
        missing = [n for n in expected if n not in set(saved.state)]
        unexpected = [n for n in saved.state if n not in expected]
        raise ModelMismatchError(f"{where}: the rebuilt model's state differs from the file's (missing "
                                 f"{missing[:3]}, unexpected {unexpected[:3]}{'' if missing or unexpected else ', order'}"
                                 "): pass the dense model it was saved from")
    first: dict[int, str] = {}
    values = {}
    for name, t in expected.items():
        shared = first.setdefault(id(t), name)
        if saved.aliases.get(name, name) != shared:
            raise ModelMismatchError(f"{where}: {name!r} shares its tensor with {saved.aliases.get(name, name)!r} in "
                                     f"the file, with {shared!r} in the rebuilt model")
        value = saved.tensors[saved.aliases.get(name, name)]
        castable = cast and value.is_floating_point() and t.is_floating_point()
        if value.shape != t.shape or (value.dtype != t.dtype and not castable):
            raise ModelMismatchError(f"{where}: {name!r} is {value.dtype} {tuple(value.shape)} in the file, "
                                     f"{t.dtype} {tuple(t.shape)} in the model given: build it the same way "
                                     "(configuration, dtype: model.to(dtype))")
        values[name] = value
    return values


def load_checked_state(model: nn.Module, saved: SavedModel, where: str, cast: bool = False) -> None:
    """:func:`checked_state`, then ``load_state_dict(strict=True)`` (copies into the model's tensors)."""
    values = checked_state(model, saved, where, cast)
    with torch.no_grad():
        model.load_state_dict(values, strict=True)


def _pipeline_names(data: Any, where: str) -> list[str]:
    if not isinstance(data, list) or not 1 <= len(data) <= MAX_PASSES:
        raise ModelFileError(f"{where}: pipeline must be a list of 1 to {MAX_PASSES} pass names")
    for i, name in enumerate(data):
        if not isinstance(name, str) or not PASS_NAME.match(name):
            raise ModelFileError(f"{where}: pipeline[{i}] {name!r:.80} is not a pass name")
    return data


def _pipeline(names_: list[str], given: Sequence[Pass] | None, where: str) -> Pipeline:
    """The recorded pipeline: tncompile's passes by name, the user's from ``given``."""
    mine = {normalize_name(p.name): p for p in (given or [])}
    if any(not isinstance(p, Pass) for p in (given or [])):
        raise TypeError("tncompile.load(passes=...): a list of Pass objects (your own passes)")
    steps = []
    for name in names_:
        key = normalize_name(name)
        if key in mine:
            steps.append(mine.pop(key))
        elif key in BUILTIN_PASSES:
            steps.append(get_pass(key))
        else:
            raise ModelFileError(f"{where} was compiled with the pass {name!r}, which is not tncompile's: pass yours "
                                 f"again, tncompile.load(path, model=..., passes=[{name} pass object])")
    if mine:
        raise ModelMismatchError(f"{where}: passes={sorted(mine)} were given, but the file's pipeline "
                                 f"{names_} did not run them")
    return Pipeline(steps)


def _options(data: Any, where: str) -> CompileOptions:
    """The file's compile settings, checked as ``compile`` checks its arguments."""
    at = f"{where}: options"
    exact_keys(data, {"target_ratio", "prefer", "init", "batch_sizes", "linear_cores", "embedding_cores"}, at)
    try:
        return CompileOptions(**data)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{at}: {e}") from e


def _example(data: Any, tensors: dict, where: str, used: set[str]) -> tuple[tuple, dict] | None:
    if data is None:
        return None
    value = plain.decode(data, tensors, f"{where}: example_inputs", used)
    ok = isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple) and isinstance(value[1], dict)
    leaves = [*value[0], *value[1].values()] if ok else []
    if not ok or not all(map(is_plain_input, leaves)) or not all(isinstance(k, str) for k in value[1]):
        raise ModelFileError(f"{where}: example_inputs must be (args, kwargs) of tensors and plain values")
    return value


def _state(data: Any, tensors: dict, where: str, used: set[str]) -> tuple[list[str], dict[str, str]]:
    exact_keys(data, {"names", "aliases"}, f"{where}: state")
    state = names(data["names"], None, f"{where}: state names", limit=10_000_000)
    if len(set(state)) != len(state):
        raise ModelFileError(f"{where}: a state name appears twice")
    aliases = data["aliases"]
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise ModelFileError(f"{where}: state aliases must map names to names")
    known = set(state)
    for name in state:
        canonical = aliases.get(name, name)
        if canonical not in known or canonical in aliases or canonical not in tensors:
            raise ModelFileError(f"{where}: the state {name!r} has no tensor in the file")
        used.add(canonical)
    if set(aliases) - known:
        raise ModelFileError(f"{where}: an alias names no state entry")
    return state, aliases


def _file_path(path: Any, verb: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise TypeError(f"tncompile.{verb}: path must be a file path (str or os.PathLike), got "
                        f"{type(path).__name__} {path!r}")
    return Path(path)
