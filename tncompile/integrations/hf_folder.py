"""``save_pretrained`` of a swap-mode model: a folder in Hugging Face's own layout.

A swapped model's ``save_pretrained(folder)`` writes what every tool of the ecosystem reads:

* ``model.safetensors``: the compressed model's ``state_dict`` under its own names (a
  compressed layer's ``cores.<k>`` and ``gates.<k>`` where its dense ``weight`` was; a
  tensor two names share is stored once), the inputs it was traced with
  (``tncompile/example.<n>``), and a checksum over both and the table below;
* ``config.json``: the model's config with a ``quantization_config`` -- ``quant_method:
  "tncompile"`` plus the manifest :func:`tncompile.save` writes (layer table, compile
  settings, pass names, state names): data only, as transformers' quantization backends
  declare theirs;
* ``generation_config.json`` when the model has one.

``AutoModel*.from_pretrained(folder)``, pipelines and ``SentenceTransformer(folder)`` load
it through tncompile's ``HfQuantizer`` (:mod:`tncompile.integrations.hf_quantizer`,
registered by ``import tncompile``); ``tncompile.load(folder, model=TheClass)`` loads it
without transformers' loader: the class is built from the config's data fields only
(:func:`model_from_config`). Both rebuild the structure from the class and the table and
check every tensor against it before loading (:func:`read_folder`).

The format is Hugging Face's, so it lives with the integrations; it reuses the model file's
manifest and container (:mod:`tncompile.serialization`), which knows nothing of HF. Imported
by ``import tncompile``: it registers the writer ``save_pretrained`` calls and the folder
reader ``tncompile.load`` calls.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelFileError, ModelMismatchError
from ..files import read_bounded, write_replacing
from ..ir.program import count_params
from .hf_config import marked as dtype_marked, restored as dtype_restored
from ..swap.swapped import register_folder_writer
from ..serialization.container import digest, encode_container, write_atomically
from ..serialization.tensor_file import MAX_HEADER_BYTES, open_tensor_file
from ..serialization.loading import register_folder_loader
from ..serialization.model_file import SavedModel, check_manifest_header, dense_model, manifest_of, rebuild_saved

__all__ = ["WEIGHTS", "QUANT_METHOD", "save_folder", "read_folder", "read_weights", "check_folder_manifest",
           "load_folder", "model_from_config", "is_model_folder"]

WEIGHTS = "model.safetensors"
QUANT_METHOD = "tncompile"
#: weight files transformers would read before (or beside) ours: a folder holding one is refused
OTHER_WEIGHTS = ("model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: tncompile's first folder format: one model file beside a config marked "tncompile"
OLD_FILE = "tncompile-model.tnc"
# keywords of transformers' PreTrainedModel.save_pretrained this writer honours or may ignore
_IGNORED = {"state_dict", "save_function", "max_shard_size", "safe_serialization", "variant", "token",
            "save_peft_format", "save_original_format"}
#: config entries that name code, not data: never honoured from a file by tncompile.load
CODE_KEYS = ("auto_map", "custom_pipelines", "trust_remote_code", "quantization_config", "tncompile")
ATTENTION_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")
#: attention implementations a file may ask for: PyTorch's own
ATTENTION = (None, "eager", "sdpa")
MAX_CONFIG_BYTES = MAX_HEADER_BYTES  # as a model file's header: a 1B-parameter model's table is under 1 MiB
#: a folder's config may build a dense model at most this many times the file's bytes (a
#: model compressed 200x; CoMERA's are 80-99x) or DENSE_FLOOR_BYTES, whichever is larger
DENSE_PER_FILE_BYTE = 200
DENSE_FLOOR_BYTES = 512 << 20


def canonical(manifest: dict) -> str:
    """The manifest as the checksum covers it (independent of how config.json was formatted)."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"))


#: ``model.safetensors``' metadata entry recording the config fields that decide the model's
#: structure and size (:func:`structure_text`), covered by the checksum with the manifest
STRUCTURE_KEY = "tncompile_structure"
MAX_STRUCTURE_BYTES = 64 << 10


def structure_fields(config: dict) -> dict[str, int]:
    """The config's top-level integer fields but token ids: layer counts, widths, heads,
    vocabulary and position sizes -- what decides the model's structure and size."""
    return {k: v for k, v in config.items() if isinstance(k, str) and type(v) is int
            and not k.endswith(("token_id", "token_ids"))}


def structure_text(config: dict) -> str:
    return json.dumps(structure_fields(config), sort_keys=True, separators=(",", ":"))


def sealed(manifest: dict, structure: str | None) -> str:
    """What the checksum covers besides the tensors: the manifest and the recorded structure."""
    return canonical(manifest) if structure is None else canonical(manifest) + "\n" + structure


def check_structure(config: dict, recorded: dict[str, int] | None, where: str) -> None:
    """``config`` (the folder's config as its class resolves it, defaults included) builds the
    model the weights were saved from: every recorded field it has holds its recorded value
    (checked before anything is built; other fields -- ``use_cache``, token ids, a newer
    transformers' additions -- may differ)."""
    for key, value in (recorded or {}).items():
        if key in config and config[key] != value:
            raise ModelMismatchError(f"{where}: {key}={config[key]!r:.40} in config.json, {value} in the model saved "
                                     "beside it: config.json was edited or belongs to another model; restore it "
                                     "(nothing was built)")


def is_model_folder(path: Path) -> bool:
    """Whether ``path`` is a folder a compressed model's ``save_pretrained`` wrote."""
    if path.is_dir() and (path / OLD_FILE).is_file():
        return True  # read_folder says how to load it
    if not (path.is_dir() and (path / "config.json").is_file()):
        return False
    try:
        config = _config_data(path)
    except ModelFileError:
        return False
    return isinstance(config.get("quantization_config"), dict) \
        and config["quantization_config"].get("quant_method") == QUANT_METHOD


# ----------------------------------------------------------------- writing
def save_folder(model: nn.Module, directory: str | os.PathLike, *, is_main_process: bool = True,
                push_to_hub: bool = False, **kwargs: Any) -> None:
    """Write the folder (see the module doc)."""
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
    stale = [name for name in OTHER_WEIGHTS if (folder / name).exists()]
    if stale:
        raise FileExistsError(f"save_pretrained: {str(folder)!r} already holds {stale[0]} (a dense save?), which "
                              "transformers would read instead of the compressed model. Save into an empty folder, "
                              "or remove it.")
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    manifest = manifest_of(model, tensors)
    config = getattr(model, "config", None)
    structure = structure_text(config.to_dict()) if hasattr(config, "to_dict") else None
    metadata = {"format": "pt", "tncompile_sha256": digest(tensors, sealed(manifest, structure))}
    if structure is not None:
        metadata[STRUCTURE_KEY] = structure
    header, body = encode_container(tensors, metadata)
    write_atomically(folder / WEIGHTS, header, body)
    if config is not None and hasattr(config, "save_pretrained"):
        marked = config.__class__.from_dict(config.to_dict())
        marked.quantization_config = {"quant_method": QUANT_METHOD, **manifest}
        written = json.loads(_written_by(marked, "config.json"))
        write_replacing(folder / "config.json", json.dumps(dtype_marked(written), indent=2, sort_keys=True) + "\n",
                         mode=None)
    else:  # not an HF model: the config holds the manifest alone
        write_replacing(folder / "config.json", json.dumps({"quantization_config": {"quant_method": QUANT_METHOD,
                                                                                     **manifest}}), mode=None)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        write_replacing(folder / "generation_config.json", _written_by(generation, "generation_config.json"),
                         mode=None)


def _written_by(config: Any, name: str) -> bytes:
    """The file ``config.save_pretrained`` writes, made in a fresh private folder of its own
    (transformers opens its target plainly, following any link planted there): tncompile then
    writes it into the user's folder atomically, replacing whatever is at that path."""
    with tempfile.TemporaryDirectory(prefix="tncompile-config-") as scratch:
        config.save_pretrained(scratch)
        return read_bounded(Path(scratch) / name, MAX_CONFIG_BYTES)


# ----------------------------------------------------------------- reading
def _config_data(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        raw = read_bounded(path, MAX_CONFIG_BYTES, follow_links=True)
    except FileNotFoundError:
        raise ModelFileError(f"{folder} is a directory without a config.json: give the file tncompile.save wrote, "
                             "or a folder a compressed model's save_pretrained wrote") from None
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read ({e.strerror or e})") from e
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not JSON ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: not a JSON object")
    return dtype_restored(data)


def check_folder_manifest(manifest: Any, where: str) -> None:
    """A folder's manifest: this format and version, a swap-mode model, no training state."""
    check_manifest_header(manifest, where)
    if manifest["mode"] != "swap" or manifest["training"] is not None:
        raise ModelFileError(f"{where}: must describe a swap-mode model without training state")


def read_folder(folder: Path) -> SavedModel:
    """The folder's manifest (``config.json``'s ``quantization_config``) and tensors' specs
    (``model.safetensors``), every field checked, the checksum over both verified."""
    if (folder / OLD_FILE).is_file():
        raise ModelFileError(f"{folder} was written by an earlier tncompile (one {OLD_FILE} file, which "
                             "transformers cannot read); load that file -- tncompile.load(folder / "
                             f"{OLD_FILE!r}, model=...) -- and save_pretrained it again")
    config = _config_data(folder)
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != QUANT_METHOD:
        dense = "model.safetensors" if (folder / WEIGHTS).exists() else next(
            (name for name in OTHER_WEIGHTS if (folder / name).exists()), None)
        raise ModelFileError(f"{folder} holds a dense model ({dense}), not a compressed one: config.json has no "
                             "quantization_config with quant_method 'tncompile'. Compress it: "
                             "tncompile.compile(YourClass.from_pretrained(folder), target_ratio=...)" if dense else
                             f"{folder} is not a folder a compressed model's save_pretrained wrote (its config.json "
                             "has no quantization_config with quant_method 'tncompile')")
    manifest = dict(quantization)
    manifest.pop("quant_method")
    check_folder_manifest(manifest, f"{folder}/config.json: quantization_config")
    return read_weights(folder / WEIGHTS, manifest, folder)


def read_weights(weights: Path, manifest: dict, folder: Path) -> SavedModel:
    """``weights`` (a folder's ``model.safetensors``) opened and checked against ``manifest``
    (its ``quantization_config`` less ``quant_method``, header already checked)."""
    if not weights.exists():
        raise ModelFileError(f"{folder}: no {WEIGHTS}")
    file = open_tensor_file(weights)
    try:
        expected = file.metadata.get("tncompile_sha256")
        if not isinstance(expected, str):
            raise ModelFileError(f"{folder}: {WEIGHTS} is not one a compressed model's save_pretrained wrote (no "
                                 "tncompile checksum): save_pretrained the model again")
        text = file.metadata.get(STRUCTURE_KEY)
        saved = SavedModel(folder, manifest, file, (expected, sealed(manifest, text)))
        saved.structure = None if text is None else _recorded_structure(text, folder)
        return saved
    except BaseException:
        file.close()
        raise


def _recorded_structure(text: str, folder: Path) -> dict[str, int]:
    where = f"{folder / WEIGHTS}: {STRUCTURE_KEY}"
    if len(text) > MAX_STRUCTURE_BYTES:
        raise ModelFileError(f"{where}: larger than {MAX_STRUCTURE_BYTES:,} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ModelFileError(f"{where}: not JSON") from e
    if not isinstance(data, dict) or len(data) > 4096 or not all(
            isinstance(k, str) and len(k) <= 256 and type(v) is int and -2**63 <= v < 2**63 for k, v in data.items()):
        raise ModelFileError(f"{where}: must map config field names to integers")
    return data


def load_folder(folder: Path, model: Any, *, passes=None, example_inputs=None) -> nn.Module:
    """:func:`tncompile.load` of a folder: its contents rebuilt onto ``model`` -- a fresh
    instance, a callable building one, or a class built from the folder's ``config.json``
    (:func:`model_from_config`)."""
    with read_folder(folder) as saved:
        if model is None:
            raise ModelFileError(f"tncompile.load: {str(folder)!r} was written by save_pretrained of a compressed "
                                 f"{saved.model_class}; pass its model class (model={saved.model_class}: built from "
                                 "the folder's config.json) or a fresh instance to load it onto -- or load it with "
                                 f"transformers: {saved.model_class}.from_pretrained(folder) after import tncompile")
        if isinstance(model, type) and issubclass(model, nn.Module):
            dense = model_from_config(folder, model, saved)
        else:
            dense = dense_model(model, folder, saved.model_class)
        return rebuild_saved(saved, dense, passes, example_inputs)


def model_from_config(folder: Path, cls: type, saved: SavedModel) -> nn.Module:
    """``cls(config)`` from the folder's ``config.json``, data fields only: entries that name
    code (``auto_map``, remote code, a quantizer) are dropped, an attention implementation
    other than PyTorch's own is refused, and the model is first built on the meta device
    (nothing allocated): its parameter count must be the saved model's, and its size within
    :data:`DENSE_PER_FILE_BYTE` times the file's."""
    where = f"{folder / 'config.json'}"
    if cls.__name__ != saved.model_class:  # before building anything from the config
        raise ModelMismatchError(f"{folder} was saved from a compressed {saved.model_class}, the class given is "
                                 f"{cls.__name__}: tncompile.load(folder, model={saved.model_class})")
    config_class = getattr(cls, "config_class", None)
    if config_class is None or not hasattr(config_class, "from_dict"):
        raise TypeError(f"tncompile.load({str(folder)!r}, model={cls.__name__}): {cls.__name__} has no config_class "
                        "to build it from the folder's config.json; pass a fresh instance instead (model=YourModel(...))")
    data = _config_data(folder)
    for key in CODE_KEYS:
        data.pop(key, None)
    for key in ATTENTION_KEYS:
        if key in data and data[key] not in ATTENTION:
            raise ModelFileError(f"{where}: {key}={data[key]!r:.80} is not PyTorch's own attention "
                                 f"({[a for a in ATTENTION if a]}); a file may not choose other code to run")
    try:
        config = config_class.from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, OverflowError, RecursionError) as e:
        raise ModelFileError(f"{where}: does not build a {cls.__name__} config ({type(e).__name__}: {e})") from e
    check_structure(config.to_dict(), saved.structure, where)   # before anything is built
    try:
        with torch.device("meta"):
            shape_only = cls(config)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, OverflowError) as e:
        raise ModelFileError(f"{where}: does not build a {cls.__name__} ({type(e).__name__}: {e})") from e
    params = count_params(shape_only)
    nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in shape_only.state_dict().values()}.values())
    del shape_only
    if params != saved.original_params:
        raise ModelMismatchError(f"{where}: builds a {cls.__name__} of {params:,} parameters; the saved "
                                 f"{saved.model_class} had {saved.original_params:,}")
    limit = max(DENSE_FLOOR_BYTES, DENSE_PER_FILE_BYTE * sum(spec.nbytes for spec in saved.file.specs.values()))
    if nbytes > limit:
        raise ModelFileError(f"{where}: builds a dense {cls.__name__} of {nbytes:,} bytes, more than {limit:,} for "
                             "this file; build it yourself and pass the instance (model=...) if you trust it")
    return cls(config)


# swap mode and serialization sit below this package and cannot import it: a swapped
# model's save_pretrained and tncompile.load(folder) ask what is registered here (the
# dependency inverted, as the runtime asks the planner tncompile.planning registers)
register_folder_writer(save_folder)
register_folder_loader(load_folder)
