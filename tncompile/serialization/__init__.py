"""``tncompile.save`` / ``tncompile.load``: a compiled model in one file that loads without running code.

Format 2 (this version) is a safetensors file: the tensors, plus a JSON
manifest in its metadata that describes everything else as data -- the graph
(node by node, targets by name), the module tree (class names and settings),
layouts, ranks, plans, pass history and, for checkpoints, the optimizer,
controller and RNG state (:mod:`.codec`, :mod:`.graphs`). Loading parses JSON
and reads tensors; it never unpickles, and the classes and functions a file
may name are checked against allowlists. A SHA-256 of the tensors guards
against damaged files.

Format 1 files (tncompile before this version) are pickles: :func:`load`
refuses them unless called with ``trust=True`` (:mod:`.legacy`).
"""
from __future__ import annotations

import ctypes
import hashlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compiled import CompiledModel
from ..errors import ModelFileError, UnsafeFileError
from ..ir.program import InputSpec, PassRecord, Program
from ..options import CompileOptions
from ..passes import Pipeline, Replan
from ..runtime.module_kinds import is_sharded
from ..swap import is_swapped, register_folder_writer
from . import legacy
from .codec import Decoder, Encoder
from .container import encode_container, read_bytes_once, read_container, write_atomically
from .graphs import SAFE_MODULE_CLASSES, GraphLimits, allow_module_class, decode_graph_module, encode_graph_module
from .model_checks import check_model
from .pretrained_folder import FOLDER_FILE, is_model_folder, model_for_folder, save_folder
from .swapped import ModelMismatchError, attach_swap, encode_swap

__all__ = ["save", "load", "resume", "FORMAT", "VERSION", "ModelFileError", "UnsafeFileError",
           "allow_module_class", "SAFE_MODULE_CLASSES"]

FORMAT = "tncompile"
VERSION = 2


def save(compiled: CompiledModel, path: str | os.PathLike, *, optimizer: torch.optim.Optimizer | None = None,
         controller=None, extra: dict[str, Any] | None = None, rng: bool = True) -> None:
    """Write ``compiled`` (graph, layouts, current ranks, weights, gates, plans,
    IR history) to ``path``, optionally with what resuming training needs.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer, optional
        Its state is saved keyed by parameter name (restored by :func:`resume`).
    controller : RankController, optional
        Its schedule, targets and loss average.
    extra : dict, optional
        Plain data (tensors, numbers, strings, lists, tuples, dicts;
        ``tncompile.fit`` stores its ``History`` here). Other objects raise
        ``TypeError`` naming where they are: files hold no code.
    rng : bool
        Save the CPU (and initialized CUDA) random generators' states, so a
        resumed run draws the same dropout masks.

    The write is atomic: a temporary file in the same directory is renamed
    over ``path`` only once complete (and the directory entry synced), so a
    crash leaves any previous file intact.
    """
    while not isinstance(compiled, CompiledModel) and not is_swapped(compiled) \
            and isinstance(getattr(compiled, "module", None), nn.Module):
        compiled = compiled.module  # a DDP / DistributedModel wrapper: save what it wraps
    if not isinstance(compiled, CompiledModel) and not is_swapped(compiled):
        raise TypeError(f"tncompile.save expects a CompiledModel, got {type(compiled).__name__}")
    if is_sharded(compiled):  # save_on_rank0 gathers the shards on every process first
        raise ValueError("tncompile.save: the model is sharded by FSDP2 (its parameters are DTensor shards); "
                         "call tncompile.distributed.save_on_rank0(compiled, path, optimizer=...) on every "
                         "process: it gathers the shards and rank 0 writes the file")
    path = _file_path(path, "save")
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise IsADirectoryError(f"tncompile.save: {str(path)!r} is a directory; give a file path, "
                                f"e.g. {str(path / 'model.tnc')!r}")
    if not directory.is_dir():
        raise FileNotFoundError(f"tncompile.save: the directory {str(directory)!r} of {str(path)!r} does not "
                                "exist; create it first (os.makedirs)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"tncompile.save: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__} {optimizer!r}")
    if controller is not None and not (hasattr(controller, "state_dict") and hasattr(controller, "penalty")):
        raise TypeError(f"tncompile.save: controller must be a RankController, got {type(controller).__name__}")
    prog = compiled.program
    enc = Encoder()
    manifest = {
        "format": FORMAT, "version": VERSION, "torch": torch.__version__,
        "graph": encode_graph_module(enc, prog.graph_module),
        "inputs": enc.encode(prog.inputs, "the input spec"),
        "original_params": prog.original_params,
        "options": enc.encode(prog.options, "the compile options"),
        "notes": prog.notes,
        "history": enc.encode(prog.history, "the pass history"),
        "compiled_ratio": prog.compiled_ratio,
        "training": enc.encode(_training_state(compiled, optimizer, controller, extra, rng), "the training state"),
    }
    if is_swapped(compiled):
        manifest["swap"] = encode_swap(enc, compiled)
    text = json.dumps(manifest)
    metadata = {"format": FORMAT, "version": str(VERSION), "manifest": text,
                "sha256": _digest(enc.tensors, text)}
    header, body = encode_container(enc.tensors, metadata)
    write_atomically(path, header, body)


def _save_pretrained(model: nn.Module, directory, **kwargs: Any) -> None:
    save_folder(model, directory, save, **kwargs)


register_folder_writer(_save_pretrained)


def _restore_rank_stream(per_rank: list[torch.Tensor]) -> None:
    """A distributed run's checkpoint: each process gets its own saved CPU random
    stream back. On another world size, processes the saving run did not have
    get a stream of their own derived from rank 0's and their rank (distinct,
    reproducible), and every process is told the run is no longer bit-identical."""
    me, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if me < len(per_rank):
        torch.set_rng_state(per_rank[me])
    else:
        base = torch.Generator()
        base.set_state(per_rank[0])
        seed = int(torch.randint(0, 2**62, (1,), generator=base)) + me
        torch.manual_seed(seed)
    if world != len(per_rank):
        warnings.warn(f"tncompile.resume: the checkpoint was written by {len(per_rank)} process(es), this run has "
                      f"{world}. Weights, optimizer and controller state resume exactly; what follows is not "
                      "bit-identical to the saved run: each step averages a different number of micro-batches, "
                      "your sampler splits the data differently, and "
                      + ("processes beyond the saved ones draw new random streams (derived from rank 0's)."
                         if world > len(per_rank) else "the streams of the missing processes are dropped."),
                      RuntimeWarning, stacklevel=3)


def _file_path(path: Any, verb: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise TypeError(f"tncompile.{verb}: path must be a file path (str or os.PathLike), got "
                        f"{type(path).__name__} {path!r}")
    return Path(path)


def _digest(tensors: dict[str, torch.Tensor], manifest: str | None = None) -> str:
    """SHA-256 over the manifest (the graph's code, layouts, ...) when given, then
    every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    if manifest is not None:
        h.update(manifest.encode() + b"\0")
    for key in sorted(tensors, key=lambda k: int(k[1:]) if k[1:].isdigit() else k):
        t = tensors[key].contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        nbytes = t.numel() * t.element_size()
        if nbytes:
            h.update(memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())))
    return h.hexdigest()


def _param_names(compiled: CompiledModel, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Per param group, the names of its parameters in the compiled model."""
    names = {id(p): n for n, p in compiled.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"the optimizer holds parameters that are not the compiled model's "
                             f"(shapes {missing[:3]}); build it from the model being saved")
        out.append([names[id(p)] for p in group["params"]])
    return out


def _training_state(compiled, optimizer, controller, extra, rng) -> dict[str, Any] | None:
    if optimizer is None and controller is None and extra is None and not rng:
        return None
    state: dict[str, Any] = {"extra": extra}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        state["optimizer_names"] = _param_names(compiled, optimizer)
        state["optimizer_class"] = type(optimizer).__name__
    if controller is not None:
        state["controller"] = controller.state_dict()
    if rng:
        state["rng"] = {"cpu": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}
    return state


def load(path: str | os.PathLike, map_location=None, *, trust: bool = False,
         model: nn.Module | None = None) -> CompiledModel | nn.Module:
    """Rebuild a :class:`CompiledModel` saved by :func:`save`.

    Parameters
    ----------
    map_location : device or str, optional
        Move the model there after loading (tensors are read to CPU first).
    trust : bool
        Load what the safe path refuses: a format-1 file (a pickle: loading
        it runs any code it carries), or a file naming module classes or
        functions outside tncompile's allowlists. Only for files you trust.
    model : nn.Module or class, optional
        For a file saved from a swap-mode model (``compile(mode="swap")``):
        a dense instance of the same class and configuration to load it onto
        (in place); it is returned with its layers swapped. A file holds no
        code, so it cannot build your model class itself. For a folder the
        model's ``save_pretrained`` wrote, the class will do (an HF class is
        built from the folder's ``config.json``).

    Raises
    ------
    UnsafeFileError
        The file needs ``trust=True`` (the message says why).
    ValueError
        Not a tncompile file, written by a newer tncompile, or damaged.
    """
    path = _file_path(path, "load")
    if is_model_folder(path):  # save_pretrained of a swap-mode model
        if model is None:
            raise TypeError(f"tncompile.load: {str(path)!r} was written by save_pretrained of a compressed model; "
                            "pass its model class (model=BertModel: built from the folder's config.json) or a "
                            "fresh instance to load it onto")
        return load(path / FOLDER_FILE, map_location, trust=trust, model=model_for_folder(path, model))
    if path.is_dir():
        raise IsADirectoryError(f"tncompile.load: {str(path)!r} is a directory; give the file tncompile.save wrote "
                                "(or a folder a compressed model's save_pretrained wrote)")
    if not path.exists():
        raise FileNotFoundError(f"tncompile.load: no file {str(path)!r}")
    if map_location is not None:
        try:
            torch.device(map_location)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"tncompile.load: map_location={map_location!r} is not a device "
                             "(e.g. 'cpu', 'cuda', 'cuda:1' or a torch.device)") from e
    data = read_bytes_once(path)
    kind = _file_kind(data, path)
    if kind == "pickle":
        if not trust:
            raise UnsafeFileError(
                f"{path} is a pickle (tncompile's format 1, or not a tncompile file at all): loading it runs "
                f"whatever code it carries. Load it with tncompile.load(path, trust=True) only if you trust "
                f"where it came from, then tncompile.save it again to convert it to the safe format.")
        return _load_v1(io.BytesIO(bytes(data)), map_location)
    try:
        compiled = _load_v2(data, path, trust, model)
    except (ModelFileError, ModelMismatchError):
        raise
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, RecursionError, OverflowError,
            RuntimeError) as e:  # a check this loader lacks: still the library's error, naming the file
        raise ModelFileError(f"{path}: a malformed model file ({type(e).__name__}: {e})") from e
    if map_location is not None:
        compiled.to(map_location)
    return compiled


def _load_v2(data: bytearray, path: Path, trust: bool, model: nn.Module | None) -> CompiledModel | nn.Module:
    metadata, tensors = read_container(data, path)
    if metadata.get("format") != FORMAT:
        raise ModelFileError(f"{path} is not a tncompile file (save it with tncompile.save)")
    version = metadata.get("version", "")
    if not version.isdigit():
        raise ModelFileError(f"{path}: its format version {version!r} is not a number")
    if int(version) > VERSION:
        raise ModelFileError(f"{path} was written by a newer tncompile (format {version}); upgrade tncompile")
    # new files' checksum covers the manifest too; earlier ones covered the tensors alone
    expected = metadata.get("sha256")
    if expected not in (_digest(tensors, metadata.get("manifest")), _digest(tensors)):
        raise ModelFileError(f"{path} is damaged: its contents do not match the checksum saved with them")
    try:
        manifest = json.loads(metadata["manifest"])
    except (KeyError, ValueError, RecursionError) as e:
        raise ModelFileError(f"{path} is damaged: its manifest cannot be read ({type(e).__name__}: {e})") from e
    _check_manifest(manifest, path)
    dec = Decoder(tensors)
    graph_module = decode_graph_module(dec, manifest["graph"], trust, where=f"{path}: graph")
    if not trust:
        check_model(graph_module, GraphLimits(tensors).elements)
    inputs = dec.decode(manifest["inputs"], f"{path}: inputs")
    options = dec.decode(manifest["options"], f"{path}: options")
    if not isinstance(inputs, InputSpec) or not isinstance(options, CompileOptions):
        raise ModelFileError(f"{path}: inputs and options must be tncompile's records")
    program = Program(graph_module, inputs, manifest["original_params"], options)
    program.notes = dict(manifest["notes"])
    history = dec.decode(manifest["history"], f"{path}: history")
    if not (isinstance(history, list) and all(isinstance(r, PassRecord) for r in history)):
        raise ModelFileError(f"{path}: history must be a list of pass records")
    program.history = history
    program.compiled_ratio = manifest.get("compiled_ratio")
    training_state = dec.decode(manifest["training"], f"{path}: training state")
    if training_state is not None and not isinstance(training_state, dict):
        raise ModelFileError(f"{path}: the training state must be a dict")
    if "swap" in manifest:
        compiled = attach_swap(program, manifest["swap"], dec, model, path)
    elif model is not None:
        raise ModelMismatchError(f"{path} holds a graph-mode model (a CompiledModel); load it without model=")
    else:
        compiled = CompiledModel(program)
    compiled.training_state = training_state
    return compiled


_OPTIONAL_TYPES = {"swap": dict}
_MANIFEST_TYPES = {"graph": dict, "inputs": dict, "original_params": int, "options": dict, "notes": dict,
                   "history": list, "training": (dict, type(None)), "compiled_ratio": (float, int, type(None))}


def _check_manifest(manifest: Any, path: Path) -> None:
    if not isinstance(manifest, dict):
        raise ModelFileError(f"{path}: the manifest is not a JSON object")
    for key, kind in _MANIFEST_TYPES.items():
        if key not in manifest:
            raise ModelFileError(f"{path}: the manifest has no {key!r}")
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise ModelFileError(f"{path}: the manifest's {key!r} is a {type(manifest[key]).__name__}")
    for key, kind in _OPTIONAL_TYPES.items():
        if key in manifest and not isinstance(manifest[key], kind):
            raise ModelFileError(f"{path}: the manifest's {key!r} is a {type(manifest[key]).__name__}")
    if manifest["original_params"] < 0:
        raise ModelFileError(f"{path}: the manifest's 'original_params' is negative")
    notes = manifest["notes"]
    if not all(isinstance(k, str) and isinstance(v, (str, int, float, bool, type(None), list))
               for k, v in notes.items()):
        raise ModelFileError(f"{path}: the manifest's notes hold something other than plain values")


def _file_kind(data: bytearray, path: Path) -> str:
    """``"safetensors"`` (format 2) or ``"pickle"`` (format 1: torch.save's zip archive or a raw pickle)."""
    head = bytes(data[:9])
    if len(head) == 9 and head[8:9] == b"{":  # an 8-byte header length, then the JSON header
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        return "pickle"
    raise ModelFileError(f"{path} is not a tncompile file (save it with tncompile.save)")


def _load_v1(path: Path, map_location) -> CompiledModel:
    payload = legacy.load_v1(path, map_location)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a tncompile file (save it with tncompile.save)")
    program = Program(legacy.decode_graph_module(payload["graph"]), payload["inputs"],
                      payload["original_params"], payload["options"])
    program.notes = dict(payload["notes"])
    # records from format 1 predate fields this version has: rebuild them with the defaults
    program.history = [PassRecord(r.name, r.seconds, r.params, r.ratio, dict(getattr(r, "matches", {})))
                       for r in payload["history"]]
    program.compiled_ratio = payload.get("compiled_ratio", program.history[-1].ratio if program.history else None)
    # format-1 plans lack fields this version's executor and printers use: plan every bucket afresh
    Pipeline([Replan(force=True)]).run(program, progress=False)
    compiled = CompiledModel(program)
    compiled.training_state = payload.get("training")
    return compiled


def resume(compiled: CompiledModel, optimizer: torch.optim.Optimizer | None = None, controller=None, *,
           restore_rng: bool = True) -> dict[str, Any]:
    """Restore the training state a checkpoint carried into a loaded model's
    new optimizer and controller; returns the checkpoint's ``extra`` dict.

    Build ``optimizer`` from the loaded model exactly as in the first run
    (same parameter groups, e.g. ``param_groups(compiled, ...)``); the saved
    state is matched by parameter name and a mismatch is an error.

    Example
    -------
    >>> compiled = tncompile.load("ckpt.pt")
    >>> opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3))
    >>> ctl = tncompile.RankController(compiled, opt, target_ratio=0.01)
    >>> extra = tncompile.resume(compiled, opt, ctl)
    """
    if not isinstance(compiled, CompiledModel) and not is_swapped(compiled):
        raise TypeError(f"tncompile.resume expects the CompiledModel tncompile.load returned, got "
                        f"{type(compiled).__name__}")
    state = getattr(compiled, "training_state", None)
    if state is None:
        raise ValueError("this model carries no training state: load it with tncompile.load from a file "
                         "written by tncompile.save(..., optimizer=..., controller=...)")
    if optimizer is not None:
        if "optimizer" not in state:
            raise ValueError("the checkpoint has no optimizer state (save with optimizer=...)")
        if state["optimizer_class"] != type(optimizer).__name__:
            raise ValueError(f"the checkpoint's optimizer is {state['optimizer_class']}, "
                             f"got {type(optimizer).__name__}")
        names = _param_names(compiled, optimizer)
        if names != state["optimizer_names"]:
            raise ValueError("the optimizer's parameter groups differ from the saved one's; build it "
                             "the same way (same groups, same order) from the loaded model")
        optimizer.load_state_dict(state["optimizer"])
    if controller is not None:
        if "controller" not in state:
            raise ValueError("the checkpoint has no controller state (save with controller=...)")
        controller.load_state_dict(state["controller"])
    if restore_rng and state.get("rng") is not None:
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        per_rank = (state.get("extra") or {}).get("rng_per_rank")
        if per_rank and torch.distributed.is_available() and torch.distributed.is_initialized():
            _restore_rank_stream(per_rank)
    compiled.training_state = None
    return dict(state.get("extra") or {})
