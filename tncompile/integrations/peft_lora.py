"""PEFT LoRA on compressed layers: QLoRA's recipe with a tensor train in place of 4-bit.

PEFT's ordinary calls work on a compressed model: with PEFT imported, tncompile registers
how PEFT wraps a :class:`~tncompile.runtime.TTLinear` (:func:`register_with_peft`, as the
HF quantizer registers with transformers), so ``get_peft_model``, training,
``save_pretrained`` of the adapters, ``PeftModel.from_pretrained`` and ``merge_and_unload``
need nothing more::

    peft_model = peft.get_peft_model(compressed, peft.LoraConfig(target_modules=["query", "value"]))
    ...train...; peft_model.save_pretrained("adapters")
    again = peft.PeftModel.from_pretrained(compressed_again, "adapters")
    merged = again.merge_and_unload()          # exact: the same outputs

Every config that reaches a TT layer goes through :func:`tt_lora` first (module names plain,
ranks bounded; calling it yourself checks a config before PEFT matches any name).

:class:`TTLoraLinear` is PEFT's LoRA ``Linear`` around the network: ``y = TT(x) + s B A x``.
Merging (``merge_adapter``, ``merge_and_unload``) folds ``s B A`` into the network
**exactly**: at the ranks that hold ``W + s B A`` (each bond's unfolding rank: the bond
between input and output cores grows by at most ``r``, the adapter's rank; bonds inside one
side may grow to their bounds) -- the adapter becomes extra rank, and the layer may grow.
tncompile's :func:`merge_and_unload` with ``exact=False`` keeps each layer within its ranks
grown by ``r`` instead: exact where that holds the matrix, else a refit at the grown ranks
-- to the matrix (TT-SVD), or, with calibration inputs, to the layer's outputs on them
(:func:`tncompile.calibration.layer_fit.fit_linear_cores`). Each merge's
:class:`MergeResult` says which happened and the error; an inexact merge warns.
``unmerge`` restores the network exactly as it was.

The other way round works too: ``tncompile.compile(peft_model, ...)`` compresses the layers
under the adapters and keeps them (:mod:`tncompile.swap.adapters`); this module registers
how PEFT's LoRA ``Linear`` carries on over a network, and is imported for that whenever
PEFT is (:mod:`tncompile.integrations.plugins`).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from peft.tuners.lora.config import LoraConfig  # submodules: this is imported inside peft's own import
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import check_adapters_to_merge

from ..calibration.layer_fit import fit_linear_cores
from ..errors import ModelFileError, check_int
from ..formats.factorization import linear_unfolding_ranks, tt_from_linear_weight, tt_to_dense
from ..passes.replan import replan_module
from ..runtime import TTLinear
from ..runtime.layers import TNModule
from ..swap.adapters import register_adapter_wrapper

__all__ = ["tt_lora", "TTLoraLinear", "MergeResult", "merge_and_unload", "register_with_peft", "EXACT"]

#: relative error of the merged matrix below which a merge counts as exact
EXACT = 1e-6


def tt_lora(config: LoraConfig) -> LoraConfig:
    """``config`` with tncompile's TT linears registered as LoRA targets (PEFT's
    custom-module mechanism); returns the same config, for use inline."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"tt_lora: expected a peft.LoraConfig, got {type(config).__name__}")
    if config.use_dora:
        raise ValueError("tt_lora: use_dora=True is not supported on TT layers (DoRA rescales the columns of a "
                         "dense weight); use plain LoRA")
    if config.fan_in_fan_out:
        raise ValueError("tt_lora: fan_in_fan_out=True describes a [in, out] weight; a TTLinear is [out, in]: "
                         "leave it False")
    _check_config(config)
    config._register_custom_module({TTLinear: TTLoraLinear})
    return config


#: the largest adapter rank tt_lora takes (each layer also bounds it by its own sides)
MAX_ADAPTER_RANK = 4096
#: a name PEFT may put into a regular expression: letters, digits, ``_ . -`` (no quantifier,
#: group or alternation, so no pattern that backtracks for ever)
PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,256}$")


def _check_config(config: LoraConfig) -> None:
    """What PEFT would match or allocate from ``config`` (which may come from an adapter
    folder's ``adapter_config.json``), bounded before PEFT sees it: module names are plain
    names or suffixes (PEFT runs a string as a regular expression: ``(.|.)*Q`` never ends),
    ranks are ints in ``[1, MAX_ADAPTER_RANK]`` (and within each layer, checked as it is
    wrapped). A ``ModelFileError`` (a ``ValueError``) naming the field and the fix."""
    def plain(value: Any, field: str, many: bool) -> None:
        values = [value] if isinstance(value, str) else list(value) if many and isinstance(value, (list, set, tuple)) \
            else None
        if values is None or len(values) > 100_000 or not all(isinstance(v, str) and PLAIN_NAME.match(v) for v in values):
            raise ModelFileError(f"tt_lora: LoraConfig {field}={value!r:.120} is not a list of module names or suffixes "
                                 "(PEFT would run a string as a regular expression, which may never end): list the "
                                 "names, e.g. target_modules=['query', 'value']")
    if isinstance(config.target_modules, str) and config.target_modules != "all-linear":
        plain(config.target_modules, "target_modules", False)
    elif config.target_modules is not None and config.target_modules != "all-linear":
        plain(config.target_modules, "target_modules", True)
    for field in ("exclude_modules", "modules_to_save", "layers_pattern"):
        if getattr(config, field, None):
            plain(getattr(config, field), field, True)
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = getattr(config, field, None) or {}
        if not isinstance(pattern, dict):
            raise ModelFileError(f"tt_lora: LoraConfig {field} must be a dict of module names to ints")
        plain(list(pattern), f"{field} keys", True)
        for key, value in pattern.items():
            check_int(value, f"tt_lora: LoraConfig {field}[{key!r}]", 1, MAX_ADAPTER_RANK if field == "rank_pattern"
                      else 2**31, error=ModelFileError)
    check_int(config.r, "tt_lora: LoraConfig r", 1, MAX_ADAPTER_RANK, error=ModelFileError)


@dataclass
class MergeResult:
    """One adapter folded into one network.

    Attributes
    ----------
    ranks_before, ranks_after : tuple of int
    exact : bool
        The merged network equals ``W + s B A`` to ``EXACT`` relative error.
    weight_error : float
        ``|TT' - (W + s B A)| / |W + s B A|`` (Frobenius).
    output_error : float or None
        With calibration inputs: the relative error of the layer's outputs on them.
    """

    adapter: str
    ranks_before: tuple[int, ...]
    ranks_after: tuple[int, ...]
    exact: bool
    weight_error: float
    output_error: float | None = None


class TTLoraLinear(LoraLinear):
    """PEFT's LoRA ``Linear`` around a :class:`TTLinear` (see the module doc).

    Shapes
    ------
    input ``(..., in_features)`` -> output ``(..., out_features)``.
    """

    def __init__(self, base_layer: torch.nn.Module, adapter_name: str, config: LoraConfig, **kwargs: Any):
        rank, side = kwargs.get("r", config.r), min(base_layer.in_features, base_layer.out_features)
        check_int(rank, f"LoRA rank of adapter {adapter_name!r} on a TT layer of {base_layer.in_features} -> "
                        f"{base_layer.out_features} features", 1, side, error=ModelFileError)  # before PEFT allocates
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.merge_results: list[MergeResult] = []
        self.calibration_moment: torch.Tensor | None = None  # set by merge_and_unload(calibration=...)
        self.merge_exactly = True  # merge_and_unload(exact=False) refits at ranks + r instead
        self._before_merge: dict[str, tuple] = {}

    def _get_in_out_features(self, module: torch.nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer: torch.nn.Module):
        weight = base_layer.weight  # a NetworkMatrix: its device and dtype without making it
        return weight.device, weight.dtype

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Fold each adapter into the network (see the module doc); ``safe_merge`` checks
        the merged network is finite before putting it in."""
        for name in check_adapters_to_merge(self, adapter_names):
            if name not in self.lora_A:
                continue
            layer = self.get_base_layer()
            self._before_merge[name] = _network_state(layer)
            result = _fold(layer, self.get_delta_weight(name), self.r[name], name, self.calibration_moment,
                           safe_merge, self.merge_exactly)
            if self.lora_bias[name]:
                if layer.bias is None:
                    raise RuntimeError("LoRA with lora_bias=True cannot merge into a layer without a bias")
                with torch.no_grad():
                    layer.bias.add_(self.lora_B[name].bias * self.scaling[name])
            self.merge_results.append(result)
            self.merged_adapters.append(name)
            if not result.exact:
                warnings.warn(f"LoRA merge of adapter {name!r} into a TT layer: ranks {result.ranks_before} -> "
                              f"{result.ranks_after} hold the merged matrix to relative error "
                              f"{result.weight_error:.2e} (not exact: a refit); merge with calibration inputs "
                              "(tncompile.integrations.peft_lora.merge_and_unload) to fit the outputs instead",
                              RuntimeWarning, stacklevel=2)

    def unmerge(self) -> None:
        """Put each merged adapter's network back exactly as it was before merging."""
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            layer = self.get_base_layer()
            _restore_network(layer, self._before_merge.pop(name))
            if self.lora_bias.get(name):
                with torch.no_grad():
                    layer.bias.sub_(self.lora_B[name].bias * self.scaling[name])

    def __repr__(self) -> str:
        return "lora.TT" + super().__repr__()[len("lora."):]


def _network_state(layer: TTLinear) -> tuple:
    return (layer.layout, [p.detach().clone() for p in layer.cores._parameters.values()],
            [g.detach().clone() for g in layer.gates._parameters.values()])


def _restore_network(layer: TTLinear, state: tuple) -> None:
    _put_network(layer, *state)


def _put_network(layer: TTLinear, layout, cores: list[torch.Tensor], gates: list[torch.Tensor] | None = None) -> None:
    """``layer``'s network becomes ``layout`` with ``cores`` (new parameters; gates ``gates``,
    or one), planned afresh."""
    first = next(iter(layer.cores._parameters.values()))
    layer._init_params(layout, first.device, first.dtype)
    layer.set_cores([c.to(first.dtype) for c in cores])
    if gates is not None:
        with torch.no_grad():
            for g, v in zip(layer.gates._parameters.values(), gates):
                g.copy_(v)
    replan_module(layer, force=True)


def _fold(layer: TTLinear, delta: torch.Tensor, lora_rank: int, name: str, moment: torch.Tensor | None,
          safe: bool, exact: bool = False) -> MergeResult:
    """Put ``layer.weight() + delta`` into the network: at the ranks that hold it exactly
    when those cost no more parameters than the ranks grown by ``lora_rank`` (or always,
    with ``exact``); else refit at the grown ranks (see the module doc)."""
    with torch.no_grad():
        target = layer.weight().detach().to(torch.float64) + delta.detach().to(torch.float64)
    layout = layer.layout
    grown = layout.with_ranks(tuple(min(b, r + lora_rank) for r, b in zip(layout.ranks, layout.rank_bounds())))
    holding = layout.with_ranks(linear_unfolding_ranks(target, layout))
    output_error = None
    if exact or holding.num_params() <= grown.num_params():
        new, cores = holding, tt_from_linear_weight(target, holding)
    elif moment is not None:
        fit = fit_linear_cores(target, grown, moment)
        new, cores, output_error = grown, fit.cores, fit.fit_error
    else:
        new, cores = grown, tt_from_linear_weight(target, grown)
    with torch.no_grad():
        error = float((tt_to_dense(cores, new) - target).norm() / target.norm().clamp_min(1e-300))
    if safe and not all(bool(torch.isfinite(c).all()) for c in cores):
        raise ValueError(f"NaNs in the merged network of adapter {name!r}: the adapter seems broken")
    _put_network(layer, new, cores)
    return MergeResult(name, tuple(layout.ranks), tuple(new.ranks), error <= EXACT, error, output_error)


def merge_and_unload(peft_model: torch.nn.Module, calibration: Iterable[Any] | None = None, *,
                     exact: bool = True) -> tuple[torch.nn.Module, list[MergeResult]]:
    """``peft_model.merge_and_unload()`` that also says how each TT layer merged.

    Parameters
    ----------
    calibration : iterable, optional
        Batches to call the model on (dicts of keyword arguments, tuples of positional
        ones, or single tensors): a merge that is not exact fits the layer's outputs on
        them instead of its matrix.
    exact : bool
        ``True`` (the default, and what PEFT's own ``merge_and_unload`` does): merge every
        adapter exactly, at whatever ranks that takes (within the layout's bounds; the model
        may grow). ``False``: keep each layer within its ranks grown by the adapter's rank,
        refitting where the exact merge would cost more (to ``calibration``'s outputs when
        given), and warn with the error.

    Returns
    -------
    model : the base model, adapters merged into its networks
    results : one :class:`MergeResult` per adapter per TT layer
    """
    wrapped = [m for m in peft_model.modules() if isinstance(m, TTLoraLinear)]
    if calibration is not None:
        _collect_moments(peft_model, wrapped, calibration)
    for m in wrapped:
        m.merge_exactly = exact
    try:
        # PEFT's own merge_and_unload, not merge_adapter() then unload(): since PEFT 0.22
        # unload() hands back the original copies of modules_to_save (a classifier head
        # trained beside the adapters), merge_and_unload() the trained ones
        model = peft_model.merge_and_unload()
    finally:
        for m in wrapped:
            m.calibration_moment, m.merge_exactly = None, True
    results = [r for m in wrapped for r in m.merge_results]
    return model, results


def _collect_moments(model: torch.nn.Module, layers: list[TTLoraLinear], batches: Iterable[Any]) -> None:
    sums: dict[int, list] = {id(m): [None, 0] for m in layers}

    def record(module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
        entry = sums[id(module)]
        entry[0] = x.t() @ x if entry[0] is None else entry[0] + x.t() @ x
        entry[1] += x.shape[0]
    hooks = [m.register_forward_pre_hook(record) for m in layers]
    try:
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, dict):
                    model(**batch)
                elif isinstance(batch, (tuple, list)):
                    model(*batch)
                else:
                    model(batch)
    finally:
        for h in hooks:
            h.remove()
    for m in layers:
        total, rows = sums[id(m)]
        if rows == 0:
            raise ValueError("merge_and_unload(calibration=...): the batches never reached a LoRA-wrapped TT layer")
        m.calibration_moment = total / rows


def _check_adoptable(path: str, wrapper: LoraLinear) -> None:
    if any(wrapper.use_dora.values()):
        raise TypeError(f"tncompile.compile: the adapter at {path!r} uses DoRA, which rescales the columns of a "
                        "dense weight; merge it first (peft_model.merge_and_unload()) and compile the result")


def _adopt(wrapper: LoraLinear) -> None:
    """PEFT's LoRA ``Linear`` whose base layer ``compile`` turned into a TT network becomes a
    :class:`TTLoraLinear` (the same adapters; merges fold into the network). The network
    takes ``[out, in]`` orientation whatever the dense layer had (GPT-2's ``Conv1D``)."""
    wrapper.__class__ = TTLoraLinear
    wrapper.fan_in_fan_out = False
    wrapper.merge_results, wrapper.calibration_moment = [], None
    wrapper.merge_exactly, wrapper._before_merge = True, {}


def register_with_peft() -> None:
    """PEFT's ordinary calls on a compressed model -- ``get_peft_model(model, LoraConfig(...))``,
    ``PeftModel.from_pretrained(model, folder)`` -- wrap its TT linears without ``tt_lora``:
    where PEFT makes a LoRA layer for a target whose base is a :class:`TTLinear`, the config
    is checked (:func:`tt_lora`) and the TT layer registered on it first. Configs of other
    models are untouched. Called once, when PEFT imports its LoRA model (:mod:`.plugins`)."""
    from peft.tuners.lora.model import LoraModel  # here: called inside peft's own import
    create = LoraModel.__dict__["_create_new_module"].__func__
    if getattr(create, "_tncompile", False):
        return

    def create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if hasattr(target, "get_base_layer") else target
        if isinstance(base, TTLinear) and TTLinear not in (lora_config._custom_modules or {}):
            tt_lora(lora_config)
        return create(lora_config, adapter_name, target, **kwargs)
    create_new_module._tncompile = True
    LoraModel._create_new_module = staticmethod(create_new_module)
    replace = LoraModel._create_and_replace

    def create_and_replace(self, lora_config, adapter_name, target, target_name, parent, current_key, *args,
                           parameter_name=None, **kwargs):
        if parameter_name is not None and (isinstance(target, TNModule) or isinstance(parent, TNModule)):
            raise ModelFileError(f"LoRA on the parameter {current_key}.{parameter_name} (target_parameters): it is a "
                                 "core or gate of a compressed layer, which PEFT's parameter adapters cannot wrap; "
                                 "target the layer itself instead (target_modules=[...]), as tt_lora does")
        return replace(self, lora_config, adapter_name, target, target_name, parent, current_key, *args,
                       parameter_name=parameter_name, **kwargs)
    LoraModel._create_and_replace = create_and_replace
    _include_tt_linears_in_all_linear()


def _include_tt_linears_in_all_linear() -> None:
    """``target_modules="all-linear"`` on a compressed model targets its TT linears too (PEFT
    collects ``nn.Linear`` and ``Conv1D`` modules by type, which a TT linear is not; the
    output layer PEFT leaves out stays out). Wraps PEFT's helper where this PEFT has it."""
    from peft.tuners import tuners_utils
    collect = getattr(tuners_utils, "_maybe_include_all_linear_layers", None)
    if collect is None or getattr(collect, "_tncompile", False):
        return

    def with_tt_linears(peft_config, model):
        asked = isinstance(getattr(peft_config, "target_modules", None), str) \
            and peft_config.target_modules.lower() == "all-linear"
        out = collect(peft_config, model)
        if asked and isinstance(out.target_modules, (set, list)):
            output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            out.target_modules = {*out.target_modules, *(name for name, m in model.named_modules()
                                                          if isinstance(m, TTLinear) and m is not output)}
        return out
    with_tt_linears._tncompile = True
    tuners_utils._maybe_include_all_linear_layers = with_tt_linears


# tncompile.compile of a model carrying LoRA adapters keeps them over the compressed layers
register_adapter_wrapper(LoraLinear, _adopt, _check_adoptable)
