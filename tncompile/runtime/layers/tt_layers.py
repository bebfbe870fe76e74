"""Trainable TT / TTM layers: ``TTLinear``, ``TTMEmbedding`` and ``TTMTiedLinear``.

Each layer holds its cores, one rank-gate vector per internal bond (all ones
until rank adaptation trains them) and, for linears, a bias. The gates scale
the right-hand bond of their core, so the network computes exactly the matrix
``tt_to_dense(scaled_cores())``. A forward pass runs the plan of its bucket
of rows (:mod:`.plans`; a plan the ``plan_contractions`` pass made, or one the
registered planner makes on first use) through the planned executor, or, over
a few rows, the native chain op.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .network_matrix import NetworkMatrix
from ... import tuning
from ...formats.decompose import (random_cores, tt_factors, tt_from_linear_weight, tt_to_dense,
                                 ttm_from_embedding_weight, ttm_to_dense)
from ...formats.indices import planner_problem
from ...formats.layout import TTLayout, TTMLayout
from .module_kinds import linear_weight_of
from ..kernels.cpu_allocator import _state as _ALLOCATOR_STATE
from ..kernels.cpu_allocator import ensure_retained
from .derived import advance_weights_epoch, kept
from . import lookup_ways
from .linear_ways import LinearWay, choice_cache, decide_call, decide_rows, record
from ..kernels.executor import autocast_state, contract, is_merge_first, same_autocast, thin_pair
from .factor_groups import whole_matrices_faster
from ..kernels.gated_cores import gate_cores
from ..kernels.plans import ContractionPlan, LookupPlan, bucket_of, get_planner
from ..kernels.traced_contract import register
from ..kernels.tracing import exporting
from ..kernels.traced_lookup import (check_ids, distinct_ids, gathered_product, gathered_product_backward, half_tables,
                            split_ids, ttm_lookup)
from .tied_head import best_split, half_table_head, head_halves
from ..kernels.tt_chain import tt_chain
from ..triton import runs_triton, thin_pair_train
from ..triton.thin_pair import activate, activation_code
from ..triton.merge_factors import merge_backward, merge_forward, merge_plan, plan_of
from ..triton.ttm_lookup import lookup_table, ttm_gather, ttm_scatter_

__all__ = ["TTLinear", "TTMEmbedding", "TTMTiedLinear", "TNModule", "linear_weight_of", "tied_merge_macs"]

INITS = ("svd", "random")


def _resolve_layout(layout, make, rank, dense_shape):
    """The given layout (or a balanced new one), with ``rank`` applied when given,
    checked against the dense weight's shape."""
    layout = make() if layout is None else layout
    if layout.ranks is None or rank is not None:
        layout = layout.with_ranks(rank)
    if tuple(layout.dense_shape) != tuple(dense_shape):
        raise ValueError(f"layout is for a {tuple(layout.dense_shape)} weight, the layer's is "
                         f"{tuple(dense_shape)}")
    return layout


def _check_init(init: str) -> None:
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")


def first_cpu_use(x: torch.Tensor) -> None:
    """On a layer's CPU forward outside a trace: make sure the allocator keeps
    freed memory (:func:`.cpu_allocator.ensure_retained`; once per process, opt-out
    by environment variable). Costs a dict lookup after the first time."""
    if not torch.compiler.is_compiling() and not _ALLOCATOR_STATE["checked"] and x.device.type == "cpu":
        ensure_retained()


def _apply_matrix(module: "TNModule", x: torch.Tensor, bias, in_dim: int, in_modes: tuple[int, ...],
                  out_dim: int, padded_out: int, contract_rows) -> torch.Tensor:
    """``x @ W.T + bias`` for the module's network ``W``: pad the feature dim
    to the modes' product, contract with ``contract_rows(h, bias)`` (``h``:
    ``(rows, *in_modes)``, ``bias`` padded; returns ``rows x padded_out``
    elements), crop the output padding.

    ``x``: ``(..., in_dim)`` -> ``(..., out_dim)``.
    """
    check_input_dtype(module, x)
    if x.shape[-1] != in_dim:
        raise ValueError(f"{type(module).__name__} expected last dim {in_dim}, got shape {tuple(x.shape)}")
    first_cpu_use(x)
    lead = x.shape[:-1]
    rows = x.numel() // in_dim if in_dim else 0
    padded_in = math.prod(in_modes)
    if padded_in != in_dim:
        h = F.pad(x.reshape(rows, in_dim), (0, padded_in - in_dim)).reshape(rows, *in_modes)
    else:
        h = x.reshape(rows, *in_modes)  # one view, not two: each is an autograd node
    if bias is not None and padded_out != out_dim:
        bias = F.pad(bias, (0, padded_out - out_dim))
    y = contract_rows(h, bias)
    if padded_out != out_dim:
        return y.reshape(rows, padded_out)[:, :out_dim].reshape(*lead, out_dim)
    return y.reshape(*lead, out_dim)


def _factor_macs(factors: tuple[torch.Tensor, torch.Tensor | None]) -> int:
    """Multiply-adds per row through :meth:`TTLinear.inference_factors`."""
    a, b = factors
    return a.shape[0] * a.shape[1] + (b.shape[0] * b.shape[1] if b is not None else 0)


def _through_factors(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor | None],
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ A @ B + bias`` (``x @ W.T + bias`` for a whole matrix): ``(..., in) -> (..., out)``."""
    a, b = factors
    lead = x.shape[:-1]
    h = x.reshape(-1, x.shape[-1])
    if b is not None:
        h = h @ a
        a = b
    y = torch.addmm(bias, h, a) if bias is not None else h @ a
    return y.reshape(*lead, y.shape[-1])


def _triton_pair(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor],
                 bias: torch.Tensor | None, activation: str | None = None) -> torch.Tensor:
    """``act(x A B + bias)`` through the Triton thin pair (``tuning.TRITON_KERNELS``), in the
    autocast dtype inside an autocast region (as a linear's GEMMs would run):
    ``(rows, P_in) -> (rows, P_out)``."""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):   # meta (a dry run): no autocast
        dtype = torch.get_autocast_dtype(device)
        x, bias = x.to(dtype), None if bias is None else bias.to(dtype)
    return thin_pair_train(x, factors[0], factors[1], bias, activation)


def check_input_dtype(module: nn.Module, x: torch.Tensor) -> None:
    """Raise ``TypeError`` when ``x``'s dtype is not the layer's (as ``nn.Linear`` does,
    but saying which layer and the fix); autocast regions mix dtypes on purpose."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{type(module).__name__}: the input must be a Tensor, got {type(x).__name__}")
    dtype = next(iter(module.cores._parameters.values())).dtype if hasattr(module, "cores") else None
    if dtype is None or x.dtype == dtype or torch.is_autocast_enabled(x.device.type):
        return
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{type(module).__name__}: the input is {x.dtype}; it takes floating-point inputs "
                        f"of the layer's dtype: x.to({dtype})")
    raise TypeError(f"{type(module).__name__}: the input is {x.dtype} but the layer's cores are {dtype}; "
                    f"cast the input (x.to({dtype})) or the model (compiled.to({x.dtype}))")


def _require_int_ids(ids: torch.Tensor) -> None:
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"TTMEmbedding expects integer ids, got {ids.dtype}")


def _drop_boundary(cores: list[torch.Tensor]) -> list[torch.Tensor]:
    """Cores without their size-1 boundary bonds (first core's left, last core's right)."""
    cores = list(cores)
    cores[0] = cores[0].squeeze(0)
    cores[-1] = cores[-1].squeeze(-1)
    return cores


class _GatheredProduct(torch.autograd.Function):
    """``out[t] = L[i[t]] @ R[j[t]]`` with a backward that scatters into ``L`` and ``R``
    (:func:`.traced_lookup.gathered_product`: one native kernel each way on CPU).

    Shapes: ``L (M_L, N_L, r)``, ``R (M_R, r, N_R)``, ``i, j (T,)`` -> ``(T, N_L, N_R)``.
    """

    @staticmethod
    def forward(ctx, left, right, i, j):
        ctx.save_for_backward(left, right, i, j)
        ctx.autocast = autocast_state(left.device.type)
        return gathered_product(left, right, i, j)

    @staticmethod
    def backward(ctx, grad):
        left, right, i, j = ctx.saved_tensors
        with same_autocast(ctx.autocast):
            g_left, g_right = gathered_product_backward(grad, left, right, i, j, ctx.needs_input_grad[0],
                                                        ctx.needs_input_grad[1])
        return g_left, g_right, None, None


class TritonLookup(torch.autograd.Function):
    """A TTM embedding's rows on tncompile's Triton kernels (``tuning.TRITON_KERNELS``): the
    two halves merged from the cores and gates in one launch (:mod:`..triton.merge_factors`,
    the cores read as TT cores ``(r, m n, r')``), the rows gathered from them in one
    (:mod:`..triton.ttm_lookup`); backward: the halves' gradients scattered in one launch,
    the cores' and gates' in three more. Inputs: the layer, ids ``(T,)``, the split, then
    its cores and gates. Output ``(T, padded_cols)``; ids equal to ``padding_idx`` send no
    gradient."""

    @staticmethod
    def forward(ctx, layer: "TTMEmbedding", ids: torch.Tensor, split: int, *tensors: torch.Tensor):
        lay = layer.layout
        d = len(lay.row_modes)
        shapes = [(c.shape[0], c.shape[1] * c.shape[2], c.shape[3]) for c in tensors[:d]]
        sizes = [t.numel() for t in tensors]
        key, plan = merge_plan(1, split, shapes, [(sum(sizes[:p]), sum(sizes)) for p in range(len(sizes))], sum(sizes))
        work = tensors[0].new_empty(plan.work_size)
        torch.cat([t.reshape(-1) for t in tensors], out=work[: sum(sizes)])
        merge_forward(work, key)
        a, b = (f[0] for f in plan.factors(work))
        table = lookup_table(lay.row_modes, lay.col_modes, split, ids)
        halves = (math.prod(lay.col_modes[:split]), math.prod(lay.col_modes[split:]))
        ctx.save_for_backward(work, ids)
        ctx.info = (key, table, split, halves, layer.padding_idx, [t.shape for t in tensors])
        return ttm_gather(a, b, ids, table, split, *halves)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        work, ids = ctx.saved_tensors
        key, table, split, halves, padding_idx, shapes = ctx.info
        plan = plan_of(key)
        grads = work.new_empty(plan.grad_size)
        grads[: plan.incoming].zero_()
        da, db = (g[0] for g in plan.factor_grads(grads))     # one network: the views' first
        a, b = (f[0] for f in plan.factors(work))
        ttm_scatter_(da, db, a, b, ids, table, grad.contiguous(), split, *halves, padding_idx)
        merge_backward(grads, work, key)
        return (None, None, None, *(g[0].view(shape) for g, shape in zip(plan.network_grads(grads), shapes)))


class TNModule(nn.Module):
    """Shared behaviour of layers stored as a tensor network."""

    layout: TTLayout | TTMLayout
    cores: nn.ParameterList
    gates: nn.ParameterList
    transposed = False  # a tied head applies its embedding's matrix transposed
    stacked = 0  # leading dims of stacked networks on cores and gates (1 for experts)
    transient_state = ("_chain_choice", "_fused_choice")  # caches, not saved with the model

    def _init_params(self, layout, device, dtype) -> None:
        """Zero cores and unit gates for ``layout`` (with a leading dim of
        ``layout.copies`` when the layer stacks networks: ``stacked``)."""
        if layout.ranks is None:
            raise ValueError(f"{type(self).__name__} needs a layout with ranks; "
                             "call layout.with_ranks(r) first")
        self.layout = layout
        kw = {"device": device, "dtype": dtype}
        lead = (layout.copies,) * self.stacked
        self.cores = nn.ParameterList(nn.Parameter(torch.zeros(*lead, *s, **kw)) for s in layout.core_shapes())
        self.gates = nn.ParameterList(nn.Parameter(torch.ones(*lead, r, **kw)) for r in layout.ranks)

    def train(self, mode: bool = True) -> "TNModule":
        """``nn.Module.train``; also starts every kept inference form afresh
        (:func:`.derived.advance_weights_epoch`): entering evaluation or training is where
        weights are swapped (an EMA copied in through ``p.data``, which no counter sees)."""
        advance_weights_epoch()
        return super().train(mode)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        advance_weights_epoch()  # loaded shards of an FSDP2 model reach its gathered tensors unseen
        super()._load_from_state_dict(*args, **kwargs)

    def network_tensors(self) -> list[torch.Tensor]:
        """The cores and gates: what every merged form of the network derives from
        (:func:`.derived.kept` keeps such a form while they hold the same bits)."""
        return [*self.cores._parameters.values(), *self.gates._parameters.values()]

    def scaled_cores(self) -> list[torch.Tensor]:
        """Cores with each gate multiplied into its left core's right bond."""
        # read the lists' dicts directly: ParameterList indexing costs microseconds per item
        cores = list(self.cores._parameters.values())
        gates = list(self.gates._parameters.values())
        if torch.compiler.is_compiling() and not exporting():
            return [*gate_cores(cores[:-1], gates), cores[-1]]  # one opaque op, not a kernel per core and gradient
        return [c * g for c, g in zip(cores[:-1], gates)] + [cores[-1]]

    def set_cores(self, cores: Sequence[torch.Tensor]) -> None:
        """Copy ``cores`` in (shapes must match the layout); gates reset to one."""
        with torch.no_grad():
            for p, c in zip(self.cores, cores):
                if tuple(p.shape) != tuple(c.shape):
                    raise ValueError(f"core shape {tuple(c.shape)} != expected {tuple(p.shape)}")
                p.copy_(c)
            for g in self.gates:
                g.fill_(1.0)

    # ------------------------------------------------------------ planning
    @property
    def plans(self) -> dict[int, ContractionPlan | LookupPlan]:
        """``bucket -> plan`` cache (saved with the module)."""
        if "_plans" not in self.__dict__:
            self._plans = {}
        return self._plans

    def planner_problem(self) -> tuple[list[tuple[str, ...]], tuple[str, ...], dict[str, int]]:
        """``(inputs, output, sizes)`` of the network the executor contracts
        (:func:`tncompile.formats.planner_problem`)."""
        return planner_problem(self.layout, self.transposed)

    def plan_for(self, rows: int) -> ContractionPlan:
        """The plan for ``rows`` rows: a dict lookup once its bucket is planned.
        Under ``torch.compile`` the plan is fetched (and a new bucket planned:
        the search runs eagerly, no graph break) by one call whose result is a
        constant of the graph."""
        bucket = bucket_of(rows)
        if torch.compiler.is_compiling():  # the plan is a constant of the traced graph
            return self._plan_while_tracing(bucket)
        plan = self.plans.get(bucket)
        if plan is None:
            plan = self.plan_bucket(bucket)
        return plan

    @torch.compiler.assume_constant_result
    def _plan_while_tracing(self, bucket: int):
        """The plan of ``bucket``, planned now if new (run eagerly while tracing;
        the cache is not read by traced code, so no guard sees it change).
        Registered for ``tncompile::traced_contract`` (:func:`.traced_contract.register`)."""
        plan = self.plans.get(bucket)
        if plan is None:
            plan = self.plan_bucket(bucket)
        return register(plan) if isinstance(plan, ContractionPlan) else plan

    @torch.compiler.disable  # planning is host-side search: never traced into a compiled graph
    def plan_bucket(self, bucket: int) -> ContractionPlan:
        """Plan (and cache) the contraction for a bucket of ``bucket`` rows."""
        plan = get_planner().plan_contraction(self.layout, self.transposed, int(bucket))
        self.plans[int(bucket)] = plan
        return plan

    def compressed_params(self) -> int:
        """Parameters of the cores and gates (not the bias)."""
        return self.layout.num_params()

    def extra_repr(self) -> str:
        return f"{self.layout.describe()}, params={self.compressed_params():,}"


class TTLinear(TNModule):
    """``y = x @ W.T + b`` with ``W`` stored in TT format (input modes first).

    Parameters
    ----------
    layout : TTLayout
        Modes and ranks; ``layout.ranks`` must be set.
    bias : bool
        Whether the layer has a bias of shape ``[out_features]``.

    Shapes
    ------
    input ``(..., in_features)`` -> output ``(..., out_features)``.

    Inference (no autograd, not under ``torch.compile``) multiplies by the network
    merged into two thin factors ``W.T = A @ B`` (or the whole ``W`` when that is
    smaller), kept until a core or gate may have changed, whenever that costs no more
    multiply-adds than the planned contraction: two GEMMs instead of a chain of
    small products, which is what decoding (one row per sequence) needs.
    """

    transient_state = TNModule.transient_state + ("_inference", "_pair_choice", "_whole_choice", "_factor_peers")
    merge_in_inference = True

    def __init__(self, layout: TTLayout, bias: bool = True, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(layout, TTLayout):
            raise TypeError(f"TTLinear needs a TTLayout, got {type(layout).__name__}")
        self._init_params(layout, device, dtype)
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self.bias = nn.Parameter(torch.zeros(layout.out_features, device=device, dtype=dtype)) if bias else None
        self._chain_choice: dict = {}  # see choice_cache

    @classmethod
    def from_linear(cls, linear: nn.Module, rank: int | Sequence[int] = 16, num_cores: int = 3,
                    init: str = "svd", layout: TTLayout | None = None,
                    generator: torch.Generator | None = None) -> "TTLinear":
        """Build from an ``nn.Linear`` (or HF ``Conv1D``).

        ``init="svd"`` fits the cores to the weight by TT-SVD (exact at full
        rank); ``init="random"`` draws cores whose product has the variance of
        ``nn.Linear``'s default init (``1 / (3 in_features)``).
        """
        _check_init(init)
        weight = linear_weight_of(linear)
        out_f, in_f = weight.shape
        layout = _resolve_layout(layout, lambda: TTLayout.for_shape(in_f, out_f, num_cores),
                                 rank, weight.shape)
        bias = getattr(linear, "bias", None)
        mod = cls(layout, bias=bias is not None, device=weight.device, dtype=weight.dtype)
        cores = (tt_from_linear_weight(weight, layout) if init == "svd"
                 else random_cores(layout, 1.0 / (3 * in_f), generator))
        mod.set_cores([c.to(weight.dtype) for c in cores])
        if bias is not None:
            with torch.no_grad():
                mod.bias.copy_(bias)
        return mod

    @property
    def weight(self) -> NetworkMatrix:
        """``weight()``: the dense ``[out_features, in_features]`` matrix the network stands for
        (``weight.device`` / ``dtype`` / ``shape`` without making it: :class:`.NetworkMatrix`)."""
        return NetworkMatrix(self, lambda: tt_to_dense(self.scaled_cores(), self.layout),
                             (self.layout.out_features, self.layout.in_features))

    def merged_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The matrix as two thin factors, ``W.T = A @ B`` (gates included):
        ``A (padded_in, r)`` merges the input cores, ``B (r, padded_out)``
        the output cores, ``r`` the bond between them. Differentiable.

        In a model ``compile`` made, computed with those of every layer of the same
        layout in one batched pass (:mod:`.factor_groups`)."""
        peers = self.__dict__.get("_factor_peers")
        if peers is not None:
            got = peers.factors(self)
            if got is not None:
                return got
        return tt_factors(self.scaled_cores(), len(self.layout.in_modes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        way, factors = decide_call(self, x) if isinstance(x, torch.Tensor) else (None, None)  # (bad input: below)
        if way is LinearWay.EXPORTED:
            return self._exported_forward(x)
        if way is LinearWay.INFERENCE_FACTORS:
            check_input_dtype(self, x)
            record(self, way)
            return _through_factors(x, factors, self.bias)
        return _apply_matrix(self, x, self.bias, lay.in_features, lay.in_modes, lay.out_features,
                             lay.padded_out, self._contract_rows)

    def activated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(self(x))`` for ``activation`` in :data:`~tncompile.runtime.triton.ACTIVATIONS`
        (``"gelu"``, ``"gelu_tanh"``, ``"relu"``): on the Triton kernels the thin pair's
        epilogue, so the activation's input is never written (its backward launch forms it
        again from the rank-thin middle); otherwise the layer, then the activation.
        ``x (..., in_features) -> (..., out_features)``."""
        code = activation_code(activation)
        lay = self.layout
        if exporting() or not (tuning.TRITON_KERNELS and runs_triton(x)):
            return activate(self(x), code)
        return _apply_matrix(self, x, self.bias, lay.in_features, lay.in_modes, lay.out_features, lay.padded_out,
                             lambda h, bias: _triton_pair(h.reshape(h.shape[0], -1), self.merged_factors(), bias,
                                                          activation))

    def _exported_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under ``torch.export`` (and ONNX's exporter): ``x @ A @ B + bias`` with the factors
        merged from the cores in the graph -- core ATen ops only, one form for every
        row count (an ONNX runtime folds the merge into constants when it loads the model)."""
        a, b = self.merged_factors()
        a, b = a[: self.in_features], b[:, : self.out_features]
        whole = a.shape[1] * (self.in_features + self.out_features) >= self.in_features * self.out_features
        return _through_factors(x, (a @ b, None) if whole else (a, b), self.bias)

    def _through_factors_at(self, rows: int, factors) -> bool:
        """Whether an inference forward over ``rows`` rows multiplies by the merged factors
        (not costlier than ``tuning.INFERENCE_MERGE_SLACK`` x the planned contraction)."""
        return _factor_macs(factors) * rows <= tuning.INFERENCE_MERGE_SLACK * self.plan_for(rows).fwd_flops

    def inference_macs(self, rows: int) -> int:
        """Multiply-adds of an inference forward (no autograd) over ``rows`` rows, as this
        layer runs it: through its merged factors or its planned contraction."""
        factors = self.inference_factors()
        if self.merge_in_inference and self._through_factors_at(rows, factors):
            return _factor_macs(factors) * rows
        return self.plan_for(rows).fwd_flops

    def inference_factors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(A (in, r), B (r, out))`` with ``W.T = A @ B`` (padding cropped), or
        ``(W.T, None)`` when the whole matrix has fewer entries than the two factors;
        kept (not saved) until a core or gate may have changed (:func:`.derived.kept`)."""
        return kept(self, "_inference", self.network_tensors(), self._make_inference_factors)

    def _make_inference_factors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        # merged alone, not with its batch: a kept form is made rarely, and a batch would leave
        # its peers factors that outlive this call
        a, b = tt_factors(self.scaled_cores(), len(self.layout.in_modes))
        a, b = a[: self.in_features], b[:, : self.out_features]
        if a.shape[1] * (self.in_features + self.out_features) >= self.in_features * self.out_features:
            return (a @ b).contiguous(), None
        return a.contiguous(), b.contiguous()

    def _contract_rows(self, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``h (rows, *in_modes)`` through the network: at a few rows one native
        chain call each way (:mod:`.tt_chain`), otherwise the planned order."""
        rows = h.shape[0]
        way, ops = decide_rows(self, h, rows, settle_merged=False)
        if way is LinearWay.TRITON_PAIR:
            record(self, way)
            return _triton_pair(h.reshape(rows, -1), self.merged_factors(), bias)
        if way is LinearWay.NATIVE_CHAIN:
            record(self, way)
            return tt_chain(ops, len(self.layout.in_modes), h, bias, list(self.cores._parameters.values()),
                            list(self.gates._parameters.values()))
        plan = self.plan_for(rows)
        if way in (LinearWay.WHOLE_MATRIX, LinearWay.THIN_PAIR):
            # merged with the other layers of this layout: two thin products, or one through
            # the whole matrix where that is estimated faster (whichever the batch was made as)
            device = h.device
            got = self.__dict__["_factor_peers"].factors(self, whole=lambda: self._runs_whole(plan, device),
                                                          strict=False)
            if got is not None and len(got) == 1:
                record(self, LinearWay.WHOLE_MATRIX)
                h, w = h.reshape(rows, got[0].shape[0]), got[0]
                return torch.addmm(bias, h, w) if bias is not None else torch.mm(h, w)
            record(self, LinearWay.THIN_PAIR)
            a, b = got if got is not None else tt_factors(self.scaled_cores(), len(self.layout.in_modes))
            return thin_pair(h.reshape(rows, a.shape[0]), a, b, bias)
        record(self, way)
        return contract(plan, [h, *_drop_boundary(self.scaled_cores())], bias)

    def _runs_whole(self, plan: ContractionPlan, device: torch.device) -> bool:
        """Whether this layer's batch, when this layer makes it (asked then only), merges into whole matrices
        (one GEMM over the rows each way instead of two): where
        :func:`~tncompile.planning.speed_model.whole_matrix_saving` estimates it faster on
        ``device`` (kernels cost more than the extra multiply-adds: small layers on a GPU),
        by that device's known speed, never measured here
        (:func:`~.factor_groups.whole_matrices_faster`). Cached per bucket, ranks,
        device, batch and the ``tuning`` settings it depends on.

        Never while a CUDA graph is captured: the estimate's fixed costs are an eager
        step's (the host's dispatch); replayed, a kernel costs a few microseconds, and the
        whole matrices' extra multiply-adds lost there (H100, the six-encoder at batch 1:
        8.8 ms captured against 7.9 with thin products, 56 against 64 ms eager)."""
        if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        peers = self.__dict__["_factor_peers"]
        cache = choice_cache(self, "_whole_choice")
        key = (plan.rows, self.layout.ranks, device, peers.generation, tuning.DEVICE_SPEED, tuning.WHOLE_MATRICES)
        got = cache.get(key)
        if got is None:
            batch = peers.batch_of(self)
            got = cache[key] = batch is not None and whole_matrices_faster(self.layout, plan.rows, device, batch)
        return got

    def _runs_as_pair(self, plan: ContractionPlan) -> bool:
        """Whether ``plan`` is merge-cores-first (``x A`` then ``(x A) B``), so the layer
        can run it from its merged factors (cached per bucket and ranks)."""
        if not tuning.GROUP_FACTORS or torch.compiler.is_compiling():
            return False
        cache = choice_cache(self, "_pair_choice")
        key = (plan.rows, self.layout.ranks)
        got = cache.get(key)
        if got is None:
            got = cache[key] = is_merge_first(plan)
        return got

    def to_dense_module(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.cores[0].device, dtype=self.cores[0].dtype)
        with torch.no_grad():
            lin.weight.copy_(self.weight())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin


class TTMEmbedding(TNModule):
    """Embedding lookup with the table stored in TTM format.

    Each id is split into mode digits ``(i_1..i_d)`` (row-major over
    ``row_modes``); the slices ``G_k[:, i_k]`` are gathered and contracted.
    ``padding_idx`` keeps ``nn.Embedding``'s meaning: a lookup of it returns
    the table's row and sends no gradient to the cores. (TT-SVD of a zero row
    gives a row near zero; as the cores are shared by every row, training
    other rows moves it, where ``nn.Embedding``'s stays fixed. A tied head
    reads the same row, so ``to_dense()`` matches exactly.)

    Shapes
    ------
    input ``(...)`` integer ids -> output ``(..., embedding_dim)``.
    """

    transient_state = TNModule.transient_state + ("_halves",)

    def __init__(self, layout: TTMLayout, padding_idx: int | None = None, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(layout, TTMLayout):
            raise TypeError(f"TTMEmbedding needs a TTMLayout, got {type(layout).__name__}")
        self._init_params(layout, device, dtype)
        self.num_embeddings, self.embedding_dim = layout.num_embeddings, layout.embedding_dim
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} out of range for {self.num_embeddings} rows")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, rank: int | Sequence[int] = 16,
                       num_cores: int = 4, init: str = "svd",
                       layout: TTMLayout | None = None,
                       generator: torch.Generator | None = None) -> "TTMEmbedding":
        """Build from an ``nn.Embedding``.

        ``init="svd"`` fits the cores by TT-SVD; ``init="random"`` matches the
        variance of ``nn.Embedding``'s default ``N(0, 1)`` init.
        ``max_norm`` and ``sparse=True`` are not supported (``ValueError``).
        """
        _check_init(init)
        if embedding.max_norm is not None:
            raise ValueError("TTMEmbedding does not support max_norm (it renormalizes rows in "
                             "place); leave this embedding dense")
        if embedding.sparse:
            raise ValueError("TTMEmbedding does not support sparse=True gradients; leave this "
                             "embedding dense")
        weight = embedding.weight
        V, D = weight.shape
        layout = _resolve_layout(layout, lambda: TTMLayout.for_shape(V, D, num_cores), rank, weight.shape)
        mod = cls(layout, padding_idx=embedding.padding_idx, device=weight.device, dtype=weight.dtype)
        cores = ttm_from_embedding_weight(weight, layout) if init == "svd" else random_cores(layout, 1.0, generator)
        mod.set_cores([c.to(weight.dtype) for c in cores])
        return mod

    @property
    def weight(self) -> NetworkMatrix:
        """``weight()``: the dense ``[num_embeddings, embedding_dim]`` table (padding row as
        stored; ``weight.device`` / ``dtype`` / ``shape`` without making it)."""
        return NetworkMatrix(self, lambda: ttm_to_dense(self.scaled_cores(), self.layout),
                             (self.layout.num_embeddings, self.layout.embedding_dim))

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Ids must be integers in ``[0, num_embeddings)`` (:func:`.traced_lookup.check_ids`:
        a host read on CPU, a device-side assert elsewhere and while traced)."""
        _require_int_ids(ids)
        check_ids(ids, self.num_embeddings, host_read=not torch.compiler.is_compiling())

    @torch.compiler.disable
    def plan_bucket(self, bucket: int) -> LookupPlan:  # type: ignore[override]
        plan = get_planner().plan_lookup(self.layout, int(bucket))
        self.plans[int(bucket)] = plan
        return plan

    def half_tables(self, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``L[M_L, N_L, r]`` from cores ``[:split]`` and ``R[M_R, r, N_R]`` from the rest.
        Without autograd (inference, decoding one id per sequence) they are kept, not
        saved, until a core or gate may have changed (:func:`.derived.kept`): merging them is
        most of a small lookup."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return half_tables(self.scaled_cores(), split)
        # contiguous once here, not copied by every lookup's kernel
        return kept(self, "_halves", self.network_tensors(),
                    lambda: tuple(t.contiguous() for t in half_tables(self.scaled_cores(), split)), key=(split,))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        if exporting():
            return self._exported_forward(ids)
        if torch.compiler.is_compiling() and len(lay.row_modes) > 1:
            return self._traced_forward(ids)
        self._check_ids(ids)
        first_cpu_use(ids)
        flat = ids.reshape(-1).long()
        lookup, inverse = distinct_ids(flat)
        rows = lookup.shape[0]
        split = lookup_ways.choose_split_at(self, rows)
        way = lookup_ways.choose_split(self, split)  # the eager ways (lookup_ways.choose: export, traced too)
        record(self, way)
        triton = way is lookup_ways.LookupWay.TRITON_LOOKUP
        if triton:  # padding positions send no gradient inside the kernel
            out = TritonLookup.apply(self, lookup, split, *self.network_tensors())
        elif way is lookup_ways.LookupWay.ONE_TABLE:
            table = self.scaled_cores()[0].reshape(lay.row_modes[0], lay.col_modes[0])
            out = table.index_select(0, lookup)
        else:
            left, right = self.half_tables(split)
            i_left, i_right = split_ids(lookup, math.prod(lay.row_modes[split:]))
            out = _GatheredProduct.apply(left, right, i_left, i_right).reshape(rows, lay.padded_cols)
        if lay.padded_cols != lay.embedding_dim:
            out = out[:, : lay.embedding_dim]
        if inverse is not None:
            out = out.index_select(0, inverse)
        if self.padding_idx is not None and not triton:  # the row's value, no gradient from these positions
            out = torch.where((flat == self.padding_idx).unsqueeze(-1), out.detach(), out)
        return out.reshape(*ids.shape, lay.embedding_dim)

    def _exported_forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Under ``torch.export`` (and ONNX's exporter): the two half tables merged in the
        graph at the network's narrowest bond, then two gathers and a ``bmm`` per id --
        core ATen ops only, for any number of ids. Ids are not range-checked here (an
        exported program has no host reads); the padding row is the row stored."""
        _require_int_ids(ids)
        lay = self.layout
        flat = ids.reshape(-1).long()
        cores = self.scaled_cores()
        if len(lay.row_modes) == 1:
            out = cores[0].reshape(lay.row_modes[0], lay.col_modes[0]).index_select(0, flat)
        else:
            split = 1 + min(range(len(lay.ranks)), key=lambda k: lay.ranks[k])
            left, right = half_tables(cores, split)
            i_left, i_right = split_ids(flat, math.prod(lay.row_modes[split:]))
            out = torch.bmm(left.index_select(0, i_left), right.index_select(0, i_right))
            out = out.reshape(flat.shape[0], lay.padded_cols)
        return out[:, : lay.embedding_dim].reshape(*ids.shape, lay.embedding_dim)

    def _traced_forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Under ``torch.compile``: the whole lookup as one opaque op each way
        (``tncompile::ttm_lookup``, :mod:`.traced_lookup`), not ~8 inductor kernels."""
        _require_int_ids(ids)  # the range is checked inside the op, on real data
        flat = ids.reshape(-1).long()
        split = self.plan_for(flat.shape[0]).split
        out = ttm_lookup(flat, list(self.cores._parameters.values()),
                         list(self.gates._parameters.values()), split, self.num_embeddings,
                         self.embedding_dim, self.padding_idx)[0]
        return out.reshape(*ids.shape, self.embedding_dim)

    def to_dense_module(self) -> nn.Embedding:
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx,
                           device=self.cores[0].device, dtype=self.cores[0].dtype)
        with torch.no_grad():
            emb.weight.copy_(self.weight())  # the padding row as stored, as a lookup returns it
        return emb

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return super().extra_repr() + pad


def tied_merge_macs(layout: TTMLayout, rows: int) -> int:
    """Multiply-adds of a tied head over ``rows`` rows through the merged table: merging
    (about ``V·D·r``, ``r`` the largest rank) plus the dense product ``rows·V·D``."""
    table = layout.num_embeddings * layout.embedding_dim
    return table * (rows + max(layout.ranks or (1,)))


class TTMTiedLinear(TNModule):
    """Output head tied to a :class:`TTMEmbedding`: ``y = x @ E.T + b``.

    The cores and gates *are* the embedding's (one set of parameters serves
    both, as ``lm_head.weight is wte.weight`` in the dense model); only the
    bias, if any, is the head's own.

    Shapes
    ------
    input ``(..., embedding_dim)`` -> output ``(..., num_embeddings)``.
    """

    transposed = True
    transient_state = TNModule.transient_state + ("_merged", "_halves")
    # inference (no autograd): the table merged once, or over a few rows two half tables (.tied_head),
    # kept until a core or gate may have changed (derived.kept)
    merge_in_inference = True

    def __init__(self, embedding: TTMEmbedding, bias: bool = False):
        super().__init__()
        self.embedding = embedding
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings
        self.bias = nn.Parameter(torch.zeros(self.out_features, device=embedding.cores[0].device,
                                             dtype=embedding.cores[0].dtype)) if bias else None

    @property
    def layout(self) -> TTMLayout:  # type: ignore[override]
        return self.embedding.layout

    @property
    def cores(self) -> nn.ParameterList:  # type: ignore[override]
        return self.embedding.cores

    @property
    def gates(self) -> nn.ParameterList:  # type: ignore[override]
        return self.embedding.gates

    def compressed_params(self) -> int:
        return 0  # shared with the embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        if exporting():  # the table merged in the graph (an ONNX runtime folds it)
            return F.linear(x, self.embedding.weight()[: self.out_features], self.bias)
        if self.merge_in_inference and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            check_input_dtype(self, x)
            rows = x.reshape(-1, lay.embedding_dim)  # 2-D: a strided 3-D x would turn matmul into a bmm
            split = best_split(lay, rows.shape[0]) if rows.shape[0] else None
            if split is not None:  # a few rows (decoding): two half tables, not the whole table read
                y = self._half_table_rows(rows, split)
            else:
                table_t = self.merged_weight_t()  # (dim, vocab) row-major: x @ table_t streams it in order
                y = torch.addmm(self.bias, rows, table_t) if self.bias is not None else rows @ table_t
            return y.reshape(*x.shape[:-1], self.out_features)
        rows = x.numel() // max(lay.embedding_dim, 1)
        if rows and self.merges_at(rows):  # a vocabulary-wide output: merging once beats contracting per row
            check_input_dtype(self, x)
            return F.linear(x, self.embedding.weight()[: self.out_features], self.bias)

        def contract_rows(h, bias):
            return contract(self.plan_for(h.shape[0]), [h, *_drop_boundary(self.embedding.scaled_cores())], bias)
        return _apply_matrix(self, x, self.bias, lay.embedding_dim, lay.col_modes, lay.num_embeddings,
                             lay.padded_rows, contract_rows)

    def _half_table_rows(self, rows: torch.Tensor, split: int) -> torch.Tensor:
        """``rows (B, embedding_dim)`` through the half tables split before core ``split``
        (:mod:`.tied_head`), kept (not saved) until a core or gate may have changed
        (:func:`.derived.kept`): ``(B, vocab)``."""
        lay = self.layout
        left, right_t = kept(self, "_halves", self.embedding.network_tensors(),
                             lambda: head_halves(self.embedding.scaled_cores(), split), key=(split,))
        if lay.padded_cols != lay.embedding_dim:
            rows = F.pad(rows, (0, lay.padded_cols - lay.embedding_dim))
        y = half_table_head(rows, left, right_t, math.prod(lay.col_modes[:split]))
        if lay.padded_rows != self.out_features:
            y = y[:, : self.out_features]
        return y + self.bias if self.bias is not None else y

    def to_dense_head(self, embedding: nn.Embedding | None = None) -> nn.Linear:
        """An ``nn.Linear`` whose weight *is* ``embedding``'s (the dense table this head's
        embedding was rebuilt as; rebuilt here when not given), with this head's bias."""
        emb = embedding if embedding is not None else self.embedding.to_dense_module()
        head = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                         device=emb.weight.device, dtype=emb.weight.dtype)
        head.weight = emb.weight
        if self.bias is not None:
            with torch.no_grad():
                head.bias.copy_(self.bias)
        return head

    def merges_at(self, rows: int) -> bool:
        """Whether ``rows`` rows cost fewer multiply-adds through the table merged from the
        cores (once per call, differentiably: ``V·D·r`` to merge, then a dense head's
        ``rows·V·D``) than through the network contracted per row (its plan's count). A tied
        head's output is vocabulary-sized, so past a few rows the merged table wins (GPT-2:
        the network costs ~11x a dense head per row)."""
        return tied_merge_macs(self.layout, rows) < self.plan_for(rows).fwd_flops

    def merged_weight_t(self) -> torch.Tensor:
        """The table transposed, ``[embedding_dim, out_features]`` and contiguous, merged from
        the cores and kept (not saved) until a core or gate may have changed
        (:func:`.derived.kept`). A tied head over vocabulary-sized outputs costs a dense head's multiply-adds
        this way (contracting the network for every row, as decoding feeds it, costs many
        times more); stored this way round, ``x @ table_t`` reads it in order, which at a
        few rows runs ~1.2x (1 row) to ~1.8x (8 rows) faster than ``F.linear`` on the
        ``[vocab, dim]`` table (50257 x 768, CPU)."""
        return kept(self, "_merged", self.embedding.network_tensors(),
                    lambda: self.embedding.weight()[: self.out_features].t().contiguous())

    def extra_repr(self) -> str:
        return f"tied to embedding {self.layout.describe()}, bias={self.bias is not None}"
