"""Model files: safetensors tensors and a manifest of data (:mod:`.model_file`);
``save_pretrained`` folders (:mod:`.pretrained_folder`); ``load`` of either (:mod:`.loading`)."""
from ..errors import ModelFileError, ModelMismatchError
from .loading import load
from .model_file import FORMAT, VERSION, save
from .pretrained_folder import save_folder

__all__ = ["save", "load", "save_folder", "FORMAT", "VERSION", "ModelFileError", "ModelMismatchError"]
