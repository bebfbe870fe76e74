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
``config.json``; or a fresh instance) rebuilds the compressed model.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from torch import nn

__all__ = ["FOLDER_FILE", "HF_WEIGHT_FILES", "save_folder", "model_for_folder", "is_model_folder"]

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


def model_for_folder(folder: Path, model: Any) -> nn.Module:
    """The dense model to load ``folder``'s file onto: ``model`` itself, or a class
    built from the folder's ``config.json`` (``cls(cls.config_class.from_pretrained(folder))``)."""
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, type) and issubclass(model, nn.Module):
        config_class = getattr(model, "config_class", None)
        if config_class is None or not hasattr(config_class, "from_pretrained"):
            raise TypeError(f"tncompile.load({str(folder)!r}, model={model.__name__}): {model.__name__} has no "
                            "config_class to build it from the folder's config.json; pass a fresh instance "
                            "instead (model=YourModel(...))")
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"tncompile.load: {str(folder)!r} has no config.json to build "
                                    f"{model.__name__} from; pass a fresh instance (model=...)")
        config = config_class.from_pretrained(folder)
        if hasattr(config, "tncompile"):
            del config.tncompile
        return model(config)
    raise TypeError(f"tncompile.load({str(folder)!r}): a folder written by save_pretrained of a compressed model "
                    "loads onto its model class or a fresh instance: model=BertModel or model=BertModel(config); "
                    f"got {type(model).__name__}")
