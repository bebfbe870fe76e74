"""Where the examples read data and write results.

One environment variable, ``TNCOMPILE_DATA``, names the folder holding the data
sets (``sst2/``, ``bert-base-uncased/``, ...); without it the examples look in
``../shared/data`` beside the repository. Results go to ``runs/<example>/``
under the current directory (git-ignored) unless ``--out`` says otherwise;
the README's figures were written with ``--out benchmarks/results``.
"""
from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "TNCOMPILE_DATA"
REPO = Path(__file__).resolve().parents[1]


def data_root() -> Path:
    """``$TNCOMPILE_DATA``, else ``../shared/data`` beside the repository."""
    return Path(os.environ.get(DATA_ENV) or REPO.parent / "shared" / "data")


def data_dir(name: str) -> str:
    """One data set's folder, e.g. ``data_dir("sst2")``."""
    return str(data_root() / name)


def out_dir(example: str) -> str:
    """Default output folder of an example: ``runs/<example>`` (never a tracked path)."""
    return str(Path("runs") / example)
