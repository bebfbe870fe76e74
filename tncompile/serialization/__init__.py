"""Model files: safetensors tensors and a manifest of data (:mod:`.model_file`);
``save_pretrained`` folders (:mod:`.pretrained_folder`); ``load`` of either (:mod:`.loading`)."""
from ..errors import ModelFileError, ModelMismatchError
from ..swap.swapped import register_folder_writer
from .loading import load
from .model_file import FORMAT, VERSION, save
from .pretrained_folder import save_folder

__all__ = ["save", "load", "FORMAT", "VERSION", "ModelFileError", "ModelMismatchError"]


def _save_pretrained(model, directory, **kwargs) -> None:
    save_folder(model, directory, save, **kwargs)


register_folder_writer(_save_pretrained)
