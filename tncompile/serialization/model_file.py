"""``tncompile.save`` / ``load``: a compressed model as tensors and a table of data (``resume``,
which restores a checkpoint's training state, is :mod:`.checkpoint`).

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

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..api import is_plain_input, pipeline_for, rebuild
from ..result.materialize import materialize
from ..result.model_api import EXAMPLE_PREFIX, is_compressed
from ..errors import ModelFileError, ModelMismatchError, PassError, TraceError, check_materialized, is_int
from ..frontend.layers import is_compressible
from ..ir.program import count_params
from ..passes.tensorize import check_decision
from ..options import CompileOptions
from ..passes import BUILTIN_PASSES, Pass, Pipeline
from ..passes.infra.base import normalize_name
from ..runtime.layers.module_kinds import is_sharded
from ..swap.swapped import is_swapped, user_class
from .checkpoint import check_training_state, training_state
from . import plain
from .container import digest, encode_container, write_atomically
from .fields import boolean, choice, exact_keys, integer, module_path, names, number
from .layer_table import decisions_from_rows, decisions_of, table_rows
from .tensor_file import MAX_TENSORS, TensorFile, open_tensor_file

__all__ = ["save", "manifest_of", "check_manifest_header", "SavedModel", "FORMAT", "VERSION",
           "MAX_EXAMPLE_ELEMENTS", "EXAMPLE", "rebuild_saved", "checked_state", "load_checked_state"]

FORMAT = "tncompile"
VERSION = 3
MODES = ("graph", "swap")
MAX_PASSES = 64
PASS_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: most elements of all example inputs together (each dimension at most this too; an empty
#: dimension counts as 1): load traces the model on them, on fake tensors (no data)
MAX_EXAMPLE_ELEMENTS = 1 << 16
MAX_EXAMPLE_DIMS = 8
#: a training state (optimizer moments, ...) may hold at most this many times the model's
#: bytes (AdamW with amsgrad keeps 3), plus TRAINING_FLOOR_BYTES (extra, scalars)
TRAINING_PER_STATE_BYTE = 4
TRAINING_FLOOR_BYTES = 64 << 20
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
    check_materialized(compiled, "tncompile.save")
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
    """A model file's checked contents (:func:`read_model_file`): its fields, and its
    tensors' specs (dtype, shape) -- every one claimed by a part of the manifest and
    checked against it. Tensors are read only once what they must be is known: the
    example inputs (bounded) at once, the model's state once the rebuilt model says what
    it holds (:func:`checked_state`), the training state after it (bounded by the state)."""

    def __init__(self, path: Path, manifest: dict, file: TensorFile, seal: tuple[Any, str]):
        self.path, self.file, self._seal = path, file, seal
        #: a folder's recorded config fields (``hf_folder.structure_fields``); ``None`` for a model file
        self.structure: dict[str, int] | None = None
        where = str(path)
        specs = file.specs
        self.mode = choice(manifest["mode"], MODES, f"{where}: mode")
        self.train_mode = boolean(manifest["train_mode"], f"{where}: train_mode")
        self.model_class = module_path(manifest["model_class"], f"{where}: model_class")
        self.pipeline = _pipeline_names(manifest["pipeline"], where)
        self.options = _options(manifest["options"], where)
        self.original_params = integer(manifest["original_params"], 0, 2**53, f"{where}: original_params")
        self.compiled_ratio = (None if manifest["compiled_ratio"] is None
                               else number(manifest["compiled_ratio"], 0.0, 1e9, f"{where}: compiled_ratio"))
        used: set[str] = set()
        example = _example(manifest["example_inputs"], file, where, used)
        self.example_inputs = None if isinstance(example, str) else example
        self.example_refused = example if isinstance(example, str) else None
        self.decisions = decisions_from_rows(manifest["layers"], specs, where)
        self.state, self.aliases = _state(manifest["state"], specs, where, used)
        self._training = manifest["training"]
        training_names: set[str] = set()
        if self._training is not None:  # its structure now, on the specs; its tensors once the state loaded
            check_training_state(plain.decode(self._training, specs, f"{where}: training", training_names,
                                              _TRAINING), where)
        used |= training_names
        extra = sorted(set(specs) - used)
        if extra:
            raise ModelFileError(f"{where}: the tensor {extra[0]!r} (of {len(extra)}) is in no part of the manifest")
        state_bytes = sum(specs[n].nbytes for n in set(self.state) - set(self.aliases))
        training_bytes = sum(specs[n].nbytes for n in training_names)
        if training_bytes > TRAINING_PER_STATE_BYTE * state_bytes + TRAINING_FLOOR_BYTES:
            raise ModelFileError(f"{where}: a training state of {training_bytes:,} bytes for a model of {state_bytes:,} "
                                 f"(at most {TRAINING_PER_STATE_BYTE}x the model's, plus {TRAINING_FLOOR_BYTES:,})")

    def verify(self) -> None:
        """The checksum over the manifest and every tensor's bytes, checked once the structure
        is known to fit -- a damaged file is refused before its data are used, a crafted one
        before it is hashed. Each tensor is read once and kept: what is hashed is what
        :meth:`read` hands out afterwards (:class:`~.tensor_file.TensorFile`)."""
        expected, manifest = self._seal
        if expected is not None and expected != self.file.digest(manifest):
            raise ModelFileError(f"{self.path} is damaged: its contents do not match the checksum saved with them "
                                 "(an interrupted copy; or tensors and manifest that do not belong together, of "
                                 "different saves): save it again")
        self._seal = (None, manifest)

    def read(self, name: str) -> torch.Tensor:
        """The file's tensor ``name`` (read now)."""
        return self.file.read(name)

    def training(self) -> dict[str, Any] | None:
        """The training state, its tensors read (call after the model's state was checked)."""
        if self._training is None:
            return None
        return check_training_state(plain.decode(self._training, _Reader(self.file), f"{self.path}: training",
                                                 prefix=_TRAINING), str(self.path), values=True)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "SavedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Reader(Mapping):
    """The file's tensors as ``plain.decode`` looks them up: each read when asked for."""

    def __init__(self, file: TensorFile):
        self.file = file

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.file.specs:
            raise KeyError(name)
        return self.file.read(name)

    def __contains__(self, name) -> bool:  # from the header: nothing read
        return name in self.file.specs

    def __iter__(self):
        return iter(self.file.specs)

    def __len__(self) -> int:
        return len(self.file.specs)


def read_model_file(path: Path) -> SavedModel:
    """The file's manifest and tensors' specs, every field checked (no model is touched,
    no tensor but the bounded example inputs read)."""
    file = open_tensor_file(path, _not_a_pickle)
    try:
        metadata = file.metadata
        if metadata.get("format") != FORMAT:
            raise ModelFileError(f"{path} is not a tncompile file (save it with tncompile.save)")
        version = metadata.get("version", "")
        if version != str(VERSION):
            newer = version.isdigit() and int(version) > VERSION
            raise ModelFileError(
                f"{path} is a tncompile model file of format {version!r:.20}; this tncompile reads format {VERSION} "
                "only" + (": upgrade tncompile" if newer else
                          " (format 2 stored the whole program, which loading would have to trust; format 3 holds "
                          "data only): re-save it -- compile your model, load_state_dict the old model's weights, "
                          "tncompile.save"))
        text_ = metadata.get("manifest")
        try:
            manifest = json.loads(text_)
        except (TypeError, ValueError, RecursionError) as e:
            raise ModelFileError(f"{path} is damaged: its manifest cannot be read ({type(e).__name__}: {e})") from e
        check_manifest_header(manifest, f"{path}: the manifest")
        return SavedModel(path, manifest, file, (metadata.get("sha256"), text_))
    except BaseException:
        file.close()
        raise


def _not_a_pickle(head: bytes) -> str | None:
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        return ("is not a tncompile file: it is a pickle (tncompile's format 1 wrote them, "
                             "torch.save does). Loading a pickle runs the code it carries; this tncompile reads "
                             "format 3 only: compile your model, load_state_dict weights you trust, tncompile.save")
    return None


def check_manifest_header(manifest: Any, where: str) -> None:
    """The manifest's keys are exactly the format's, and it names this format and version."""
    exact_keys(manifest, _KEYS, where)
    if manifest["format"] != FORMAT or manifest["version"] != VERSION or isinstance(manifest["version"], bool):
        raise ModelFileError(f"{where} says format {manifest['format']!r:.40} version {manifest['version']!r:.20}; "
                             f"this tncompile reads {FORMAT!r} {VERSION}"
                             + (": upgrade tncompile" if is_int(manifest["version"]) and manifest["version"] > VERSION
                                else ""))


def dense_model(model: Any, path: Path, saved_class: str = "YourModel") -> nn.Module:
    """The dense model to rebuild onto: ``model`` itself, or what calling it returns (a
    class is refused: which configuration it needs is the caller's to say)."""
    if isinstance(model, type):
        raise TypeError(f"tncompile.load({str(path)!r}, model={model.__name__}): model is a class; pass an instance "
                        f"built as the one you compiled ({saved_class}(...) with the same configuration), or a "
                        f"callable that builds it (model=lambda: {saved_class}(...))")
    if not isinstance(model, nn.Module) and callable(model):
        model = model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"tncompile.load({str(path)!r}, model=...): model must be the dense nn.Module the file was "
                        f"saved from, or a callable that builds it; got {type(model).__name__}")
    if is_compressed(model):
        raise ModelMismatchError(f"tncompile.load({str(path)!r}, model=...): the model is already compressed; pass a "
                                 "fresh dense model")
    return model


def rebuild_saved(saved: SavedModel, dense: nn.Module, passes: Pipeline | Sequence[Pass | str] | None,
                  example_inputs: Any, load_tensors: bool = True) -> nn.Module:
    """Rebuild ``saved`` on ``dense`` and load its tensors (see the module doc); without
    ``load_tensors``, the structure only (the caller checks and loads them).

    ``passes`` is the pipeline the caller compiled with (``None``: the default one): the
    file's recorded pass names must be exactly its names, in its order -- the file only
    confirms where the caller's passes run. The file's example inputs are traced on fake
    tensors (shapes only, nothing allocated); ``example_inputs`` the caller gives are
    trusted and may run for real. Callers run it inside :func:`.caller_state.caller_state_kept`
    (``load``, the HF quantizer): building and tracing leave no global state behind."""
    where = str(saved.path)
    if type(dense).__name__ != saved.model_class:
        raise ModelMismatchError(f"{where} was saved from a {saved.model_class}, the model given is a "
                                 f"{type(dense).__name__}: pass the dense model it was saved from")
    _check_layers(dense, saved, where)  # before tracing: a config may ask for 300 layers
    params = count_params(dense)
    if params != saved.original_params:
        raise ModelMismatchError(f"{where}: the model given has {params:,} parameters, the one saved had "
                                 f"{saved.original_params:,}: build it with the same configuration")
    pipeline = _pipeline(saved.pipeline, passes, where, saved.options)
    example = example_inputs
    if example is None and saved.example_refused:
        raise ModelFileError(saved.example_refused)
    if example is None and saved.example_inputs is not None:  # compile took a tuple of args or a dict of kwargs
        args, kwargs = saved.example_inputs
        example = kwargs if kwargs else args
    on_meta = any(t.is_meta for t in (*dense.parameters(), *dense.buffers()))
    if on_meta and example_inputs is None and example is not None:  # traced on fake tensors: shapes are enough
        example = {k: _to_meta(v) for k, v in example.items()} if isinstance(example, dict) \
            else tuple(_to_meta(v) for v in example)
    try:
        compiled = rebuild(dense, saved.decisions, saved.options, pipeline, saved.mode, example,
                           trusted_inputs=example_inputs is not None)
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
    program.compiled_ratio = saved.compiled_ratio
    if example_inputs is None:  # the file's inputs, not the fake copies traced on
        program.example_inputs = saved.example_inputs
    if load_tensors:
        if on_meta:  # a model built on meta: memory, and what no saved tensor holds (rotary buffers), first
            _materialize_for_load(compiled, where)
        load_checked_state(compiled, saved, where)
        compiled.training_state = saved.training()
    compiled.train(saved.train_mode)
    return compiled


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _materialize_for_load(compiled: nn.Module, where: str) -> None:
    """Give a model rebuilt on the meta device memory on the CPU and its own initialization
    (HF's ``_init_weights`` computes buffers no file holds); the file's tensors then overwrite
    the state."""
    try:
        materialize(compiled, "cpu")
    except ValueError as e:
        raise ModelMismatchError(f"{where}: the model given is on the meta device and cannot be given memory "
                                 f"({e}); build it on the CPU instead (no `with torch.device('meta')`)") from e


def checked_state(model: nn.Module, saved: SavedModel, where: str, cast: bool = False) -> dict[str, str]:
    """Check the file's tensor for every state name of ``model`` -- names, order, shapes,
    dtypes (float to float where ``cast``) and sharing exactly as ``model`` has them -- by
    their specs (nothing read); ``state name -> the file's tensor name``."""
    expected = model.state_dict(keep_vars=True)
    if list(expected) != saved.state:
        missing = [n for n in expected if n not in set(saved.state)]
        unexpected = [n for n in saved.state if n not in expected]
        raise ModelMismatchError(f"{where}: the rebuilt model's state differs from the file's (missing "
                                 f"{missing[:3]}, unexpected {unexpected[:3]}{'' if missing or unexpected else ', order'}"
                                 "): pass the dense model it was saved from")
    first: dict[int, str] = {}
    sources = {}
    for name, t in expected.items():
        shared = first.setdefault(id(t), name)
        if saved.aliases.get(name, name) != shared:
            raise ModelMismatchError(f"{where}: {name!r} shares its tensor with {saved.aliases.get(name, name)!r} in "
                                     f"the file, with {shared!r} in the rebuilt model")
        source = saved.aliases.get(name, name)
        spec = saved.file.specs[source]
        castable = cast and spec.dtype.is_floating_point and t.is_floating_point()
        if spec.shape != tuple(t.shape) or (spec.dtype != t.dtype and not castable):
            raise ModelMismatchError(f"{where}: {name!r} is {spec.dtype} {spec.shape} in the file, "
                                     f"{t.dtype} {tuple(t.shape)} in the model given: build it the same way "
                                     "(configuration, dtype: model.to(dtype))")
        sources[name] = source
    return sources


def _check_layers(dense: nn.Module, saved: SavedModel, where: str) -> None:
    """The table's layers the model has at their paths, of the kind and shape the file says
    (a mismatch named by its layer, before any tracing; the pipeline checks them all again)."""
    modules = dict(dense.named_modules())
    for name, decision in saved.decisions.layers.items():
        mod = modules.get(name)
        if mod is not None and is_compressible(mod) and decision.tied_to is None:
            try:
                check_decision(name, decision, {name: mod}, {})
            except ModelMismatchError as e:
                raise ModelMismatchError(f"{where}: {e}") from e


def load_checked_state(model: nn.Module, saved: SavedModel, where: str, cast: bool = False) -> None:
    """:func:`checked_state`, then each tensor read and copied in (``load_state_dict(strict=True)``)."""
    sources = checked_state(model, saved, where, cast)
    saved.verify()
    values = {source: saved.read(source) for source in dict.fromkeys(sources.values())}
    with torch.no_grad():
        model.load_state_dict({name: values[source] for name, source in sources.items()}, strict=True)


def _pipeline_names(data: Any, where: str) -> list[str]:
    if not isinstance(data, list) or not 1 <= len(data) <= MAX_PASSES:
        raise ModelFileError(f"{where}: pipeline must be a list of 1 to {MAX_PASSES} pass names")
    for i, name in enumerate(data):
        if not isinstance(name, str) or not PASS_NAME.match(name):
            raise ModelFileError(f"{where}: pipeline[{i}] {name!r:.80} is not a pass name")
    return data


def _pipeline(names_: list[str], given: Pipeline | Sequence[Pass | str] | None, where: str,
              options: CompileOptions) -> Pipeline:
    """The caller's pipeline (what they gave ``compile``), which the file's pass names must match;
    without one, the default pipeline, of which the file may leave passes out (a model compiled
    with ``passes=[...]`` of tncompile's own, loaded by ``from_pretrained``) but never add or
    move one. The file's ``linear_cores="measured"`` adds ``choose_cores`` as ``compile`` does
    (it does nothing on load: the layouts are the file's)."""
    try:
        pipeline = pipeline_for(given, options)
    except (TypeError, ValueError) as e:
        raise type(e)(f"tncompile.load(passes=...): {e}") from e
    saved = [normalize_name(n) for n in names_]
    if given is None and _in_order(saved, [normalize_name(n) for n in pipeline.names]):
        return Pipeline(saved)  # tncompile's own passes, in their order, some left out (compile(passes=[...]))
    if saved != [normalize_name(n) for n in pipeline.names]:
        custom = [n for n in names_ if normalize_name(n) not in BUILTIN_PASSES]
        fix = ("pass the pipeline you compiled with: passes=default_pipeline().insert_after(..., YourPass()) as "
               f"given to compile (the file ran {custom})" if custom else "pass the passes= you compiled with")
        raise ModelMismatchError(f"{where} was compiled with the passes {names_}; the passes given run "
                                 f"{pipeline.names}: {fix}. The file only confirms the pipeline, never chooses it")
    return pipeline


def _in_order(names_: list[str], default: list[str]) -> bool:
    """``names_`` is ``default`` with some passes left out (same order, nothing added)."""
    rest = iter(default)
    return all(any(n == d for d in rest) for n in names_)


def _options(data: Any, where: str) -> CompileOptions:
    """The file's compile settings, checked as ``compile`` checks its arguments."""
    at = f"{where}: options"
    exact_keys(data, {"target_ratio", "prefer", "init", "batch_sizes", "linear_cores", "embedding_cores"}, at)
    try:
        return CompileOptions(**data)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{at}: {e}") from e


def _example(data: Any, file: TensorFile, where: str, used: set[str]) -> tuple[tuple, dict] | str | None:
    """The example inputs: checked on the specs (each dimension and all elements together
    within :data:`MAX_EXAMPLE_ELEMENTS`), then read; out of those bounds, why (unread: the
    caller may give inputs of their own)."""
    if data is None:
        return None
    at = f"{where}: example_inputs"
    names_: set[str] = set()
    shapes = plain.decode(data, file.specs, at, names_, EXAMPLE)
    used |= names_
    elements = sum(math.prod(max(d, 1) for d in file.specs[name].shape) for name in names_)
    shape = max((file.specs[name].shape for name in names_), key=lambda s: (len(s), max(s, default=0)), default=())
    if len(shape) > MAX_EXAMPLE_DIMS or max(shape, default=0) > MAX_EXAMPLE_ELEMENTS or elements > MAX_EXAMPLE_ELEMENTS:
        return (f"{at}: {elements:,} elements, a tensor of shape {shape} (at most {MAX_EXAMPLE_ELEMENTS:,} elements, "
                f"{MAX_EXAMPLE_DIMS} dimensions of at most as many: load traces the model on them); pass "
                "example_inputs= to load it")
    value = plain.decode(data, _Reader(file), at, set(), EXAMPLE) if names_ else shapes
    ok = isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple) and isinstance(value[1], dict)
    leaves = [*value[0], *value[1].values()] if ok else []
    if not ok or not all(map(is_plain_input, leaves)) or not all(isinstance(k, str) for k in value[1]):
        raise ModelFileError(f"{at} must be (args, kwargs) of tensors and plain values")
    return value


def _state(data: Any, tensors: dict, where: str, used: set[str]) -> tuple[list[str], dict[str, str]]:
    exact_keys(data, {"names", "aliases"}, f"{where}: state")
    state = names(data["names"], None, f"{where}: state names", limit=MAX_TENSORS)
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
