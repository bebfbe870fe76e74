"""What knowing that merged inference forms are current costs: decoding per token, three ways.

    python benchmarks/bench_kept_forms.py [--ratios 0.3 0.1] [--batches 1 8] [--tokens 32]

Without autograd a layer keeps merged forms of its cores (``runtime.derived``). Three
ways to keep them right after every update, timed on the path that needs them most,
decoding token by token (``bench_decode.py``'s 4-layer, 768-wide GPT-2 in swap mode, HF
``generate`` with its KV cache), against the dense model:

* ``events`` (what tncompile does): made again when a tensor's version, storage, shape,
  dtype or device changed, or the weights epoch moved (any optimizer step, ``train()`` /
  ``eval()``, ``load_state_dict``, a replayed training step);
* ``bits``: reused only while the cores and gates hold the bits they held (each call
  compares them with a copy): also sees writes through ``p.data`` with no event after;
* ``recompute``: nothing kept, every call merges again.

Variants interleaved round-robin, the median per token reported (the machines are shared
and noisy: compare the ratios of one run). Writes ``benchmarks/results/kept_forms.json``
with the host's measured copy bandwidth and GEMM throughput.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from tncompile.runtime.layers import tied_linear, tt_linear, ttm_embedding

from bench_decode import _gpt2, compressed_gpt2s, decode_arguments, time_decoding


def _recomputed(module, slot, tensors, make, key=()):
    with torch.no_grad():
        return make()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def _by_bits(module, slot, tensors, make, key=()):
    """The ``bits`` variant of :func:`tncompile.runtime.layers.derived.kept`."""
    entry = module.__dict__.get(slot + "_bits")
    layout = (key, *((t.shape, t.dtype, t.device) for t in tensors))
    if entry is not None and entry[0] == layout and all(_same_bits(t, b) for t, b in zip(tensors, entry[1])):
        return entry[2]
    with torch.no_grad():
        value = make()
        module.__dict__[slot + "_bits"] = (layout, [t.detach().clone() for t in tensors], value)
    return value


def _patched(kept):
    """Every layer module's ``kept`` replaced by ``kept``."""
    stack = contextlib.ExitStack()
    for module in (tt_linear, ttm_embedding, tied_linear):
        stack.enter_context(mock.patch.object(module, "kept", kept))
    return stack


CHECKS = {
    "events": contextlib.nullcontext,
    "bits": lambda: _patched(_by_bits),
    "recompute": lambda: _patched(_recomputed),
}


def main() -> None:
    args = decode_arguments(__doc__)
    dense = _gpt2()
    variants = {"dense": (dense, contextlib.nullcontext)}
    for ratio, model in compressed_gpt2s(dense, args.ratios).items():
        variants.update({f"tt {ratio} {check}": (model, context) for check, context in CHECKS.items()})
    time_decoding(variants, args, "kept_forms")


if __name__ == "__main__":
    main()
