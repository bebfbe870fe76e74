import os
from pathlib import Path

import pytest
import torch

DATA = Path(os.environ.get("TNCOMPILE_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def data_dir():
    if not DATA.exists():
        pytest.skip(f"shared data not found at {DATA} (set TNCOMPILE_SHARED_DATA)")
    return DATA


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
