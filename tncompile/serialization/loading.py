"""``tncompile.load``: a file :func:`~.model_file.save` wrote, or a folder a compressed
model's ``save_pretrained`` wrote, rebuilt onto the user's dense model."""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import ModelFileError
from ..passes import Pass, Pipeline
from .caller_state import caller_state_kept
from .model_file import _file_path, dense_model, read_model_file, rebuild_saved

__all__ = ["load", "register_folder_loader"]

# tncompile.integrations.hf_folder registers how a folder is loaded (the HF format lives
# above this package): load(path, model, ...), raising ModelFileError for a folder that is
# not one a compressed model's save_pretrained wrote
_FOLDER_LOADER: Callable[..., nn.Module] | None = None


def register_folder_loader(load_folder: Callable[..., nn.Module]) -> None:
    """Set how :func:`load` reads a folder (one a compressed model's ``save_pretrained`` wrote)."""
    global _FOLDER_LOADER
    _FOLDER_LOADER = load_folder


def load(path: str | os.PathLike, model: nn.Module | Callable[[], nn.Module] | type | None = None, *,
         passes: Pipeline | Sequence[Pass | str] | None = None, example_inputs: Any = None,
         map_location=None) -> nn.Module:
    """Rebuild the compressed model saved at ``path`` from your dense model.

    Parameters
    ----------
    model : nn.Module, or a callable returning one
        The dense model the file was saved from: same class and configuration, any
        weights (a fresh instance). It becomes the loaded model: in swap mode its layers
        are replaced in place; in graph mode the compiled graph uses its modules. A
        zero-argument callable (``lambda: MyModel(cfg)``) builds it. For a folder a
        compressed model's ``save_pretrained`` wrote, an HF class will do: it is built
        from the folder's ``config.json`` (data fields only).
    passes : Pipeline or list of pass names / Pass objects, optional
        The ``passes=`` you gave ``compile`` (``None``: the default pipeline). The file's
        recorded pass names must be exactly its names in its order: the file confirms
        where your passes run, it never decides it.
    example_inputs : optional
        Inputs to trace with, when the file holds none (the compile's were not plain
        tensors and values).
    map_location : device or str, optional
        Move the model there after loading.

    Raises
    ------
    ModelFileError
        Anything about the file: not a tncompile file, another format version, damaged,
        a field out of type or bounds, tensors that disagree with its layer table.
    ModelMismatchError
        The model given is not the one the file was saved from (a ``ModelFileError``).
    """
    path = _file_path(path, "load")
    if map_location is not None:
        try:
            torch.device(map_location)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"tncompile.load: map_location={map_location!r} is not a device "
                             "(e.g. 'cpu', 'cuda', 'cuda:1' or a torch.device)") from e
    with caller_state_kept():  # building, tracing and planning leave no trace in the caller's state
        if path.is_dir():
            if _FOLDER_LOADER is None:
                raise ModelFileError(f"tncompile.load: {str(path)!r} is a directory; give the file tncompile.save "
                                     "wrote")
            loaded = _FOLDER_LOADER(path, model, passes=passes, example_inputs=example_inputs)
        elif not path.exists():
            if os.path.lexists(path):   # a link to nothing, or a loop of links
                raise ModelFileError(f"tncompile.load: {str(path)!r} is a link that leads to no file (a dangling "
                                     "link or a loop of links); give the path of the file itself")
            raise FileNotFoundError(f"tncompile.load: no file {str(path)!r}")
        else:
            with read_model_file(path) as saved:
                if model is None:
                    saved.verify()  # a damaged file says so first
                    raise ModelFileError(f"tncompile.load({str(path)!r}): a model file holds tensors and a table of "
                                         f"its compressed layers, not the program: pass the dense model it was saved "
                                         f"from (a {saved.model_class}), e.g. tncompile.load(path, "
                                         f"model={saved.model_class}(...)) or model=lambda: ... that builds it")
                loaded = rebuild_saved(saved, dense_model(model, path, saved.model_class), passes, example_inputs)
    if map_location is not None:
        loaded.to(map_location)
    return loaded
