"""The merged factors of many TT linears, computed together: one batched chain per layout.

A TT linear contracted merge-cores-first (the planner's choice over many rows) runs
``x -> x A -> (x A) B + b``, where ``A`` merges its gated input cores and ``B`` its
output cores (:func:`~tncompile.formats.decompose.tt_factors`). Merging is weight-only
work: per layer and training step about a dozen tiny products and gate products, forward
and backward, that cost next to nothing in arithmetic but one kernel each. On a GPU a
kernel costs microseconds however small (the paper's six-encoder: about 430 of the
~1,530 kernels of its step on an H200), and on any device each is a dispatched op.

Layers of one model usually share their layout: the six-encoder's 24 attention
projections have one, its 6 first and 6 second feed-forward linears one each. Here the
layers of a model that share a layout merge their factors in one batched pass
(:class:`BatchedFactors`): each core position's cores and gates stacked, the gates
applied and the chain multiplied as batched products, forward and backward -- a few
kernels per layout instead of a few dozen per layer.

When: :class:`FactorPeers` links a model's TT linears (:func:`link_factor_groups`,
called by ``compile``, ``load`` and swap mode). The first layer of a layout to ask for
its factors in a forward pass gets them computed for every layer of that layout; the
others take theirs. A layer's factors are used once: a layer asking again (the next
forward, a layer called twice) makes its layout's batch computed anew, and factors whose
layer's cores or gates changed since (an optimizer step, a cut), or that were made under
another grad mode or autocast state, are never used. A layer that does not run in a
forward gets no gradient from it (``None``, as if it had computed its own factors).
``CompiledModel`` and swap-mode models drop unused factors at each call, so a forward
(and a CUDA-graph capture of one) only ever uses factors made in it.

Not under ``torch.compile`` or ``torch.export`` (each layer traces its own merge), nor
inside activation checkpointing or other saved-tensor hooks (a checkpointed block must
record the same ops when it is recomputed), for :class:`~tncompile.runtime.TTLinear`
layers only, and off with ``tuning.GROUP_FACTORS = False``.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn

from .. import tuning
from .executor import autocast_state, same_autocast
from .tracing import exporting

__all__ = ["BatchedFactors", "FactorPeers", "link_factor_groups", "peers_of"]


def _chain_a(gated: list[Tensor], n_in: int) -> list[Tensor]:
    """Batched ``A`` chain: the running products ``a_0 .. a_{n_in-1}``, each ``(n, M_k, r_k)``."""
    n = gated[0].shape[0]
    a = gated[0].reshape(n, -1, gated[0].shape[-1])
    chain = [a]
    for core in gated[1:n_in]:
        a = torch.bmm(a, core.reshape(n, core.shape[1], -1)).reshape(n, -1, core.shape[-1])
        chain.append(a)
    return chain


def _chain_b(gated: list[Tensor], n_in: int) -> list[Tensor]:
    """Batched ``B`` chain, right to left: ``b_{d-1} .. b_{n_in}``, each ``(n, r_{k-1}, N_k)``."""
    n = gated[0].shape[0]
    last = gated[-1]
    b = last.reshape(n, last.shape[1], -1)
    chain = [b]
    for core in reversed(gated[n_in:-1]):
        b = torch.bmm(core.reshape(n, -1, core.shape[-1]), b).reshape(n, core.shape[1], -1)
        chain.append(b)
    return chain


class BatchedFactors(torch.autograd.Function):
    """The merged factors of ``n`` networks of one layout, from their own cores and gates.

    Inputs: ``n``, ``n_in``, ``d`` (cores per network), then per network its ``d`` cores
    and ``d - 1`` gates. Outputs: the ``n`` ``A`` factors, then the ``n`` ``B`` factors.
    Backward takes the gradients that exist (a network whose factors were not used gets
    ``None`` for its cores and gates) and runs the chain's reverse as batched products.
    """

    @staticmethod
    def forward(ctx, n: int, n_in: int, d: int, *tensors: Tensor):
        per = 2 * d - 1
        cores = [torch.stack([tensors[m * per + k] for m in range(n)]) for k in range(d)]
        gates = [torch.stack([tensors[m * per + d + k] for m in range(n)]) for k in range(d - 1)]
        gated = [c * g[:, None, None, :] for c, g in zip(cores, gates)] + [cores[-1]]
        chain_a, chain_b = _chain_a(gated, n_in), _chain_b(gated, n_in)
        ctx.set_materialize_grads(False)
        ctx.autocast = autocast_state(cores[0].device.type)
        ctx.sizes = (n, n_in, d)
        ctx.shapes = (chain_a[-1].shape[1:], chain_b[-1].shape[1:])
        ctx.save_for_backward(*cores, *gates, *gated[:-1], *chain_a[:-1], *chain_b[:-1])
        return (*chain_a[-1].unbind(0), *chain_b[-1].unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        with same_autocast(ctx.autocast):  # the products in the dtypes forward ran them in
            return BatchedFactors._backward(ctx, grads)

    @staticmethod
    def _backward(ctx, grads):
        n, n_in, d = ctx.sizes
        saved = ctx.saved_tensors
        cores, gates = saved[:d], saved[d:2 * d - 1]
        gated = [*saved[2 * d - 1:3 * d - 2], cores[-1]]
        chain_a = saved[3 * d - 2:3 * d - 2 + n_in - 1]    # a_0 .. a_{n_in-2}
        chain_b = saved[3 * d - 2 + n_in - 1:]             # b before each step, rightmost first
        d_gated: list[Tensor | None] = [None] * d
        a_shape, b_shape = ctx.shapes
        if any(g is not None for g in grads[:n]):  # A = a_0 . g_1 . .. g_{n_in-1}, left to right
            da = _stack_or_zeros(grads[:n], a_shape, gated[0])
            for k in range(n_in - 1, 0, -1):
                core, prev = gated[k], chain_a[k - 1]                  # prev: (n, M, r_{k-1})
                dx = da.reshape(n, prev.shape[1], -1)                 # (n, M, s_k r_k)
                d_gated[k] = torch.bmm(prev.transpose(1, 2), dx).reshape(core.shape)
                da = torch.bmm(dx, core.reshape(n, core.shape[1], -1).transpose(1, 2))
            d_gated[0] = da.reshape(gated[0].shape)
        if any(g is not None for g in grads[n:]):  # B = g_{n_in} . .. g_{d-1}, built right to left
            db = _stack_or_zeros(grads[n:], b_shape, gated[0])
            for k in range(n_in, d - 1):
                core, right = gated[k], chain_b[d - 2 - k]            # right: (n, r_k, N)
                dy = db.reshape(n, -1, right.shape[-1])               # (n, r_{k-1} s_k, N)
                d_gated[k] = torch.bmm(dy, right.transpose(1, 2)).reshape(core.shape)
                db = torch.bmm(core.reshape(n, -1, core.shape[-1]).transpose(1, 2), dy)
            d_gated[d - 1] = db.reshape(gated[-1].shape)
        d_cores: list[Tensor | None] = [d_gated[d - 1] if k == d - 1 else None for k in range(d)]
        d_gates: list[Tensor | None] = [None] * (d - 1)
        for k in range(d - 1):  # through the gates: core k scaled along its right bond
            g = d_gated[k]
            if g is not None:
                d_cores[k] = g * gates[k][:, None, None, :]
                d_gates[k] = (g * cores[k]).sum((1, 2))
        out: list[Tensor | None] = [None, None, None]
        for m in range(n):  # a factor never used gives its cores and gates no gradient (not zeros)
            sides = (grads[m] is not None, grads[n + m] is not None)   # A: cores and gates < n_in
            out.extend(g[m] if g is not None and sides[k >= n_in] else None for k, g in enumerate(d_cores))
            out.extend(g[m] if g is not None and sides[k >= n_in] else None for k, g in enumerate(d_gates))
        return tuple(out)


def _stack_or_zeros(grads: Sequence[Tensor | None], shape, like: Tensor) -> Tensor:
    """The gradients stacked, zeros for the factors that got none: ``(n, *shape)``."""
    zeros = None
    parts = []
    for g in grads:
        if g is None:
            if zeros is None:
                zeros = like.new_zeros(shape)
            g = zeros
        parts.append(g)
    return torch.stack(parts)


def _recorded_elsewhere() -> bool:
    """Inside activation checkpointing (saved-tensor hooks; its recomputation runs in a
    backward pass): a checkpointed region must record the same ops when it is run again,
    so its layers merge their own factors."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooked = True if top is None else top(False) is not None
    return hooked or torch._C._current_graph_task_id() != -1


def _is_plain(t: Tensor) -> bool:
    """A tensor batched products can stack: not a DTensor (an FSDP2 shard)."""
    return type(t).__name__ != "DTensor"


def _params(layer: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    # the lists' dicts directly: ParameterList indexing costs microseconds per item
    return list(layer.cores._parameters.values()), list(layer.gates._parameters.values())


def _stamp(layer: nn.Module) -> tuple:
    """Changes whenever the layer's grouping may: a new layout (a cut), new parameter
    objects (FSDP2 swapping shards in and out), another dtype or device."""
    first = next(iter(layer.cores._parameters.values()))
    return id(layer.layout), id(first), first.dtype, first.device


def _signature(layer: nn.Module) -> tuple | None:
    """What layers must share to be batched together (``None``: this one cannot be)."""
    cores, gates = _params(layer)
    if not cores or len(gates) != len(cores) - 1 or not all(_is_plain(t) for t in cores + gates):
        return None
    return (len(layer.layout.in_modes), tuple(c.shape for c in cores), tuple(g.shape for g in gates),
            cores[0].dtype, cores[0].device, *(t.dtype for t in gates))


def _freshness(layer: nn.Module, stamp: tuple) -> tuple:
    """What factors made for ``layer`` stay valid for: its cores and gates unchanged
    (in-place versions and :func:`_stamp`), and the grad mode and autocast state they
    were made under."""
    versions = tuple(p._version for p in layer.cores._parameters.values()) + \
        tuple(p._version for p in layer.gates._parameters.values())
    return versions, stamp, torch.is_grad_enabled(), autocast_state(stamp[3].type)


class FactorPeers:
    """The TT linears of one model whose merged factors are computed in batches (see the
    module doc). Shared by the layers (``layer._factor_peers``), which it refers to weakly
    (no reference cycle: a deleted model is freed at once); holds the factors made for
    layers that have not used them yet."""

    def __init__(self, layers: Iterable[nn.Module]):
        self._refs = [weakref.ref(m) for m in layers]
        self._ready: dict[int, tuple] = {}  # id(layer) -> (freshness, A, B)
        self._stamps: tuple | None = None   # the layers' _stamp when _groups was made
        self._groups: dict[int, list] = {}  # id(layer) -> weak refs to its batch (itself included)

    @property
    def layers(self) -> list[nn.Module]:
        """The linked layers still alive."""
        return [m for m in (r() for r in self._refs) if m is not None]

    def _group_of(self, layer: nn.Module) -> list[nn.Module]:
        layers = self.layers
        stamps = tuple(_stamp(m) for m in layers)
        if stamps != self._stamps:
            by_signature: dict[tuple, list] = {}
            for m in layers:
                sig = _signature(m)
                if sig is not None:
                    by_signature.setdefault(sig, []).append(weakref.ref(m))
            self._groups = {id(r()): group for group in by_signature.values() if len(group) > 1 for r in group}
            self._stamps = stamps
        members = [r() for r in self._groups.get(id(layer), [])]
        return members if all(m is not None for m in members) else []

    def factors(self, layer: nn.Module) -> tuple[Tensor, Tensor] | None:
        """``layer``'s ``(A, B)`` (see :meth:`~tncompile.runtime.TTLinear.merged_factors`),
        from its layout's batch; ``None`` where batching does not apply (the layer then
        merges its own)."""
        if not tuning.GROUP_FACTORS or torch.compiler.is_compiling() or exporting() or _recorded_elsewhere():
            return None
        key = _freshness(layer, _stamp(layer))
        entry = self._ready.pop(id(layer), None)
        if entry is not None and entry[0] == key:
            return entry[1], entry[2]
        members = self._group_of(layer)
        if not any(m is layer for m in members):
            return None
        n, d = len(members), len(layer.layout.in_modes) + len(layer.layout.out_modes)
        tensors = [t for m in members for group in _params(m) for t in group]
        out = BatchedFactors.apply(n, len(layer.layout.in_modes), d, *tensors)
        mine = None
        for i, m in enumerate(members):
            if m is layer:
                mine = (out[i], out[n + i])
            else:
                self._ready[id(m)] = (_freshness(m, _stamp(m)), out[i], out[n + i])
        return mine

    def forget(self) -> None:
        """Drop the factors made and not used yet."""
        self._ready.clear()

    # factors waiting to be used are autograd results: never copied or pickled
    def __getstate__(self) -> dict:
        return {"layers": self.layers}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["layers"])

    def __deepcopy__(self, memo: dict) -> "FactorPeers":
        import copy  # noqa: PLC0415

        twin = memo[id(self)] = FactorPeers.__new__(FactorPeers)  # before the layers, which refer back to it
        twin.__init__([copy.deepcopy(m, memo) for m in self.layers])
        return twin


def peers_of(layer: nn.Module) -> FactorPeers | None:
    """The :class:`FactorPeers` ``layer`` belongs to, if any."""
    return layer.__dict__.get("_factor_peers")


def link_factor_groups(model: nn.Module) -> FactorPeers | None:
    """Link ``model``'s TT linears so that layers of one layout merge their factors in
    one batched pass per forward (see the module doc); replaces earlier links. Returns
    the shared :class:`FactorPeers` (``None`` when the model has fewer than two)."""
    from .tt_layers import TTLinear  # noqa: PLC0415 - tt_layers imports this module

    layers = [m for m in model.modules() if isinstance(m, TTLinear) and not m.stacked]
    for m in layers:
        m.__dict__.pop("_factor_peers", None)
    if len(layers) < 2:
        return None
    peers = FactorPeers(layers)
    for m in layers:
        m.__dict__["_factor_peers"] = peers
    return peers

