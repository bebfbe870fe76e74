"""The rank gates multiplied into their cores, as one custom op for tracers.

A TT layer's forward starts by scaling each core's right bond by its gate,
``core * gate`` (:meth:`~tncompile.runtime.TNModule.scaled_cores`).
Eagerly that is one cheap elementwise op per core. Traced by ``torch.compile``
each product, and each of its two gradients, is an inductor kernel of its own
to generate and compile (about 0.6 s apiece with a C++ compiler on CPU):
on a 2-layer BERT the gates alone were 19 of 53 kernels and 11 of 38 s of
the first call. ``tncompile::gate_cores`` is all of a layer's products as one
opaque call, and its backward one more (``tncompile::gate_cores_backward``);
the arithmetic is tiny (cores are small), so nothing is lost by not fusing it.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gate_cores", "gated", "gated_grads"]


def gated(cores: list[Tensor], gates: list[Tensor]) -> list[Tensor]:
    """``cores`` with ``gates[k]`` on core ``k``'s right bond (the last core has no gate)."""
    return [*torch._foreach_mul(cores[:len(gates)], gates), *cores[len(gates):]]


def gated_grads(g_gated: list[Tensor], cores: list[Tensor], gates: list[Tensor]) -> list[Tensor]:
    """From the gradients of :func:`gated`'s outputs those of the cores
    (``grad * gate``), then of the gates (``grad * core`` summed over all but
    the last axis)."""
    n = len(gates)
    d_cores = [*torch._foreach_mul(g_gated[:n], gates), *g_gated[n:]]
    d_gates = [p.sum(tuple(range(p.dim() - 1))) for p in torch._foreach_mul(g_gated[:n], cores[:n])]
    return d_cores + d_gates


# Defined with the low-level ``torch.library.Library`` API, not ``custom_op``: these two
# run once per TT layer per step on tiny tensors, and ``custom_op``'s Python wrapper
# (dynamo-disable context, pytree handling) cost ~30 us a call more (26 calls a step on a
# 2-layer BERT). Fake kernels and autograd are registered as for any custom op.
_LIB = torch.library.Library("tncompile", "FRAGMENT")
_LIB.define("gate_cores(Tensor[] cores, Tensor[] gates) -> Tensor[]")
_LIB.define("gate_cores_backward(Tensor[] grads, Tensor[] cores, Tensor[] gates) -> Tensor[]")
_LIB.impl("gate_cores", lambda cores, gates: [t.contiguous() for t in gated(cores, gates)],
          "CompositeExplicitAutograd")  # contiguous, as the fake kernels promise (a gradient may come strided)
_LIB.impl("gate_cores_backward", lambda grads, cores, gates: [t.contiguous() for t in gated_grads(grads, cores, gates)],
          "CompositeExplicitAutograd")
gate_cores = torch.ops.tncompile.gate_cores.default
gate_cores_backward = torch.ops.tncompile.gate_cores_backward.default


@torch.library.register_fake("tncompile::gate_cores", lib=_LIB)
def _(cores, gates):
    return [c.new_empty(c.shape, dtype=torch.result_type(c, g)) for c, g in zip(cores, gates)]


@torch.library.register_fake("tncompile::gate_cores_backward", lib=_LIB)
def _(grads, cores, gates):
    return [c.new_empty(c.shape) for c in cores] + [g.new_empty(g.shape) for g in gates]


def _setup(ctx, inputs, output):
    cores, gates = inputs
    ctx.n = len(cores)
    ctx.save_for_backward(*cores, *gates)


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    got = gate_cores_backward(list(grads), list(saved[:ctx.n]), list(saved[ctx.n:]))
    return got[:ctx.n], got[ctx.n:]


torch.library.register_autograd("tncompile::gate_cores", _backward, setup_context=_setup, lib=_LIB)
