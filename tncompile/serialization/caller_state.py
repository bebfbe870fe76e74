"""What loading leaves as it found it: the caller's global state.

Loading builds and traces the user's model (random init, dropout draws, a model that sets
a default dtype) and plans contractions (cotengra draws from Python's ``random``). None of
that is the caller's business: :func:`caller_state_kept` puts back every random stream
(torch's CPU and initialized CUDA generators, Python's ``random``, NumPy's global one),
grad mode, the default dtype, torch's thread count and deterministic-algorithms flag.
Every load path runs inside it: ``tncompile.load`` of a file or a folder,
``from_pretrained`` of a compressed folder, ``tncompile.resume`` (which then sets the
random streams only when asked to restore the checkpoint's) and adapters.
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Iterator

import torch

__all__ = ["caller_state_kept"]


@contextlib.contextmanager
def caller_state_kept() -> Iterator[None]:
    """Run the body, then put the caller's global state back (see the module doc)."""
    grad, dtype, threads = torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads()
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    python_random = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_random = numpy.random.get_state() if numpy is not None else None
    cuda = torch.cuda.is_initialized()
    try:
        with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
            yield
    finally:
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(dtype)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != deterministic:
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        random.setstate(python_random)
        if numpy_random is not None:
            numpy.random.set_state(numpy_random)
