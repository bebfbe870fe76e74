"""One side stream per CUDA device for every capture and warm-up tncompile runs.

PyTorch keeps a cuBLAS workspace for every (handle, stream) pair that has run a matrix
product, allocated through the caching allocator, for the life of the process
(``torch._C._cuda_clearCublasWorkspaces`` alone frees them). A new stream per
:class:`~tncompile.train.TrainStep` therefore left memory allocated after its model and
its step were gone: about 1.17 GB over one benchmark run of many steps on an H100
(issue 55). One stream per device, shared by every step, bounds that to one workspace.
The steps order themselves against the caller's stream on entry and exit
(``wait_stream``), so sharing it adds no ordering of its own.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device | int | None = None) -> "torch.cuda.Stream":
    """The shared side stream of ``device`` (the current CUDA device by default)."""
    where = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    index = torch.cuda.current_device() if where.index is None else where.index
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


@contextlib.contextmanager
def on_side_stream() -> Iterator["torch.cuda.Stream"]:
    """Run the body on the current device's side stream, ordered after the work queued on
    the current stream before it and before the work queued there after it."""
    stream = side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.current_stream().wait_stream(stream)
