"""``save_pretrained`` of a swap-mode model: a folder that reloads exactly, or not at all.

HF's own ``save_pretrained`` would write the TT cores under names no dense model
has, and ``from_pretrained`` on that folder builds the dense model with every
compressed weight missing -- random weights and a warning at most. A swapped
model's ``save_pretrained(folder)`` therefore writes:

* ``config.json`` (and ``generation_config.json`` when the model has one), with a
  ``"tncompile"`` entry that says how to load the folder;
* :data:`FOLDER_FILE`, the model as :func:`tncompile.save` writes it (layouts,
  ranks, cores, the rest of the state);
* no ``model.safetensors`` / ``pytorch_model.bin``: plain ``from_pretrained`` on the
  folder fails with "no file named model.safetensors" instead of loading wrong
  weights. A folder that already holds such a file is refused (HF would load it).

``tncompile.load(folder, model=BertModel)`` (a class: built from the folder's
``config.json``, data fields only; or a fresh instance) rebuilds the compressed model.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ModelFileError, ModelMismatchError
from ..ir.program import count_params
from ..swap.swapped import register_folder_writer
from .model_file import dense_model, read_model_file, rebuild_saved, save

__all__ = ["FOLDER_FILE", "HF_WEIGHT_FILES", "save_folder", "load_folder", "model_from_config", "is_model_folder"]

FOLDER_FILE = "tncompile-model.tnc"
# what transformers' from_pretrained reads weights from (a folder holding any of them would load it)
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
# keywords of transformers' PreTrainedModel.save_pretrained this writer honours or may ignore
_IGNORED = {"state_dict", "save_function", "max_shard_size", "safe_serialization", "variant", "token",
            "save_peft_format", "save_original_format"}


def is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / FOLDER_FILE).is_file()


def save_folder(model: nn.Module, directory: str | os.PathLike, save: Callable[..., None], *,
                is_main_process: bool = True, push_to_hub: bool = False, **kwargs: Any) -> None:
    """Write the folder (see the module doc) with ``save`` (:func:`tncompile.save`)."""
    unknown = sorted(set(kwargs) - _IGNORED)
    if unknown:
        raise TypeError(f"save_pretrained of a tncompile swap-mode model: unexpected keyword(s) {unknown}")
    if push_to_hub:
        raise NotImplementedError("save_pretrained(push_to_hub=True) of a compressed model: save the folder, "
                                  "then upload it with huggingface_hub.upload_folder")
    if not is_main_process:
        return
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"save_pretrained: {str(folder)!r} is a file; give a folder")
    stale = [name for name in HF_WEIGHT_FILES if (folder / name).exists()]
    if stale:
        raise FileExistsError(f"save_pretrained: {str(folder)!r} already holds {stale[0]} (a dense save?); "
                              "transformers' from_pretrained would load it instead of the compressed model. "
                              "Save into an empty folder, or remove it.")
    folder.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        marked = config.__class__.from_dict(config.to_dict())
        marked.tncompile = {"file": FOLDER_FILE,
                            "load_with": f"tncompile.load(folder, model={type(model).__name__})",
                            "note": "a tncompile compressed model; transformers' from_pretrained cannot load it"}
        marked.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(folder)
    save(model, folder / FOLDER_FILE)


def load_folder(folder: Path, model: Any, *, passes=None, example_inputs=None) -> nn.Module:
    """:func:`tncompile.load` of a folder: its file rebuilt onto ``model`` -- a fresh instance,
    a callable building one, or a class built from the folder's ``config.json``
    (:func:`model_from_config`)."""
    saved = read_model_file(folder / FOLDER_FILE)
    if model is None:
        raise ModelFileError(f"tncompile.load: {str(folder)!r} was written by save_pretrained of a compressed "
                             f"{saved.model_class}; pass its model class (model={saved.model_class}: built from the "
                             "folder's config.json) or a fresh instance to load it onto")
    if isinstance(model, type) and issubclass(model, nn.Module):
        dense = model_from_config(folder, model, saved)
    else:
        dense = dense_model(model, folder)
    return rebuild_saved(saved, dense, passes, example_inputs)


#: config entries that name code, not data: never honoured from a file
CODE_KEYS = ("auto_map", "custom_pipelines", "trust_remote_code", "quantization_config", "tncompile")
ATTENTION_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")
#: attention implementations a file may ask for: PyTorch's own
ATTENTION = (None, "eager", "sdpa")
MAX_CONFIG_BYTES = 1 << 20
#: a folder's config may build a dense model at most this many times the file's bytes (a
#: model compressed 200x; CoMERA's are 80-99x) or DENSE_FLOOR_BYTES, whichever is larger
DENSE_PER_FILE_BYTE = 200
DENSE_FLOOR_BYTES = 512 << 20


def model_from_config(folder: Path, cls: type, saved) -> nn.Module:
    """``cls(config)`` from the folder's ``config.json``, data fields only: entries that name
    code (``auto_map``, remote code, a quantizer) are dropped, an attention implementation
    other than PyTorch's own is refused, and the model is first built on the meta device
    (nothing allocated): its parameter count must be the saved model's, and its size within
    :data:`DENSE_PER_FILE_BYTE` times the file's."""
    where = f"{folder / 'config.json'}"
    config_class = getattr(cls, "config_class", None)
    if config_class is None or not hasattr(config_class, "from_dict"):
        raise TypeError(f"tncompile.load({str(folder)!r}, model={cls.__name__}): {cls.__name__} has no config_class "
                        "to build it from the folder's config.json; pass a fresh instance instead (model=YourModel(...))")
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFileError(f"tncompile.load: {str(folder)!r} has no config.json to build {cls.__name__} from; pass "
                             "a fresh instance (model=...)")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelFileError(f"{where}: larger than {MAX_CONFIG_BYTES:,} bytes")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{where}: not JSON ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict):
        raise ModelFileError(f"{where}: not a JSON object")
    for key in CODE_KEYS:
        data.pop(key, None)
    for key in ATTENTION_KEYS:
        if key in data and data[key] not in ATTENTION:
            raise ModelFileError(f"{where}: {key}={data[key]!r:.80} is not PyTorch's own attention "
                                 f"({[a for a in ATTENTION if a]}); a file may not choose other code to run")
    try:
        config = config_class.from_dict(data)
        with torch.device("meta"):
            shape_only = cls(config)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, OverflowError) as e:
        raise ModelFileError(f"{where}: does not build a {cls.__name__} ({type(e).__name__}: {e})") from e
    params = count_params(shape_only)
    nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in shape_only.state_dict().values()}.values())
    del shape_only
    if params != saved.original_params:
        raise ModelMismatchError(f"{where}: builds a {cls.__name__} of {params:,} parameters; the saved model had "
                                 f"{saved.original_params:,}")
    limit = max(DENSE_FLOOR_BYTES, DENSE_PER_FILE_BYTE * sum(t.numel() * t.element_size()
                                                              for t in saved.tensors.values()))
    if nbytes > limit:
        raise ModelFileError(f"{where}: builds a dense {cls.__name__} of {nbytes:,} bytes, more than {limit:,} for "
                             "this file; build it yourself and pass the instance (model=...) if you trust it")
    return cls(config)


def _save_pretrained(model: nn.Module, directory: str | os.PathLike, **kwargs: Any) -> None:
    save_folder(model, directory, save, **kwargs)


# swap mode sits beside this package and cannot import it: a swapped model's
# save_pretrained asks the writer registered here (the dependency inverted, as the
# runtime asks the planner tncompile.planning registers)
register_folder_writer(_save_pretrained)
