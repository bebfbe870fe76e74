"""The merged factors of many TT linears, computed together: one batched chain per family of modes.

A TT linear contracted merge-cores-first runs ``x -> x A -> (x A) B + b``, where ``A``
merges its gated input cores and ``B`` its output cores. Merging is weight-only work:
per layer and step about a dozen tiny products forward and backward, each one kernel. On
a GPU a kernel costs microseconds however small (the paper's six-encoder: about 430 of
the ~1,530 kernels of its step on an H200), and on any device each is a dispatched op.
So the layers of a model that share their modes merge in one batched pass
(:class:`~..kernels.factor_batch.BatchedFactors`: a few kernels per batch).

:class:`FactorPeers` links a model's TT linears (:func:`~.factor_links.link_factor_groups`,
called by ``compile``, ``load`` and swap mode). The first layer of a batch to ask for its
factors in a forward pass gets them computed for every layer of that batch; the others
take theirs. A layer's factors are used once, and never when its cores or gates may have
changed since (:func:`~.derived.weights_epoch`: any optimizer step, fused ones included),
or when made under another grad mode or autocast state. ``CompiledModel`` and swap-mode
models drop unused factors at each call, so a forward (and a CUDA-graph capture of one)
only ever uses factors made in it. When batching applies at all (not traced, not in
activation checkpointing, ``tuning.GROUP_FACTORS``) is :mod:`..ways.merge`'s.
"""
from __future__ import annotations

import weakref
from typing import Callable, Hashable, Iterable, Sequence

from torch import Tensor, nn

from .derived import storage_address, weights_epoch
from ..kernels.factor_batch import BatchedFactors, FactorBatch, network_params
from ..ways.merge import batches_apply, grouping_settings, made_under, merge_on_triton, pad_limit, triton_merges

__all__ = ["FactorPeers", "peers_of", "merge_unit", "FactorBatch", "BatchedFactors"]


def _is_plain(t: Tensor) -> bool:
    """A tensor batched products can stack: not a DTensor (an FSDP2 shard)."""
    return type(t).__name__ != "DTensor"


def _stamp(layer: nn.Module) -> tuple:
    """Changes whenever the layer's grouping may: a new layout (a cut), new parameter
    objects (FSDP2 swapping shards in and out), another dtype or device."""
    first = next(iter(layer.cores._parameters.values()))
    return id(layer.layout), id(first), first.dtype, first.device


def _family(layer: nn.Module) -> tuple | None:
    """What layers must share to be batched together -- their modes, core count, dtypes
    and device, not their ranks (``None``: this one cannot be batched)."""
    cores, gates = network_params(layer)
    if not cores or len(gates) != len(cores) - 1 or not all(_is_plain(t) for t in cores + gates):
        return None
    return (len(layer.layout.in_modes), tuple(c.shape[1] for c in cores), cores[0].dtype, cores[0].device,
            *(t.dtype for t in gates))


def _batches(family: list[nn.Module]) -> list[list[nn.Module]]:
    """``family`` (in model order) split into batches whose zero padding stays within
    the padding limit (:func:`~..ways.merge.pad_limit`, :meth:`FactorBatch.waste`): largest networks first, each
    into the first batch it fits, members kept in model order; batches of one dropped.
    Networks whose cores and gates differ in dtype batch at equal ranks only (padding
    packs every tensor into one buffer of one dtype)."""
    order = {id(m): i for i, m in enumerate(family)}
    cores, gates = network_params(family[0])
    limit = pad_limit({t.dtype for t in cores + gates})
    size = {id(m): sum(c.numel() for c in network_params(m)[0]) for m in family}
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
    marks = tuple((p._version, storage_address(p)) for group in network_params(layer) for p in group)
    return marks, weights_epoch(), stamp, made_under(stamp[3].type)


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
        stamps = (grouping_settings(), *(_stamp(m) for m in layers))
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
        if not batches_apply():
            return None
        entry = self._ready.pop(id(layer), None)
        if entry is not None and entry[0] == _freshness(layer, _stamp(layer)) \
                and (not strict or (len(entry[1]) == 1) == whole):
            return entry[1]
        members, batch = self._group_of(layer)
        if not any(m is layer for m in members):
            return None
        whole = bool(whole()) if callable(whole) else whole
        tensors = [t for m in members for group in network_params(m) for t in group]
        if not whole and triton_merges(batch, tensors[0]):
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
                if first.device == like.device and first.dtype == like.dtype and triton_merges(other, first):
                    groups.append((others, other))
        tensors = [t for members, _ in groups for m in members for group in network_params(m) for t in group]
        return self._keep(layer, groups, merge_on_triton(tuple(b for _, b in groups), tensors), False)

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
    return (id(peers), first.device, first.dtype) if triton_merges(batch, first) else id(batch)

