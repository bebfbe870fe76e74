"""FSDP2 (``fully_shard``) for compiled models, and rank cuts of sharded layers.

FSDP2 gathers a unit's parameters in a forward pre-hook of the modules it
was applied to, so units must be modules the graph *calls*. A compiled
model's graph calls the leaf layers of a transformer block (``layers.3.ff1``,
``layers.3.norm2``, ...), never the block container (``layers.3``) itself, so
:func:`shard` makes each block one unit from the modules its graph nodes use
(``fully_shard([...])``, FSDP2's grouped form), then the compiled model the
root unit for the rest.

A rank cut changes parameter shapes, which FSDP2 cannot do to sharded
parameters. :func:`gathered` therefore does gather -> cut -> reshard: every
sharded parameter and optimizer state is all-gathered into a full tensor,
FSDP2 is taken off the model, the caller cuts (the same code as without
FSDP2, from full gate tensors), and the model is sharded again by the plan
:func:`shard` recorded, with the optimizer's parameters and states moved onto
the new shards. :class:`~.controller.RankController` does this by itself
when it cuts a sharded model.

Taking FSDP2 off a module has no public PyTorch API; :func:`_unshard_for_good`
undoes what ``fully_shard`` set (hooks, state registry, class), relying on
the FSDP2 internals of the pinned torch, and fails with a clear message if
they change.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import re
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..result.model_api import is_compressed
from ..swap.swapped import is_swapped
from ..ir.modules import module_at
from ..runtime.layers.module_kinds import is_shard, is_sharded

__all__ = ["shard", "is_sharded", "full_tensor", "whole", "summed_over_shards", "gathered", "full_parameters", "block_units", "ShardPlan"]

_PLAN_KEY = "_tncompile_shard_plan"
_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # the outermost numbered container: layers.3, bert.encoder.layer.11


@dataclass
class ShardPlan:
    """How :func:`shard` sharded a compiled model, to shard it the same way after a cut.

    ``units`` is the policy (``"blocks"``, ``"root"``, or block name prefixes),
    resolved against the graph each time: a cut can remove layers.
    """

    units: str | list[str]
    mesh: Any
    kwargs: dict[str, Any] = field(default_factory=dict)


def _fsdp():
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError as exc:  # pragma: no cover - torch built without distributed
        raise RuntimeError(f"FSDP2 is not available in this torch build ({exc})") from exc
    return FSDPModule, fully_shard


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: an FSDP2 shard (``DTensor``) all-gathered, differentiably (its
    gradient flows back to the shard); any other tensor as it is."""
    return t.full_tensor() if is_shard(t) else t


def whole(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor whole, FSDP2 shards gathered in ONE all-gather (differentiably).

    The penalty reads every gate each step; one collective per gate would
    cost more than the step. The local dim-0 shards (``Shard(0)``, FSDP2's
    layout) are packed into one padded buffer per process, all-gathered, and
    cut back into whole tensors. Backward hands each process the gradient of
    its own rows only: every process computes the same function of the same
    whole tensors, so that is the exact gradient of its shard. Tensors that
    are not ``Shard(0)`` shards are gathered one by one (``full_tensor``).
    """
    if not any(map(is_shard, tensors)):  # the common case, every step of unsharded training: nothing to do
        return list(tensors)
    from torch.distributed.tensor import Shard
    packed = [i for i, t in enumerate(tensors) if is_shard(t) and tuple(t.placements) == (Shard(0),)]
    chosen = set(packed)
    out = [t if i in chosen else full_tensor(t) for i, t in enumerate(tensors)]  # the rest: one by one
    if not packed:
        return out
    mesh = tensors[packed[0]].device_mesh
    if any(tensors[i].device_mesh is not mesh for i in packed):
        return [full_tensor(t) for t in tensors]
    world, me = mesh.size(), mesh.get_local_rank()
    rows = [_chunk_rows(tensors[i].shape[0], world) for i in packed]
    width = [math.prod(tensors[i].shape[1:]) for i in packed]
    sent = [sum(r[rank] * w for r, w in zip(rows, width)) for rank in range(world)]
    locals_ = [tensors[i].to_local() for i in packed]
    for local, r, i in zip(locals_, rows, packed):
        if local.shape[0] != r[me]:
            return [full_tensor(t) for t in tensors]
    gathered = _GatherPacked.apply(mesh.get_group(), me, max(sent), sent[me], *locals_)
    parts = gathered.view(world, max(sent))
    for k, i in enumerate(packed):
        pieces = []
        for rank in range(world):
            start = sum(rows[j][rank] * width[j] for j in range(k))
            pieces.append(parts[rank, start:start + rows[k][rank] * width[k]])
        out[i] = torch.cat(pieces).view(tensors[i].shape)
    return out


def _chunk_rows(n: int, world: int) -> list[int]:
    """Rows of each process's ``Shard(0)`` piece: ``torch.chunk`` semantics, empty pieces last."""
    step = -(-n // world) if n else 0
    return [max(0, min(step, n - rank * step)) for rank in range(world)]


class _GatherPacked(torch.autograd.Function):
    """All-gather the concatenated local pieces (padded to ``length``); backward: this
    process's own segment of the gradient (every process computed the same function)."""

    @staticmethod
    def forward(ctx, group, me, length, mine, *locals_):
        ctx.me, ctx.length, ctx.shapes = me, length, [t.shape for t in locals_]
        buf = locals_[0].new_zeros(length)
        if mine:
            torch.cat([t.reshape(-1) for t in locals_], out=buf[:mine])
        out = buf.new_empty(length * dist.get_world_size(group))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.1x
        gather(out, buf, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        own = grad[ctx.me * ctx.length:(ctx.me + 1) * ctx.length]
        grads, start = [], 0
        for shape in ctx.shapes:
            n = shape.numel()
            grads.append(own[start:start + n].view(shape))
            start += n
        return (None, None, None, None, *grads)


def summed_over_shards(local_sums: torch.Tensor, group: Any) -> torch.Tensor:
    """``local_sums`` summed over the processes of ``group`` in one all-reduce;
    backward passes the gradient through unchanged (every process computed the
    same function of the total, so that is the gradient of its own part)."""
    return _SumOverShards.apply(local_sums, group)


class _SumOverShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_sums, group):
        total = local_sums.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def block_units(compiled: nn.Module) -> list[list[str]]:
    """Per repeated block, the names of the modules its graph calls.

    A block is the outermost numbered container a node's target lies in
    (``layers.3`` for ``layers.3.attention.query``). Its members are the
    graph module's ``call_module`` targets and the modules it passes by
    ``get_attr`` (a fused feed-forward's layers, which run their own forward
    once hooked): FSDP2 gathers a unit when its first member runs and frees it
    after the last. Modules the graph only reads a tensor of (``get_attr`` of
    an exported LayerNorm's weight) never run, so they are left to the root
    unit; otherwise the block would stay gathered until the root's forward
    ends. Blocks without parameters are left out. Names are relative to
    ``compiled.model``.

    A swap-mode model runs its own forward, which calls each block as a module:
    a block is then one unit, the block module itself.
    """
    if is_swapped(compiled):
        paths = sorted({found.group(1) for name in compiled.tensorized_modules()
                        if (found := _BLOCK.match(name + ".")) is not None},
                       key=lambda p: [int(t) if t.isdigit() else t for t in p.split(".")])
        return [[p] for p in paths if any(t.numel() for t in compiled.get_submodule(p).parameters())]
    gm = compiled.model
    blocks: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr") or not isinstance(attrgetter(node.target)(gm), nn.Module):
            continue
        found = _BLOCK.match(node.target + ".")
        if found is None:
            continue
        members = blocks.setdefault(found.group(1), [])
        if node.target not in members:
            members.append(node.target)
    return [[m for m in members if not _nested(m, members)]
            for members in blocks.values()
            if any(p.numel() for m in members for p in gm.get_submodule(m).parameters())]


def _nested(name: str, members: list[str]) -> bool:
    return any(name != other and name.startswith(other + ".") for other in members)


def _resolve_units(compiled: nn.Module, units: str | list[str]) -> list[list[str]]:
    if units == "root":
        return []
    if units == "blocks":
        return block_units(compiled)
    found = block_units(compiled)
    out = []
    for prefix in units:
        group = [m for block in found for m in block if m == prefix or m.startswith(prefix + ".")]
        if group:
            out.append(group)
    return out


def _check_units(compiled: nn.Module, units: Any) -> None:
    if units in ("blocks", "root"):
        return
    if not (isinstance(units, (list, tuple)) and all(isinstance(u, str) for u in units)):
        raise TypeError(f"shard: units must be 'blocks', 'root' or a list of block names like ['layers.0', "
                        f"'layers.1'], got {units!r}")
    names = dict(_tree(compiled).named_modules())
    unknown = [u for u in units if u not in names]
    if unknown:
        raise ValueError(f"shard: units {unknown[:3]} are not modules of the compiled model; block names look "
                         f"like {[b[0].rsplit('.', 1)[0] for b in block_units(compiled)][:3]}")


def shard(compiled: nn.Module, *, mesh: Any = None, units: str | list[str] = "blocks",
          optimizer: torch.optim.Optimizer | None = None, **fully_shard_kwargs: Any) -> nn.Module:
    """Apply FSDP2 (``torch.distributed.fsdp.fully_shard``) to a compiled model.

    Parameters
    ----------
    compiled : CompiledModel
        Not yet sharded; ``torch.distributed`` initialized.
    mesh : DeviceMesh, optional
        1-D data-parallel mesh; default: every process, on the parameters'
        device type (on meta: CUDA where available, else the CPU; then
        :func:`tncompile.materialize` the sharded model).
    units : "blocks" | "root" | list of str
        ``"blocks"``: one unit per repeated block (:func:`block_units`: the
        modules its graph nodes use, grouped), then the root; ``"root"``: the
        whole model one unit; a list: those blocks (``["layers.0", ...]``).
    optimizer : torch.optim.Optimizer, optional
        An optimizer already built over the plain parameters (e.g. after
        :func:`tncompile.resume`): its parameters and states move onto the
        shards. Otherwise build the optimizer after sharding, as usual with FSDP2.
    **fully_shard_kwargs
        Passed to every ``fully_shard`` call (``reshard_after_forward``,
        ``mp_policy``, ...), now and after each cut.

    Returns
    -------
    The same object, now an FSDP2 module (as ``fully_shard`` returns it).
    Rank cuts by :class:`~tncompile.RankController` gather, cut and reshard
    it by the same plan; save it with
    :func:`tncompile.distributed.save_on_rank0`.
    """
    if not is_compressed(compiled):
        raise TypeError(f"shard expects the model tncompile.compile returned, got {type(compiled).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group(...) first (torchrun sets the environment)")
    if is_sharded(compiled):
        raise ValueError("shard: the model is already sharded (fully_shard was applied); shard a compiled model "
                         "once, through tncompile.distributed.shard, so that cuts can re-shard it")
    _check_units(compiled, units)
    _check_kwargs(fully_shard_kwargs)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = next(compiled.parameters()).device.type
        if device == "meta":   # compiled on meta, materialized after sharding: where it will train
            device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    plan = ShardPlan(units=units if isinstance(units, str) else list(units), mesh=mesh,
                     kwargs=dict(fully_shard_kwargs))
    before = _named_params(compiled)
    _apply(compiled, plan)
    compiled.__dict__[_PLAN_KEY] = plan
    if optimizer is not None:
        _move_optimizer(optimizer, before, _named_params(compiled), _to_shard)
    return compiled


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse keyword arguments ``fully_shard`` does not take before anything is sharded."""
    _, fully_shard = _fsdp()
    accepted = [n for n in inspect.signature(fully_shard).parameters if n not in ("module", "mesh")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"shard: fully_shard takes no {unknown}; its keyword arguments are {accepted} "
                        "(and mesh=, which shard takes itself)")


def _apply(compiled: nn.Module, plan: ShardPlan) -> None:
    _, fully_shard = _fsdp()
    if _outputs_not_views not in compiled._forward_hooks.values():  # runs before FSDP's own post-forward hook
        compiled.register_forward_hook(_outputs_not_views)
    gm = _tree(compiled)
    for group in _resolve_units(compiled, plan.units):  # bottom-up: blocks first, then the root
        fully_shard([gm.get_submodule(name) for name in group], mesh=plan.mesh, **plan.kwargs)
    fully_shard(compiled, mesh=plan.mesh, **plan.kwargs)


def _tree(compiled: nn.Module) -> nn.Module:
    """Where unit names point: a CompiledModel's graph module, a swap-mode model itself."""
    return compiled if is_swapped(compiled) else compiled.model


def _outputs_not_views(module: nn.Module, args: Any, output: Any) -> Any:
    """The root's outputs as tensors of their own: FSDP2 hooks backward onto the output,
    and an in-place op on a view of it would drop that hook (FSDP2 warns of it)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t, output)


def _sharded_params(compiled: nn.Module) -> dict[tuple[str, str], nn.Parameter]:
    """:func:`_named_params` with every unit resharded first, so that they are the shards
    (a root keeps its gathered parameters registered after a forward without backward)."""
    FSDPModule, _ = _fsdp()
    for unit in compiled.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    return _named_params(compiled)


def _named_params(model: nn.Module) -> dict[tuple[str, str], nn.Parameter]:
    """Every registered parameter by (owning module's name, parameter name), shared ones under each owner."""
    return {(mod_name, name): p for mod_name, mod in model.named_modules(remove_duplicate=False)
            for name, p in mod._parameters.items() if p is not None}


# ------------------------------------------------------------------ gather -> cut -> reshard
@contextlib.contextmanager
def gathered(compiled: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[nn.Module]:
    """Inside the block ``compiled`` is a plain model with full parameters;
    on leaving it, it is sharded again by its plan (even after shapes changed).

    Every process must enter it together (all-gathers). ``optimizer``'s
    parameters and states follow: full inside, shards after. Grads are dropped
    (a cut comes after ``optimizer.step()``). Does nothing to an unsharded model.
    """
    plan = compiled.__dict__.get(_PLAN_KEY)
    if not is_sharded(compiled):
        yield compiled
        return
    if plan is None:
        raise NotImplementedError(
            "the model was sharded with fully_shard directly, so tncompile cannot re-shard it after a rank cut. "
            "Shard it with tncompile.distributed.shard(compiled, units='blocks' or 'root', **fully_shard_kwargs), "
            "or train without cuts (early_steps=None, truncate_every=0).")
    before = _sharded_params(compiled)
    full = _gather_all(before)
    _unshard_for_good(compiled)
    for (mod_name, name), p in full.items():
        module_at(compiled, mod_name)._parameters[name] = p
    if optimizer is not None:
        _move_optimizer(optimizer, before, full, _states_in_full(optimizer))
    try:
        yield compiled
    finally:
        after_cut = _named_params(compiled)
        _apply(compiled, plan)
        if optimizer is not None:
            _move_optimizer(optimizer, after_cut, _named_params(compiled), _to_shard)


def _gather_all(params: dict[tuple[str, str], nn.Parameter]) -> dict[tuple[str, str], nn.Parameter]:
    """Full plain parameters for FSDP2's shards (all in one packed all-gather, :func:`whole`),
    keeping shared parameters shared."""
    unique = list({id(p): p for p in params.values()}.values())
    with torch.no_grad():
        full = whole(unique)
    done = {id(p): nn.Parameter(f.detach().clone(), requires_grad=p.requires_grad) for p, f in zip(unique, full)}
    return {key: done[id(p)] for key, p in params.items()}


def _states_in_full(optimizer: torch.optim.Optimizer) -> Callable[[Any, torch.Tensor], Any]:
    """A converter to full tensors for :func:`_move_optimizer`, with every sharded state of
    ``optimizer`` gathered up front in one packed all-gather (the same order on every process)."""
    values = [v for state in optimizer.state.values() for v in state.values() if is_shard(v)]
    with torch.no_grad():
        gathered = {id(v): f for v, f in zip(values, whole(values))}
    return lambda value, param: gathered.get(id(value), value)


def _to_shard(value: Any, param: torch.Tensor) -> Any:
    """An optimizer state laid out like ``param``'s shard (no communication: the full
    value is the same on every process)."""
    if is_shard(param) and isinstance(value, torch.Tensor) and not is_shard(value) and value.shape == param.shape:
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


def _move_optimizer(optimizer: torch.optim.Optimizer, old: dict, new: dict,
                    convert: Callable[[Any, torch.Tensor], Any]) -> None:
    """Point ``optimizer`` at ``new[key]`` where it held ``old[key]``, converting each state tensor."""
    swap = {id(old[k]): new[k] for k in old if k in new}
    for group in optimizer.param_groups:
        group["params"][:] = [swap.get(id(p), p) for p in group["params"]]  # in place: LBFGS keeps an alias
    for old_p in [p for p in list(optimizer.state) if id(p) in swap]:
        new_p = swap[id(old_p)]
        state = optimizer.state.pop(old_p)
        optimizer.state[new_p] = {k: convert(v, new_p) for k, v in state.items()}
    if hasattr(optimizer, "_numel_cache"):
        optimizer._numel_cache = None


def _unshard_for_good(compiled: nn.Module) -> None:
    """Undo ``fully_shard`` on every unit of ``compiled`` (parameters are replaced by the caller).

    FSDP2 has no public inverse; this removes what ``fully_shard`` installed:
    the forward hooks, the composable-state registry entries and the ``FSDP*``
    class. Relies on torch's FSDP2 internals (checked, with a clear error)."""
    FSDPModule, fully_shard = _fsdp()
    try:
        contract_mod = importlib.import_module("torch.distributed._composable.contract")
        from torch.distributed._composable_state import _module_state_mapping
        contract_mod.STATE_KEY, contract_mod.REGISTRY_KEY  # noqa: B018  (checked here, used below)
    except (ImportError, AttributeError) as exc:  # pragma: no cover - a torch whose FSDP2 internals moved
        raise NotImplementedError(f"cutting FSDP2-sharded layers needs FSDP2 internals this torch "
                                  f"({torch.__version__}) does not have ({exc}); train cuts under DDP") from exc
    units = [m for m in compiled.modules() if isinstance(m, FSDPModule)]
    states = {id(s): s for s in (u._get_fsdp_state() for u in units)}.values()
    for state in states:
        for handle in {id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)}.values():
            handle.remove()
        for module in state._modules:
            _module_state_mapping.pop(module, None)
            all_state = module.__dict__.get(contract_mod.STATE_KEY, {})
            for key in [k for k, v in all_state.items() if v is state]:
                del all_state[key]
            module.__dict__.get(contract_mod.REGISTRY_KEY, {}).pop("fully_shard", None)
    for unit in units:
        unit.__class__ = next(b for b in type(unit).__bases__ if b is not FSDPModule)
    for module in compiled.modules():
        for flag in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(flag, None)


# ------------------------------------------------------------------ read-only full view (saving)
@contextlib.contextmanager
def full_parameters(compiled: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[nn.Module]:
    """Inside the block ``compiled`` shows full plain parameters and plain
    classes (and ``optimizer`` full states), for reading -- e.g. saving; on
    leaving, the very same shards, classes and states are back. Every process
    must enter it together (all-gathers). Nothing may train inside it."""
    if not is_sharded(compiled):
        yield compiled
        return
    FSDPModule, _ = _fsdp()
    params = _sharded_params(compiled)
    full = _gather_all(params)
    classes = {m: type(m) for m in compiled.modules() if isinstance(m, FSDPModule)}
    hidden: dict[nn.Module, dict[str, Any]] = {}
    saved_groups = [list(g["params"]) for g in optimizer.param_groups] if optimizer is not None else []
    saved_state = dict(optimizer.state) if optimizer is not None else {}
    try:
        for (mod_name, name), p in full.items():
            module_at(compiled, mod_name)._parameters[name] = p
        for module, cls in classes.items():
            module.__class__ = next(b for b in cls.__bases__ if b is not FSDPModule)
        for module in compiled.modules():
            hidden[module] = _hide_fsdp_entries(module)
        if optimizer is not None:
            _move_optimizer(optimizer, params, full, _states_in_full(optimizer))
        yield compiled
    finally:
        for (mod_name, name), p in params.items():
            module_at(compiled, mod_name)._parameters[name] = p
        for module, cls in classes.items():
            module.__class__ = cls
        for module, entries in hidden.items():
            module.__dict__.update(entries)
        if optimizer is not None:
            for group, kept in zip(optimizer.param_groups, saved_groups):
                group["params"][:] = kept
            optimizer.state.clear()
            optimizer.state.update(saved_state)


def _hide_fsdp_entries(module: nn.Module) -> dict[str, Any]:
    """Take what ``fully_shard`` put in ``module.__dict__`` out of it (its state
    registry, flags, and its hooks from hook dicts); returns what to put back."""
    contract_mod = importlib.import_module("torch.distributed._composable.contract")
    kept: dict[str, Any] = {}
    for key in (contract_mod.STATE_KEY, contract_mod.REGISTRY_KEY, "_is_fsdp_managed_module",
                "_fsdp_use_orig_params"):
        if key in module.__dict__:
            kept[key] = module.__dict__.pop(key)
    hook_dicts = {k: v for k, v in module.__dict__.items() if "hook" in k and isinstance(v, dict)}
    ids = {i for v in hook_dicts.values() for i, h in v.items() if _is_fsdp_hook(h)}  # incl. their flag dicts
    for key, value in hook_dicts.items():
        if ids & set(value):
            kept[key] = value
            module.__dict__[key] = type(value)((k, h) for k, h in value.items() if k not in ids)
    return kept


def _is_fsdp_hook(hook: Any) -> bool:
    """FSDP2's hooks, and ours that goes with it."""
    return hook is _outputs_not_views or (getattr(hook, "__module__", None) or "").startswith("torch.distributed.")
