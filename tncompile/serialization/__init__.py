"""Model files: safetensors tensors and a manifest of data (:mod:`.model_file`); ``load``
(:mod:`.loading`; ``save_pretrained`` folders: :mod:`tncompile.integrations.hf_folder`);
a checkpoint's training state and ``resume`` (:mod:`.checkpoint`)."""
from ..errors import ModelFileError, ModelMismatchError
from .checkpoint import resume
from .loading import load
from .model_file import FORMAT, VERSION, save

__all__ = ["save", "load", "resume", "FORMAT", "VERSION", "ModelFileError", "ModelMismatchError"]
