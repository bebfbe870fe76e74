"""Many TT networks' merged factors in one batched pass: the stacked cores and gates, the
chains as batched products forward and backward (:class:`BatchedFactors`).

Networks of the same modes batch together (:class:`FactorBatch`); ranks may differ (cores
are zero-padded to the batch's largest rank at each bond, which only adds zero terms).
Which layers batch, and when a batch is used, is :mod:`tncompile.runtime.layers.factor_groups`'s.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .executor import autocast_state, run_dtype, without_autocast

__all__ = ["BatchedFactors", "FactorBatch", "network_params", "network_grads", "stack_or_zeros"]


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415 - only where a cache is filled

    return isinstance(t, FakeTensor)


def network_params(layer: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """A layer's cores and gates (the lists' dicts directly: ``ParameterList`` indexing
    costs microseconds per item)."""
    return list(layer.cores._parameters.values()), list(layer.gates._parameters.values())


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


def _by_index(device: torch.device) -> bool:
    """Whether padded batches pack and unpack through index scatters and gathers (a few
    kernels per batch: accelerators) rather than one copy per tensor (the CPU, where
    kernels are cheap and a gather of the all-MiniLM-L6-v2 layers' cores cost ~8% of a
    training step)."""
    return device.type != "cpu"


def _corner(shape: Sequence[int]) -> tuple[slice, ...]:
    """The leading corner of a padded block that a tensor of ``shape`` fills."""
    return tuple(slice(e) for e in shape)


class _Packing:
    """How the tensors of ``n`` networks stack for batched products: per position ``p``
    (a core, a gate, a factor) one ``(n, *padded_p)`` tensor, ``padded_p`` the largest
    extent along each dimension, each network's tensor in its leading corner and zeros
    around it where ranks differ.

    Equal shapes stack per position (``torch.stack``) and split as views. Otherwise, on
    an accelerator, every position is filled by one scatter into one zeroed buffer and
    split by one gather -- three kernels and two for the whole batch, however many
    positions -- through a flat index of each network's elements in the buffer (made once
    per device); on the CPU, where a kernel costs next to nothing and index gathers run
    far below copy speed, each tensor is copied into (out of) its corner (:func:`_by_index`).
    A single position whose shapes differ in their first dimension only splits as views.

    ``shapes[m][p]``: network ``m``'s tensor at position ``p``; tensors come network after
    network, in that order.
    """

    def __init__(self, shapes: Sequence[Sequence[tuple[int, ...]]]):
        self.n, self.positions = len(shapes), len(shapes[0])
        self.shapes = [[tuple(t) for t in member] for member in shapes]
        self.padded = [tuple(max(extents) for extents in zip(*(member[p] for member in self.shapes)))
                       for p in range(self.positions)]
        self.equal = all(member[p] == self.padded[p] for member in self.shapes for p in range(self.positions))
        self.rows_only = self.positions == 1 and all(m[0][1:] == self.padded[0][1:] for m in self.shapes)
        self.blocks = [self.n * math.prod(pad) for pad in self.padded]         # position after position
        self.size = sum(self.blocks)
        sizes = [math.prod(pad) for pad in self.padded]
        if self.equal:   # stack_into: network after network, one cat
            self.placement = [(sum(sizes[:p]), sum(sizes)) for p in range(self.positions)]
        else:            # position after position, each network's block padded
            self.placement = [(sum(self.blocks[:p]), sizes[p]) for p in range(self.positions)]
        # the index per device; shape templates for torch's C++ split of a flat buffer into views
        self._cache: dict = {}

    def index(self, device: torch.device) -> Tensor:
        """Flat positions in the position-major buffer of every network's elements, in
        the order the tensors come in."""
        def make() -> Tensor:
            starts = [sum(self.blocks[:p]) for p in range(self.positions)]
            grids = [torch.arange(math.prod(pad), device=device).reshape(pad) for pad in self.padded]
            return torch.cat([grids[p][_corner(member[p])].reshape(-1) + starts[p] + m * grids[p].numel()
                              for m, member in enumerate(self.shapes) for p in range(self.positions)])
        return self._cached(("index", device), make)

    def _cached(self, key, make):
        """``make()``, kept for later calls unless made under FakeTensorMode (a dry run),
        whose tensors real calls cannot use."""
        if key not in self._cache:
            value = make()
            first = value[0] if isinstance(value, list) else value
            if _is_fake(first):
                return value
            self._cache[key] = value
        return self._cache[key]

    def stack(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The tensors, network after network -> per position ``(n, *padded_p)``."""
        if self.equal:
            return [torch.stack(tensors[p::self.positions]) for p in range(self.positions)]
        if not _by_index(tensors[0].device):  # one copy per tensor into its corner of the zeros
            blocks = [tensors[0].new_zeros((self.n, *pad)) for pad in self.padded]
            for i, t in enumerate(tensors):
                m, p = divmod(i, self.positions)
                blocks[p][m][_corner(t.shape)].copy_(t)
            return blocks
        flat = _flatten_dense_tensors(list(tensors))
        buffer = flat.new_zeros(sum(self.blocks))
        buffer.index_copy_(0, self.index(flat.device), flat)
        return [part.view(self.n, *pad) for part, pad in zip(buffer.split(self.blocks), self.padded)]

    def stack_into(self, buffer: Tensor, tensors: Sequence[Tensor]) -> None:
        """The tensors, network after network, into ``buffer[:size]`` as :attr:`placement`
        says: one copy of them all where shapes are equal; else zeros and one scatter."""
        region = buffer[: self.size]
        if self.equal:
            torch.cat([t.reshape(-1) for t in tensors], out=region)
            return
        region.zero_()
        region.index_copy_(0, self.index(buffer.device), _flatten_dense_tensors(list(tensors)))

    def split(self, stacked: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Per position ``(n, *padded_p)`` (``None``: nothing there) -> each network's own
        parts, network after network (``None`` where its position had nothing)."""
        like = next((g for g in stacked if g is not None), None)
        if like is None:
            return [None] * (self.n * self.positions)
        if self.equal:
            parts = [None if g is None else g.unbind(0) for g in stacked]
            return [None if parts[p] is None else parts[p][m] for m in range(self.n) for p in range(self.positions)]
        if self.rows_only:  # each network's rows are one run of the stack: views
            rows = self.padded[0][0]
            runs = [r for member in self.shapes for r in (member[0][0], rows - member[0][0])]
            return list(like.reshape(self.n * rows, *self.padded[0][1:]).split(runs)[::2])
        if not _by_index(like.device):  # one copy per tensor out of its corner
            return [None if stacked[p] is None else stacked[p][m][_corner(self.shapes[m][p])].contiguous()
                    for m in range(self.n) for p in range(self.positions)]
        flat = torch.cat([like.new_zeros(block) if g is None else g.reshape(-1)
                          for g, block in zip(stacked, self.blocks)])
        templates = self._cached("templates", lambda: [torch.empty(t, device="meta")
                                                        for member in self.shapes for t in member])
        parts = _unflatten_dense_tensors(flat.index_select(0, self.index(flat.device)), templates)
        return [None if stacked[i % self.positions] is None else part for i, part in enumerate(parts)]


class FactorBatch:
    """``n`` networks whose factors are merged together: the same modes, cores and gate
    count; ranks may differ (cores are zero-padded to the largest rank at each bond,
    which only adds zero terms to every member's products).

    Parameters
    ----------
    n_in:
        Input cores per network (``A`` merges cores ``0 .. n_in-1``, ``B`` the rest).
    core_shapes, gate_shapes:
        Per network, its ``d`` cores' shapes ``(r_{k-1}, n_k, r_k)`` and its ``d - 1``
        gates' ``(r_k,)``.
    """

    def __init__(self, n_in: int, core_shapes: Sequence[Sequence[tuple]], gate_shapes: Sequence[Sequence[tuple]]):
        self.n, self.n_in, self.d = len(core_shapes), n_in, len(core_shapes[0])
        self.params = _Packing([[*cores, *gates] for cores, gates in zip(core_shapes, gate_shapes)])
        rows = math.prod(s[1] for s in core_shapes[0][:n_in])
        cols = math.prod(s[1] for s in core_shapes[0][n_in:])
        self.a = _Packing([[(rows, shapes[n_in - 1][2])] for shapes in core_shapes])
        self.b = _Packing([[(shapes[n_in][0], cols)] for shapes in core_shapes])

    @classmethod
    def of(cls, layers: Sequence[nn.Module]) -> "FactorBatch":
        """The batch of ``layers`` (TT linears of one family, see :func:`_family`)."""
        params = [network_params(m) for m in layers]
        return cls(len(layers[0].layout.in_modes), [[tuple(c.shape) for c in cores] for cores, _ in params],
                   [[tuple(g.shape) for g in gates] for _, gates in params])

    def waste(self) -> float:
        """Elements of the stacked cores per element of the members' cores."""
        cores = self.params.padded[: self.d]
        stacked = self.n * sum(math.prod(pad) for pad in cores)
        return stacked / sum(math.prod(member[k]) for member in self.params.shapes for k in range(self.d))


class BatchedFactors(torch.autograd.Function):
    """The merged factors of the networks of a :class:`FactorBatch`, from their own cores
    and gates.

    Inputs: the batch, whether to return whole matrices, then per network its ``d`` cores
    and ``d - 1`` gates. Outputs: the ``n`` ``A`` factors, then the ``n`` ``B`` factors;
    or, ``whole``, the ``n`` matrices ``W.T = A B`` (``(M, N)``, the padded sizes), made
    as one batched product of the padded factors (the padding adds zero terms only).
    Backward takes the gradients that exist (a network whose outputs were not used gets
    ``None`` for its cores and gates) and runs the chain's reverse as batched products.
    """

    @staticmethod
    def forward(ctx, batch: FactorBatch, whole: bool, *tensors: Tensor):
        state = autocast_state(tensors[0].device.type)
        ctx.set_materialize_grads(False)
        ctx.device_type, ctx.batch, ctx.whole = state[0], batch, whole
        ctx.cast = run_dtype(tensors[0], state)
        # the chain in the parameters' dtype (small products: exact, and no cast per step of
        # it); only its two ends are cast to autocast's dtype, once per batch
        with without_autocast(state):
            stacked = batch.params.stack(tensors)
            cores, gates = stacked[:batch.d], stacked[batch.d:]
            gated = [c * g[:, None, None, :] for c, g in zip(cores, gates)] + [cores[-1]]
            chain_a, chain_b = _chain_a(gated, batch.n_in), _chain_b(gated, batch.n_in)
            a_end, b_end = chain_a[-1], chain_b[-1]
            if ctx.cast is not None:
                a_end, b_end = a_end.to(ctx.cast), b_end.to(ctx.cast)
            if whole:  # (n, M, r) @ (n, r, N) in the run dtype; its ends kept for its backward
                ctx.save_for_backward(*cores, *gates, *gated[:-1], *chain_a[:-1], *chain_b[:-1], a_end, b_end)
                return tuple(torch.bmm(a_end, b_end).unbind(0))
            ctx.save_for_backward(*cores, *gates, *gated[:-1], *chain_a[:-1], *chain_b[:-1])
            return (*batch.a.split([a_end]), *batch.b.split([b_end]))

    @staticmethod
    def backward(ctx, *grads):
        with without_autocast(autocast_state(ctx.device_type)):  # as forward ran: chain in the params' dtype
            return BatchedFactors._backward(ctx, grads)

    @staticmethod
    def _backward(ctx, grads):
        batch = ctx.batch
        n, n_in, d = batch.n, batch.n_in, batch.d
        saved = ctx.saved_tensors
        cores, gates = saved[:d], saved[d:2 * d - 1]
        gated = [*saved[2 * d - 1:3 * d - 2], cores[-1]]
        chain_a = saved[3 * d - 2:3 * d - 2 + n_in - 1]    # a_0 .. a_{n_in-2}
        chain_b = saved[3 * d - 2 + n_in - 1:3 * d - 2 + n_in - 1 + d - n_in - 1]  # b before each step
        da = db = None
        dtype = cores[0].dtype
        if ctx.whole:  # W = A B for every network: dA = dW B^T, dB = A^T dW, batched (run dtype)
            a_last, b_last = saved[-2:]
            if any(g is not None for g in grads):
                dw = torch.stack([a_last.new_zeros(a_last.shape[1], b_last.shape[2]) if g is None
                                  else g.to(a_last.dtype) for g in grads])
                da = torch.bmm(dw, b_last.transpose(1, 2)).to(dtype)
                db = torch.bmm(a_last.transpose(1, 2), dw).to(dtype)
            grads = (*grads, *grads)  # a network used both of its factors, or neither
        else:
            if any(g is not None for g in grads[:n]):
                da = stack_or_zeros(grads[:n], batch.a, next(g for g in grads[:n] if g is not None)).to(dtype)
            if any(g is not None for g in grads[n:]):
                db = stack_or_zeros(grads[n:], batch.b, next(g for g in grads[n:] if g is not None)).to(dtype)
        d_gated: list[Tensor | None] = [None] * d
        if da is not None:  # A = a_0 . g_1 . .. g_{n_in-1}, left to right
            for k in range(n_in - 1, 0, -1):
                core, prev = gated[k], chain_a[k - 1]                  # prev: (n, M, r_{k-1})
                dx = da.reshape(n, prev.shape[1], -1)                 # (n, M, s_k r_k)
                d_gated[k] = torch.bmm(prev.transpose(1, 2), dx).reshape(core.shape)
                da = torch.bmm(dx, core.reshape(n, core.shape[1], -1).transpose(1, 2))
            d_gated[0] = da.reshape(gated[0].shape)
        if db is not None:  # B = g_{n_in} . .. g_{d-1}, built right to left
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
        return (None, None, *network_grads(batch, [*d_cores, *d_gates], grads))


def network_grads(batch: FactorBatch, stacked: Sequence[Tensor | None], grads: Sequence[Tensor | None]
                   ) -> list[Tensor | None]:
    """Each network's core and gate gradients from the stacked ones (``d`` cores, then
    ``d - 1`` gates); a factor never used gives its cores and gates no gradient (not zeros)."""
    n, n_in, d = batch.n, batch.n_in, batch.d
    own = batch.params.split(stacked)   # network after network, cores then gates
    out: list[Tensor | None] = []
    for m in range(n):
        sides = (grads[m] is not None, grads[n + m] is not None)   # A: cores and gates < n_in
        mine = own[m * (2 * d - 1):(m + 1) * (2 * d - 1)]   # cores 0 .. d-1, then gates 0 .. d-2
        out.extend(g if g is not None and sides[(p if p < d else p - d) >= n_in] else None
                   for p, g in enumerate(mine))
    return out


def stack_or_zeros(grads: Sequence[Tensor | None], packing: _Packing, like: Tensor) -> Tensor:
    """The gradients of one factor stacked as ``packing`` stacks it, in ``like``'s dtype,
    zeros for the factors that got none."""
    parts = [like.new_zeros(member[0]) if g is None else g.to(like.dtype) for g, member in zip(grads, packing.shapes)]
    return packing.stack(parts)[0]



