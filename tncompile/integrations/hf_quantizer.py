"""transformers' quantization backend for tncompile: ``from_pretrained`` of a compressed folder.

A compressed model's ``save_pretrained`` folder declares ``quantization_config:
{"quant_method": "tncompile", ...}`` in its ``config.json``, as bitsandbytes, torchao or
GPTQ folders declare theirs (:mod:`tncompile.integrations.hf_folder`). This
module registers :class:`TNCompileConfig` and :class:`TNCompileQuantizer` under that name,
so ``AutoModel*.from_pretrained(folder)``, pipelines and ``SentenceTransformer(folder)``
load the compressed model as the class they build, no ``trust_remote_code`` involved.

What the quantizer does inside ``from_pretrained``:

1. before any weight loads (the model still on the meta device): reads ``model.safetensors``
   and checks it against the manifest (checksum, every table field typed and bounded,
   layouts against the tensors), rebuilds the structure as ``tncompile.load`` does -- the
   class's own model traced on meta copies of the saved inputs, the recorded pipeline run
   with the table's decisions -- and checks that every tensor the file holds has a place
   in it of exactly its shape, and every place a tensor (nothing left to random init);
2. after transformers loaded the weights: checks the state again (names, shapes, which
   names share a tensor) and copies the file's tensors in once more, through
   ``load_state_dict``, so the state is the file's exactly whatever transformers did (cast
   to ``dtype=`` if given).

Given to ``from_pretrained`` of a *dense* folder, ``TNCompileConfig(target_ratio=...)``
compresses the loaded model instead (``tncompile.compile`` in swap mode, in place).

``import tncompile`` has this module imported right after transformers imports its
quantizer registry (:mod:`tncompile.integrations.plugins`); it imports only
that registry's modules at its top.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..api import compile
from ..errors import ModelFileError
from ..runtime import TNModule
from ..serialization.caller_state import caller_state_kept
from ..serialization.model_file import EXAMPLE, checked_state, load_checked_state, rebuild_saved
from .hf_folder import QUANT_METHOD, WEIGHTS, check_folder_manifest, check_structure, read_weights

__all__ = ["TNCompileConfig", "TNCompileQuantizer", "COMPILE_FIELDS"]


#: what ``from_pretrained(dense_folder, quantization_config=TNCompileConfig(...))`` may set
COMPILE_FIELDS = ("target_ratio", "prefer", "init", "linear_cores", "embedding_cores", "target_modules",
                  "exclude_modules")


@register_quantization_config(QUANT_METHOD)
class TNCompileConfig(QuantizationConfigMixin):
    """``quantization_config`` ``"tncompile"``: data only.

    In a compressed folder's ``config.json`` it is the manifest ``save_pretrained`` wrote
    (layer table, compile settings, pass names): ``from_pretrained`` rebuilds that model.
    Given to ``from_pretrained`` of a *dense* folder --
    ``TNCompileConfig(target_ratio=0.3)``, with any of :data:`COMPILE_FIELDS` -- it
    compresses the loaded model as ``tncompile.compile(model, ..., mode="swap")`` would,
    traced on the class's ``dummy_inputs``.
    """

    def __init__(self, **fields: Any):
        fields.pop("quant_method", None)
        self.quant_method = QUANT_METHOD
        self.manifest = fields if "format" in fields else None
        self.compile_request = None if "format" in fields else fields
        if self.compile_request is not None:
            unknown = sorted(set(fields) - set(COMPILE_FIELDS))
            if unknown or "target_ratio" not in fields:
                raise ValueError(f"TNCompileConfig: give target_ratio and any of {list(COMPILE_FIELDS[1:])} to "
                                 f"compress a dense model in from_pretrained; got {sorted(fields)}")

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """What transformers builds from a folder's ``config.json``: only a saved model's
        manifest (a file never asks to compress; anything else is a ``ModelFileError``)."""
        if not isinstance(config_dict, dict) or "format" not in config_dict:
            raise ModelFileError(f"config.json: quantization_config {{'quant_method': 'tncompile', ...}} is not the "
                                 f"manifest a compressed model's save_pretrained writes (keys "
                                 f"{sorted(map(str, config_dict))[:8] if isinstance(config_dict, dict) else '-'}): "
                                 "save_pretrained the compressed model again")
        config = cls(**config_dict)
        return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, **copy.deepcopy(self.manifest or self.compile_request)}

    def __iter__(self):
        yield from self.to_dict().items()


@register_quantizer(QUANT_METHOD)
class TNCompileQuantizer(HfQuantizer):
    """Loads a compressed folder in ``from_pretrained``, or compresses a dense one when asked
    (see the module doc and :class:`TNCompileConfig`)."""

    requires_calibration = False  # a dense folder is compressed after loading when a config asks

    def __init__(self, quantization_config: TNCompileConfig, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)
        self._saved = None

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        if self.pre_quantized:
            check_folder_manifest(self.quantization_config.manifest, "config.json: quantization_config")
        elif self.quantization_config.compile_request is None:
            raise ModelFileError("from_pretrained(quantization_config=TNCompileConfig(...)) of a dense folder: "
                                 "give compile settings (target_ratio=...), not a saved model's manifest")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs: Any):
        if not self.pre_quantized:
            return model  # a dense folder: loaded as it is, compressed afterwards
        files = [Path(f) for f in (checkpoint_files or [])]
        if len(files) != 1 or files[0].name != WEIGHTS:
            raise ModelFileError(f"from_pretrained of a tncompile folder: expected its one {WEIGHTS}, got "
                                 f"{[f.name for f in files]}")
        saved = read_weights(files[0], self.quantization_config.manifest, files[0].parent)
        try:
            check_structure(model.config.to_dict(), saved.structure, str(files[0].parent / "config.json"))
            if saved.example_inputs is None:
                raise ModelFileError(f"{files[0].parent}: the folder holds no example inputs to trace the model with; "
                                     f"load it with tncompile.load(folder, model={saved.model_class}, "
                                     "example_inputs=...)")
            args, kwargs_ = saved.example_inputs
            on_meta = {k: _meta(v) for k, v in kwargs_.items()} if kwargs_ else tuple(_meta(a) for a in args)
            with caller_state_kept():
                _tie(model)
                compiled = rebuild_saved(saved, model, None, on_meta, load_tensors=False)
            if compiled is not model:
                raise ModelFileError(f"{files[0].parent}: not a swap-mode model")
            compiled.program.example_inputs = saved.example_inputs  # the file's, not the meta copies
            checked_state(model, saved, str(files[0].parent), cast=True)  # before any weight is read into it
            saved.verify()
        except BaseException:
            saved.close()
            raise
        _forget_swapped_ties(model)
        _tolerate_swapped_children(model)
        # the traced inputs beside the weights are the manifest's, not a weight transformers missed
        model._keys_to_ignore_on_load_unexpected = {*(model._keys_to_ignore_on_load_unexpected or ()),
                                                    rf"^{EXAMPLE}\."}
        # a name sharing another's tensor is stored once (a tied head's embedding): not missing
        model._keys_to_ignore_on_load_missing = {*(model._keys_to_ignore_on_load_missing or ()),
                                                 *(rf"^{re.escape(name)}$" for name in saved.aliases)}
        self._saved = saved
        return model

    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        if not self.pre_quantized:
            example = {k: v.to(model.device) for k, v in model.dummy_inputs.items()}
            return compile(model, example_inputs=example, mode="swap", inplace=True,
                           **self.quantization_config.compile_request)
        saved, self._saved = self._saved, None
        with saved:
            for m in model.modules():
                m.__dict__.pop("_init_weights", None)
            left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
            if left:
                raise ModelFileError(f"{saved.path}: from_pretrained left {left[:3]} unmade (the model class's "
                                     f"_init_weights did not reach them); load it with tncompile.load(folder, "
                                     f"model={saved.model_class})")
            load_checked_state(model, saved, str(saved.path), cast=True)
        model.train(False)
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True  # a swapped model's save_pretrained writes the folder again

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True  # rank-adaptive training continues on the loaded model


def _meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _tie(model: torch.nn.Module) -> None:
    """Share the weights the model's class ties (``all_tied_weights_keys``: target -> source),
    as ``__init__`` would: inside ``from_pretrained`` tying waits until after loading, but the
    layer table's tied head must find its embedding's weight now."""
    for target, source in dict(getattr(model, "all_tied_weights_keys", None) or {}).items():
        parent, _, name = target.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, model.get_parameter(source))


def _forget_swapped_ties(model: torch.nn.Module) -> None:
    """Drop the class's ties whose weights the swap replaced (a TT tied head shares its
    embedding's network itself); transformers would re-tie them after loading."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied:
        names = dict(model.named_parameters(remove_duplicate=False))
        model.all_tied_weights_keys = {t: s for t, s in tied.items() if t in names and s in names}


def _tolerate_swapped_children(model: torch.nn.Module) -> None:
    """Let transformers' weight init pass the modules that hold a compressed layer: their
    ``_init_weights`` reaches for a dense child's ``weight`` (GPT-2 rescales ``c_proj.weight``),
    which the file's tensors replace anyway; any other error, or a tensor left unmade
    (checked after loading), still surfaces."""
    from transformers import PreTrainedModel  # here: this module is imported inside transformers' own import
    for sub in model.modules():
        original = getattr(sub, "_init_weights", None)
        if isinstance(sub, PreTrainedModel) and original is not None:
            sub._init_weights = _tolerant(original)


def _tolerant(init_weights):
    def init_unless_compressed_child(module: torch.nn.Module) -> None:
        try:
            init_weights(module)
        except (AttributeError, TypeError):
            if not any(isinstance(child, TNModule) for child in module.children()):
                raise
    return init_unless_compressed_child
