"""Model files: safetensors tensors and a manifest of data (:mod:`.model_file`); ``load``
(:mod:`.loading`; ``save_pretrained`` folders: :mod:`tncompile.integrations.hf_folder`)."""
from ..errors import ModelFileError, ModelMismatchError
from .loading import load
from .model_file import FORMAT, VERSION, save

__all__ = ["save", "load", "FORMAT", "VERSION", "ModelFileError", "ModelMismatchError"]
