"""A compressed folder's ``config.json`` refuses to build without tncompile, and builds with it.

A compressed ``save_pretrained`` folder holds TT cores where the dense weights were. Loaded
by transformers alone, its quantization backend unknown, the class would be built and every
compressed layer randomly initialized, with one line in the log. So the folder's config
names its dtype as :data:`DTYPE_MARKER`: transformers turns a config's dtype string into a
``torch`` attribute while building any config, and this one fails -- ``AttributeError:
module 'torch' has no attribute 'compressed by tncompile: pip install tncompile, then
import tncompile'`` -- on every path (``AutoModel``, the model class, pipelines,
sentence-transformers), with no remote code involved. The real dtype is kept beside it as
``tncompile_dtype``.

Called (by :mod:`.plugins`) right after transformers imports its config module,
:func:`install` puts the real dtype back in every config dict transformers reads from a JSON file
(:func:`restored`), so with tncompile imported the folder loads as any other.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import ModelFileError
from ..files import read_bounded

__all__ = ["DTYPE_MARKER", "DTYPE_KEY", "marked", "restored", "install", "check_nesting", "MAX_NESTING"]

#: a config.json nested deeper than this is refused before it is decoded (real configs nest a
#: handful of levels; Python's JSON decoder and transformers' config code recurse per level)
MAX_NESTING = 100
#: configs larger than this are left to transformers (its own reader, unbounded as before)
_SCANNED_BYTES = 64 << 20
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")

DTYPE_MARKER = "compressed by tncompile: pip install tncompile, then import tncompile"
DTYPE_KEY = "tncompile_dtype"


def marked(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` dict) with its dtype replaced by the marker."""
    dtype = config.pop("dtype", None)
    if "torch_dtype" in config:
        dtype = config.pop("torch_dtype") if dtype is None else dtype
    return {**config, "dtype": DTYPE_MARKER, DTYPE_KEY: dtype}


def restored(config: Any) -> Any:
    """``config`` with the marker replaced by the real dtype (anything else as it is)."""
    if isinstance(config, dict) and config.get("dtype") == DTYPE_MARKER:
        config = dict(config)
        config["dtype"] = config.pop(DTYPE_KEY, None)
    return config


def check_nesting(text: bytes, where: str) -> None:
    """Refuse JSON ``text`` whose arrays and objects nest deeper than :data:`MAX_NESTING`
    (a ``ModelFileError``, before any decoder recurses into it)."""
    depth = deepest = 0
    for byte in _STRINGS.sub(b'""', text).translate(None, _NOT_BRACKETS):
        if byte in (0x5B, 0x7B):      # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_NESTING:
                    raise ModelFileError(f"{where}: nested deeper than {MAX_NESTING} levels (no model's config is): "
                                         "a crafted file")
        elif byte in (0x5D, 0x7D):    # ] }
            depth -= 1


def install() -> None:
    """Have transformers' config reader put the real dtype back (:func:`restored`), once."""
    from transformers.configuration_utils import PreTrainedConfig  # here: called inside transformers' import
    read = PreTrainedConfig.__dict__["_dict_from_json_file"].__func__
    if getattr(read, "_tncompile", False):
        return

    def dict_from_json_file(cls, json_file):
        try:
            text = read_bounded(json_file, _SCANNED_BYTES, follow_links=True)
        except OSError:
            text = None   # transformers' own reader says what is wrong with it
        if text is not None:
            check_nesting(text, str(json_file))
        return restored(read(cls, json_file))
    dict_from_json_file._tncompile = True
    PreTrainedConfig._dict_from_json_file = classmethod(dict_from_json_file)
