"""The merged factors of many TT linears, computed together: one batched chain per family of modes.

A TT linear contracted merge-cores-first (the planner's choice over many rows) runs
``x -> x A -> (x A) B + b``, where ``A`` merges its gated input cores and ``B`` its
output cores (:func:`~tncompile.formats.decompose.tt_factors`). Merging is weight-only
work: per layer and training step about a dozen tiny products and gate products, forward
and backward, that cost next to nothing in arithmetic but one kernel each. On a GPU a
kernel costs microseconds however small (the paper's six-encoder: about 430 of the
~1,530 kernels of its step on an H200), and on any device each is a dispatched op.

Layers of one model usually share their modes: the six-encoder's 24 attention
projections have one set, its 6 first and 6 second feed-forward linears one each. Here
the layers of a model that share their modes merge their factors in one batched pass
(:class:`BatchedFactors`): each core position's cores and gates stacked, the gates
applied and the chain multiplied as batched products, forward and backward -- a few
kernels per batch instead of a few dozen per layer. Ranks may differ (a pretrained
model's allocation by sensitivity, rank-adaptive cuts): cores are then zero-padded to
the batch's largest rank at each bond, which only adds zero terms to every member's
products, and a family whose padding would exceed ``tuning.FACTOR_PAD_LIMIT`` times its
cores' elements is split into batches of closer ranks (:class:`FactorBatch`).

When: :class:`FactorPeers` links a model's TT linears (:func:`~.factor_links.link_factor_groups`,
called by ``compile``, ``load`` and swap mode). The first layer of a batch to ask for its
factors in a forward pass gets them computed for every layer of that batch; the others
take theirs. A layer's factors are used once: a layer asking again (the next
forward, a layer called twice) makes its batch computed anew, and factors whose
layer's cores or gates may have changed since (an in-place update, new storage, a cut,
anything that moves :func:`~.derived.weights_epoch`: any optimizer step, fused ones
included), or that were made under another grad mode or autocast state, are never used. A layer that does not run in a forward gets no gradient
from it (``None``, as if it had computed its own factors). ``CompiledModel`` and
swap-mode models drop unused factors at each call, so a forward (and a CUDA-graph
capture of one) only ever uses factors made in it. (Only calls that bypass the model's
own, into its submodules, keep unused factors to the next such call; a write through
``p.data`` between two of them is the one change they would not see.)

Not under ``torch.compile`` or ``torch.export`` (each layer traces its own merge), nor
inside activation checkpointing or other saved-tensor hooks (a checkpointed block must
record the same ops when it is recomputed), for :class:`~tncompile.runtime.TTLinear`
layers only, and off with ``tuning.GROUP_FACTORS = False``.
"""
from __future__ import annotations

import functools
import itertools
import math
import weakref
from typing import Callable, Hashable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ... import tuning
from .derived import storage_address, weights_epoch
from ..kernels.executor import autocast_state, same_autocast
from ..kernels.tracing import exporting
from ..triton import runs_triton
from ..triton.merge_factors import MergePlan, joint_plan, merge_backward, merge_forward, merge_plan, plan_of, supports

__all__ = ["BatchedFactors", "FactorBatch", "FactorPeers", "peers_of", "merge_unit", "register_whole_rule",
           "whole_matrices_faster"]


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
        params = [_params(m) for m in layers]
        return cls(len(layers[0].layout.in_modes), [[tuple(c.shape) for c in cores] for cores, _ in params],
                   [[tuple(g.shape) for g in gates] for _, gates in params])

    @functools.cached_property
    def merge(self) -> tuple[int, MergePlan]:
        """The Triton merge's key and plan for this batch (:mod:`tncompile.runtime.triton.merge_factors`)."""
        return merge_plan(self.n, self.n_in, self.params.padded[: self.d], self.params.placement, self.params.size)

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
        stacked = batch.params.stack(tensors)
        cores, gates = stacked[:batch.d], stacked[batch.d:]
        gated = [c * g[:, None, None, :] for c, g in zip(cores, gates)] + [cores[-1]]
        chain_a, chain_b = _chain_a(gated, batch.n_in), _chain_b(gated, batch.n_in)
        ctx.set_materialize_grads(False)
        ctx.autocast = autocast_state(cores[0].device.type)
        ctx.batch, ctx.whole = batch, whole
        if whole:  # (n, M, r) @ (n, r, N); the last factors are kept for the product's backward
            ctx.save_for_backward(*cores, *gates, *gated[:-1], *chain_a[:-1], *chain_b[:-1],
                                  chain_a[-1], chain_b[-1])
            return tuple(torch.bmm(chain_a[-1], chain_b[-1]).unbind(0))
        ctx.save_for_backward(*cores, *gates, *gated[:-1], *chain_a[:-1], *chain_b[:-1])
        return (*batch.a.split([chain_a[-1]]), *batch.b.split([chain_b[-1]]))

    @staticmethod
    def backward(ctx, *grads):
        with same_autocast(ctx.autocast):  # the products in the dtypes forward ran them in
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
        if ctx.whole:  # W = A B for every network: dA = dW B^T, dB = A^T dW, batched
            a_last, b_last = saved[-2:]
            if any(g is not None for g in grads):
                dw = torch.stack([a_last.new_zeros(a_last.shape[1], b_last.shape[2]) if g is None else g
                                  for g in grads])
                da, db = torch.bmm(dw, b_last.transpose(1, 2)), torch.bmm(a_last.transpose(1, 2), dw)
            grads = (*grads, *grads)  # a network used both of its factors, or neither
        else:
            if any(g is not None for g in grads[:n]):
                da = _stack_or_zeros(grads[:n], batch.a, gated[0])
            if any(g is not None for g in grads[n:]):
                db = _stack_or_zeros(grads[n:], batch.b, gated[0])
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
        return (None, None, *_network_grads(batch, [*d_cores, *d_gates], grads))


def _network_grads(batch: FactorBatch, stacked: Sequence[Tensor | None], grads: Sequence[Tensor | None]
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


class TritonFactors(torch.autograd.Function):
    """:class:`BatchedFactors` (thin factors only) of several batches at once on the Triton
    merge (:mod:`tncompile.runtime.triton.merge_factors`, a :class:`JointPlan`): each
    batch's cores and gates stacked into one joint workspace, then each step of both chains
    of every network of every batch in one launch -- a model's families of layers merge
    in a copy per batch and 2 launches forward, a copy per batch and 3 launches backward
    (networks of up to 3 + 3 cores), where PyTorch's ops take ~20 and ~30 per batch.

    Inputs: the batches, then each batch's tensors (:func:`_params` of its members, in
    order). Outputs: per batch, its members' ``A`` then their ``B``."""

    @staticmethod
    def forward(ctx, batches: tuple[FactorBatch, ...], *tensors: Tensor):
        key, joint = joint_plan([batch.merge[0] for batch in batches])
        work = tensors[0].new_empty(joint.work_size)
        outputs, start = [], 0
        for batch, plan, at in zip(batches, joint.parts, joint.work_at):
            own = work[at: at + plan.work_size]
            count = batch.n * (2 * batch.d - 1)
            batch.params.stack_into(own, tensors[start: start + count])
            start += count
        merge_forward(work, key)
        for batch, plan, at in zip(batches, joint.parts, joint.work_at):
            a, b = plan.factors(work[at: at + plan.work_size])
            outputs += [*batch.a.split([a]), *batch.b.split([b])]
        ctx.set_materialize_grads(False)
        ctx.batches, ctx.key = batches, key
        ctx.save_for_backward(work)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        batches, joint = ctx.batches, plan_of(ctx.key)
        (work,) = ctx.saved_tensors
        grad = work.new_empty(joint.grad_size)
        ends = list(itertools.accumulate(2 * batch.n for batch in batches))
        per_batch = [grads[end - 2 * batch.n: end] for batch, end in zip(batches, ends)]   # its A's, then its B's
        for batch, plan, at, mine in zip(batches, joint.parts, joint.grad_at, per_batch):
            incoming = grad[at: at + plan.incoming]
            if all(g is None for g in mine):   # a batch none of whose factors were used
                incoming.zero_()
            elif batch.a.equal and batch.b.equal and all(g is not None for g in mine):
                torch.cat([g.reshape(-1) for g in mine], out=incoming)
            else:
                da = _stack_or_zeros(mine[: batch.n], batch.a, work)
                db = _stack_or_zeros(mine[batch.n:], batch.b, work)
                torch.cat([da.reshape(-1), db.reshape(-1)], out=incoming)
        merge_backward(grad, work, ctx.key)
        out = [None]
        for batch, plan, at, mine in zip(batches, joint.parts, joint.grad_at, per_batch):
            out += _network_grads(batch, plan.network_grads(grad[at: at + plan.grad_size]), mine)
        return tuple(out)


def _triton_merges(batch: FactorBatch, like: Tensor) -> bool:
    """Whether ``batch`` merges on the Triton kernels (``tuning.TRITON_KERNELS``)."""
    return tuning.TRITON_KERNELS and runs_triton(like) and supports(batch.n_in, batch.d)


def _stack_or_zeros(grads: Sequence[Tensor | None], packing: _Packing, like: Tensor) -> Tensor:
    """The gradients of one factor stacked as ``packing`` stacks it, zeros for the
    factors that got none."""
    parts = [like.new_zeros(member[0]) if g is None else g for g, member in zip(grads, packing.shapes)]
    return packing.stack(parts)[0]


def _recorded_elsewhere() -> bool:
    """Inside activation checkpointing (saved-tensor hooks; its recomputation runs in a
    backward pass): a checkpointed region must record the same ops when it is run again,
    so its layers merge their own factors."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooked = True if top is None else top(False) is not None
    return hooked or torch._C._current_graph_task_id() != -1


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415 - only where a cache is filled

    return isinstance(t, FakeTensor)


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


def _family(layer: nn.Module) -> tuple | None:
    """What layers must share to be batched together -- their modes, core count, dtypes
    and device, not their ranks (``None``: this one cannot be batched)."""
    cores, gates = _params(layer)
    if not cores or len(gates) != len(cores) - 1 or not all(_is_plain(t) for t in cores + gates):
        return None
    return (len(layer.layout.in_modes), tuple(c.shape[1] for c in cores), cores[0].dtype, cores[0].device,
            *(t.dtype for t in gates))


def _batches(family: list[nn.Module]) -> list[list[nn.Module]]:
    """``family`` (in model order) split into batches whose zero padding stays within
    ``tuning.FACTOR_PAD_LIMIT`` (:meth:`FactorBatch.waste`): largest networks first, each
    into the first batch it fits, members kept in model order; batches of one dropped.
    Networks whose cores and gates differ in dtype batch at equal ranks only (padding
    packs every tensor into one buffer of one dtype)."""
    order = {id(m): i for i, m in enumerate(family)}
    cores, gates = _params(family[0])
    limit = tuning.FACTOR_PAD_LIMIT if len({t.dtype for t in cores + gates}) == 1 else 1.0
    size = {id(m): sum(c.numel() for c in _params(m)[0]) for m in family}
    batches: list[list[nn.Module]] = []
    for m in sorted(family, key=lambda m: -size[id(m)]):
        for batch in batches:
            if FactorBatch.of(batch + [m]).waste() <= limit:
                batch.append(m)
                break
        else:
            batches.append([m])
    return [sorted(b, key=lambda m: order[id(m)]) for b in batches if len(b) > 1]


def _freshness(layer: nn.Module, stamp: tuple) -> tuple:
    """What factors made for ``layer`` stay valid for: its cores and gates unchanged (their
    in-place versions and storages, :func:`_stamp`, the same
    :func:`~.derived.weights_epoch`: no optimizer step since, fused ones included), and
    the grad mode and autocast state they were made under."""
    marks = tuple((p._version, storage_address(p)) for group in _params(layer) for p in group)
    return marks, weights_epoch(), stamp, torch.is_grad_enabled(), autocast_state(stamp[3].type)


class FactorPeers:
    """The TT linears of one model whose merged factors are computed in batches (see the
    module doc). Shared by the layers (``layer._factor_peers``), which it refers to weakly
    (no reference cycle: a deleted model is freed at once); holds the factors made for
    layers that have not used them yet."""

    def __init__(self, layers: Iterable[nn.Module]):
        self._refs = [weakref.ref(m) for m in layers]
        self._ready: dict[int, tuple] = {}  # id(layer) -> (freshness, (A, B) or (W.T,))
        self._stamps: tuple | None = None   # the pad limit and the layers' _stamp when _groups was made
        self._groups: dict[int, tuple] = {}  # id(layer) -> (weak refs to its batch, itself included; FactorBatch)
        self._entries: list[tuple] = []      # each batch's entry of _groups once, in model order
        self.generation = 0  # counts regroupings (what layers' cached choices depend on)

    @property
    def layers(self) -> list[nn.Module]:
        """The linked layers still alive."""
        return [m for m in (r() for r in self._refs) if m is not None]

    def _group_of(self, layer: nn.Module) -> tuple[list[nn.Module], FactorBatch | None]:
        layers = self.layers
        stamps = (tuning.FACTOR_PAD_LIMIT, *(_stamp(m) for m in layers))
        if stamps != self._stamps:
            families: dict[tuple, list] = {}
            for m in layers:
                key = _family(m)
                if key is not None:
                    families.setdefault(key, []).append(m)
            self._groups, self._entries = {}, []
            for family in families.values():
                for batch in _batches(family):
                    entry = ([weakref.ref(m) for m in batch], FactorBatch.of(batch))
                    self._groups.update((id(m), entry) for m in batch)
                    self._entries.append(entry)
            self._stamps = stamps
            self.generation += 1
        refs, batch = self._groups.get(id(layer), ([], None))
        members = [r() for r in refs]
        return (members, batch) if all(m is not None for m in members) else ([], None)

    def factors(self, layer: nn.Module, whole: bool | Callable[[], bool] = False,
                strict: bool = True) -> tuple[Tensor, ...] | None:
        """``layer``'s ``(A, B)`` (see :meth:`~tncompile.runtime.TTLinear.merged_factors`),
        from its batch; ``None`` where batching does not apply (the layer then merges its
        own). ``whole``: its whole matrix ``(W.T,)`` (``(M, N)``, padded sizes) instead,
        when this call makes the batch (a callable: asked then only). Not ``strict``:
        whichever of the two its batch was made with (the first layer of a batch to ask
        decides for all of them); ``strict`` takes a bool."""
        if not tuning.GROUP_FACTORS or torch.compiler.is_compiling() or exporting() or _recorded_elsewhere():
            return None
        entry = self._ready.pop(id(layer), None)
        if entry is not None and entry[0] == _freshness(layer, _stamp(layer)) \
                and (not strict or (len(entry[1]) == 1) == whole):
            return entry[1]
        members, batch = self._group_of(layer)
        if not any(m is layer for m in members):
            return None
        whole = bool(whole()) if callable(whole) else whole
        tensors = [t for m in members for group in _params(m) for t in group]
        if not whole and _triton_merges(batch, tensors[0]):
            return self._triton_factors(layer, members, batch, tensors[0])
        return self._keep(layer, [(members, batch)], BatchedFactors.apply(batch, whole, *tensors), whole)

    def _triton_factors(self, layer: nn.Module, members: list[nn.Module], batch: FactorBatch, like: Tensor
                        ) -> tuple[Tensor, Tensor]:
        """``layer``'s factors from one Triton merge of every batch of this model that merges
        there on ``like``'s device and dtype (its own first), the others' kept for them."""
        groups = [(members, batch)]
        for refs, other in self._entries:
            if other is batch:
                continue
            others = [r() for r in refs]
            if all(m is not None for m in others):
                first = next(iter(others[0].cores._parameters.values()))
                if first.device == like.device and first.dtype == like.dtype and _triton_merges(other, first):
                    groups.append((others, other))
        tensors = [t for members, _ in groups for m in members for group in _params(m) for t in group]
        return self._keep(layer, groups, TritonFactors.apply(tuple(b for _, b in groups), *tensors), False)

    def _keep(self, layer: nn.Module, groups: list[tuple[list[nn.Module], FactorBatch]], out: Sequence[Tensor],
              whole: bool) -> tuple[Tensor, ...]:
        """``layer``'s part of ``out`` (per batch: its members' ``A`` then ``B``, or their
        ``W.T``), every other member's kept for it."""
        mine, start = None, 0
        for members, _ in groups:
            n = len(members)
            for i, m in enumerate(members):
                made = (out[start + i],) if whole else (out[start + i], out[start + n + i])
                if m is layer:
                    mine = made
                else:
                    self._ready[id(m)] = (_freshness(m, _stamp(m)), made)
            start += n if whole else 2 * n
        return mine

    def batch_of(self, layer: nn.Module) -> FactorBatch | None:
        """The :class:`FactorBatch` ``layer`` merges in (``None``: it merges alone)."""
        members, batch = self._group_of(layer)
        return batch if any(m is layer for m in members) else None

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


#: ``rule(layout, rows, device, batch) -> bool``: whether a batch merges into whole
#: matrices; registered by :mod:`tncompile.planning.speed_model`, which knows the devices'
#: speeds (this layer may not import it). Without one: never.
_WHOLE_RULE: list[Callable] = []


def register_whole_rule(rule: Callable[[object, int, torch.device, FactorBatch], bool]) -> None:
    """Set the rule :func:`whole_matrices_faster` asks (replacing any earlier one)."""
    _WHOLE_RULE[:] = [rule]


def whole_matrices_faster(layout, rows: int, device: torch.device, batch: FactorBatch) -> bool:
    """Whether ``batch``'s layers, over ``rows`` rows on ``device``, are estimated faster
    multiplying by their whole matrices than by two thin factors (the registered rule)."""
    return bool(_WHOLE_RULE) and bool(_WHOLE_RULE[0](layout, rows, device, batch))


def peers_of(layer: nn.Module) -> FactorPeers | None:
    """The :class:`FactorPeers` ``layer`` belongs to, if any."""
    return layer.__dict__.get("_factor_peers")


def merge_unit(layer: nn.Module) -> Hashable | None:
    """What ``layer``'s factors are computed with in one pass -- layers with equal units
    merge together, ``None`` merges alone: its batch, or on the Triton kernels every batch
    of its model that merges there (:meth:`FactorPeers._triton_factors`)."""
    peers = peers_of(layer)
    batch = peers.batch_of(layer) if peers is not None else None
    if batch is None:
        return None
    first = next(iter(layer.cores._parameters.values()))
    return (id(peers), first.device, first.dtype) if _triton_merges(batch, first) else id(batch)
