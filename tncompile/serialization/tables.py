"""What a model file may name: explicit tables, keyed by name, with no import by a name a file holds.

A tncompile file describes its graph as data. Every name in it -- a function,
a tensor method, an op, a module class, a record type, a pytree node type --
is looked up here, and whatever is not here is refused (with ``trust=True``
as the only way past). The tables list the ops that tncompile's tracers and
passes emit and the tensor math that canonical graphs use; nothing that
touches files, storage, numpy, shared memory, processes, or global state
(default dtype, thread counts, seeds) is in them, however it is spelled.

The tables hold *our* names; they are resolved once, from fixed roots
(``torch``, ``operator``, ...), the first time a file is loaded. A name read
from a file is only ever a key into them.
"""
from __future__ import annotations

import builtins
import importlib
import keyword
import math
import operator
import re
from typing import Any, Callable

import torch
from torch import nn

from ..passes.pending import PendingLayer
from ..runtime.attention import AttentionDropoutRate, FusedAttention, NestedPadding, SelfAttention
from ..runtime.collapsed import CollapsedLayer
from ..runtime.dropout import FastDropout
from ..runtime.embedding_bag import TTMEmbeddingBag
from ..runtime.experts import ExpertLinear, TTExperts
from ..runtime.graph_functions import GRAPH_FUNCTIONS
from ..runtime.tt_layers import TTLinear, TTMEmbedding, TTMTiedLinear

__all__ = ["IDENTIFIER", "QUALNAME", "is_identifier", "is_qualname", "function_table", "function_name",
           "METHODS", "ALLOCATING_METHODS", "ALLOCATING_FUNCTIONS", "GETATTR_NAMES", "aten_allowed",
           "HIGHER_ORDER_OPS", "TNCOMPILE_OPS", "module_class_table", "lookup_module_class", "register_module_class",
           "SAFE_MODULE_CLASSES",
           "DATACLASSES", "dataclass_of", "TORCH_VALUES", "pytree_type_allowed", "SAFETENSORS_DTYPES"]

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
QUALNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def is_identifier(name: Any) -> bool:
    """A Python identifier that is not a keyword (it can be pasted into generated code as a name)."""
    return isinstance(name, str) and len(name) <= 200 and bool(IDENTIFIER.match(name)) \
        and not keyword.iskeyword(name)


def is_qualname(name: Any) -> bool:
    """Dotted identifiers (``layers.0.ff1`` is not one: module paths use :func:`is_module_path`)."""
    return isinstance(name, str) and len(name) <= 1000 and bool(QUALNAME.match(name)) \
        and not any(keyword.iskeyword(p) for p in name.split("."))


# ----------------------------------------------------------------- functions
# Canonical name -> how to reach it from a fixed root. Pure tensor math only.
_TORCH_FUNCTIONS = """
abs absolute acos acosh add addcdiv addcmul addmm addmv all allclose amax amin angle any arange arccos argmax
argmin argsort asin asinh atan atan2 atanh baddbmm bernoulli bitwise_and bitwise_not bitwise_or bitwise_xor bmm
broadcast_tensors broadcast_to bucketize cat ceil chunk clamp clamp_max clamp_min clip clone complex concat
concatenate conj cos cosh count_nonzero cumprod cumsum deg2rad diag diag_embed diagonal diff div divide dot
dropout einsum embedding eq equal erf erfc erfinv exp exp2 expm1 flatten flip fliplr flipud
float_power floor floor_divide fmax fmin fmod frac full full_like gather ge gelu greater greater_equal gt
hardshrink heaviside hypot imag index_add index_copy index_fill index_select inner isclose isfinite isin isinf
isnan isneginf isposinf isreal kron layer_norm le lerp less less_equal lgamma linspace log log10 log1p log2
log_softmax logaddexp logaddexp2 logcumsumexp logical_and logical_not logical_or logical_xor logit logspace
logsumexp lt masked_fill masked_scatter masked_select matmul max maximum mean median min minimum mm moveaxis
movedim msort mul multiply mv nan_to_num nanmean nansum narrow native_layer_norm ne neg negative nonzero norm
not_equal numel ones ones_like outer permute polar pow prod rad2deg rand rand_like randint randint_like randn
randn_like real reciprocal relu remainder repeat_interleave reshape roll rot90 round rsqrt rsub scalar_tensor
scatter scatter_add scatter_reduce searchsorted select sigmoid sign signbit sin sinc sinh slice_scatter softmax
sort split sqrt square squeeze stack std std_mean sub subtract sum swapaxes swapdims t take take_along_dim tan
tanh tensor_split tile topk transpose trapezoid tril tril_indices triu triu_indices true_divide trunc unbind
unflatten unique unique_consecutive unsqueeze var var_mean vstack hstack where xlogy zeros zeros_like
""".split()

_FUNCTIONAL = """
adaptive_avg_pool1d adaptive_avg_pool2d avg_pool1d avg_pool2d batch_norm binary_cross_entropy
binary_cross_entropy_with_logits celu conv1d conv2d conv_transpose1d conv_transpose2d cosine_similarity
cross_entropy dropout dropout1d dropout2d elu embedding embedding_bag gelu glu group_norm gumbel_softmax
hardsigmoid hardswish hardtanh huber_loss instance_norm kl_div l1_loss layer_norm leaky_relu linear
local_response_norm log_softmax logsigmoid max_pool1d max_pool2d mish mse_loss nll_loss normalize one_hot pad
pairwise_distance prelu relu relu6 rms_norm scaled_dot_product_attention selu sigmoid silu smooth_l1_loss
softmax softmin softplus softshrink softsign tanh tanhshrink threshold
""".split()

_LINALG = "norm vector_norm matrix_norm vecdot".split()
_SPECIAL = "erf erfc expit logit log_softmax softmax xlogy".split()
_MATH = "sqrt log log2 log10 exp floor ceil trunc isfinite isinf isnan pow fabs".split()
_OPERATOR = """
add sub mul truediv floordiv mod pow neg pos abs matmul getitem eq ne lt le gt ge and_ or_ xor invert not_
lshift rshift truth iadd isub imul itruediv ifloordiv imod ipow imatmul iand ior ixor contains
""".split()
_BUILTINS = "getattr len int float bool min max abs round slice range tuple list".split()
# tncompile's own functions that passes put into graphs
_TNCOMPILE = {f"{f.__module__}.{f.__qualname__}": f for f in GRAPH_FUNCTIONS}

# functions whose literal int arguments are sizes of a new tensor (checked against the file's size)
ALLOCATING_FUNCTIONS = frozenset({
    "torch.arange", "torch.full", "torch.ones", "torch.zeros", "torch.rand", "torch.randn",
    "torch.randint", "torch.linspace", "torch.logspace", "torch.tril_indices", "torch.triu_indices",
    "torch.repeat_interleave", "torch.tile", "torch.broadcast_to", "torch.nn.functional.pad",
    "torch.nn.functional.one_hot", "builtins.range"})

_FUNCTIONS: dict[str, Callable] | None = None
_FUNCTION_NAMES: dict[int, str] = {}


def _entries() -> dict[str, Callable]:
    F = torch.nn.functional
    table: dict[str, Callable] = {}

    def add(prefix: str, root: Any, names: list[str]) -> None:
        for name in names:
            fn = getattr(root, name, None)
            if callable(fn):
                table[f"{prefix}.{name}"] = fn

    add("torch", torch, _TORCH_FUNCTIONS)
    add("torch.nn.functional", F, _FUNCTIONAL)
    add("torch.linalg", torch.linalg, _LINALG)
    add("torch.special", torch.special, _SPECIAL)
    add("math", math, _MATH)
    add("operator", operator, _OPERATOR)
    add("builtins", builtins, _BUILTINS)
    table.update(_TNCOMPILE)
    return table


def function_table() -> dict[str, Callable]:
    """Every name a file may use for a ``call_function`` target -> the function.

    Holds the canonical names above and, for files written before this table
    existed, the ``module.qualname`` spelling the encoder used then
    (``torch._C._nn.linear``, ``_operator.add``, ...) of the same functions."""
    global _FUNCTIONS
    if _FUNCTIONS is None:
        canonical = _entries()
        table = dict(canonical)
        for name, fn in canonical.items():
            _FUNCTION_NAMES.setdefault(id(fn), name)
            module = getattr(fn, "__module__", None)
            for attr in ("__qualname__", "__name__"):
                qual = getattr(fn, attr, None)
                if isinstance(module, str) and isinstance(qual, str):
                    table.setdefault(f"{module}.{qual}", fn)
        _FUNCTIONS = table
    return _FUNCTIONS


def function_name(fn: Any) -> str | None:
    """The canonical table name of ``fn``, or ``None`` when files may not name it."""
    function_table()
    return _FUNCTION_NAMES.get(id(fn))


# ----------------------------------------------------------------- methods and attributes
# Tensor methods that compute. No storage / file / numpy / sharing / hooks / global state,
# no device change by string (``to`` and ``type`` get their arguments checked by the graph loader).
METHODS = frozenset("""
abs add addcmul addmm all amax amin any argmax argmin argsort baddbmm bernoulli bitwise_and bitwise_not
bitwise_or bmm bool broadcast_to byte ceil char chunk clamp clamp_max clamp_min clip clone contiguous cos cumprod
cumsum detach diag diagonal dim div double eq erf exp expand expand_as fill_diagonal_ flatten flip float floor
fmod gather ge gelu half gt index_fill index_select int is_contiguous is_floating_point isinf isnan item le
log log_softmax logical_and logical_not logical_or long lt masked_fill masked_fill_ matmul max maximum mean min
minimum mm mul nan_to_num narrow ndimension ne neg nelement new_full new_ones new_tensor new_zeros
nonzero norm numel permute pow prod reciprocal relu repeat repeat_interleave reshape reshape_as roll round
rsqrt scatter scatter_add select sigmoid sign sin size softmax sort split sqrt square squeeze std sub sum t tanh
tile to topk transpose tril triu type_as unbind unflatten unique unsqueeze var view view_as where zero_
add_ mul_ sub_ div_ clamp_ copy_ fill_ masked_scatter relu_ tanh_ sigmoid_ float_power bfloat16 short
""".split())

# methods whose literal int arguments are sizes of a new tensor
ALLOCATING_METHODS = frozenset("expand new_full new_ones new_zeros repeat repeat_interleave tile".split())

# attributes ``getattr`` nodes may read
GETATTR_NAMES = frozenset("shape dtype device ndim T mT H mH real imag is_cuda requires_grad layout "
                          "is_sparse is_quantized is_meta data".split())


# ----------------------------------------------------------------- ops
_ATEN = frozenset("""
__and__ __or__ add_ conv2d copy_ detach_ diff div_ empty_like fill_ floor_divide histc index_put_ masked_fill_
mul_ sub_ clamp_ zero_ baddbmm__ bitwise_and_
_adaptive_avg_pool2d _assert_scalar _assert_tensor_metadata _cdist_forward _embedding_bag
_embedding_bag_forward_only _local_scalar_dense _log_softmax _native_batch_norm_legit
_native_batch_norm_legit_no_training _pdist_forward _safe_softmax _scaled_dot_product_efficient_attention
_scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_for_cpu _softmax _to_copy _unsafe_view
abs acos acosh add addmm addmv alias all amax amin any arange argmax argmin asin asinh atan atan2 atanh
avg_pool2d baddbmm bitwise_and bitwise_not bitwise_or bitwise_xor bmm cat ceil chunk clamp clamp_max clamp_min
clone constant_pad_nd contiguous convolution copy cos cosh cumsum detach diagonal div dropout elu embedding
embedding_bag eq erf exp expand expand_as expm1 fill flatten flip floor fmod full full_like
gather ge gelu group_norm gt hardtanh index index_put index_select isinf isnan layer_norm le leaky_relu lift_fresh_copy
linear log log10 log1p log2 log_softmax logical_and logical_not logical_or logical_xor lt masked_fill
masked_scatter matmul max max_pool2d_with_indices maximum mean min minimum mm mul native_dropout
native_group_norm native_layer_norm ne neg new_ones new_zeros nonzero ones ones_like permute pow prod
reciprocal relu remainder repeat repeat_interleave reshape rms_norm round rsqrt rsub scalar_tensor
scaled_dot_product_attention scatter scatter_add scatter_reduce select select_scatter sigmoid sign silu
sin sinh slice slice_scatter softmax sort split split_with_sizes sqrt squeeze stack sub sum sym_constrain_range_for_size
sym_numel sym_size sym_storage_offset sym_stride t tan tanh to topk transpose tril triu trunc type_as
unbind unflatten unsqueeze var view view_as where zeros zeros_like
""".split())

# ops that allocate from literal sizes (their int arguments are checked against the file's size)
ALLOCATING_OPS = frozenset("aten::arange aten::full aten::ones aten::zeros aten::new_ones "
                           "aten::new_zeros aten::expand aten::repeat aten::repeat_interleave "
                           "aten::constant_pad_nd".split())

TNCOMPILE_OPS = frozenset("""
dropout_ ffn_forward gate_cores gate_cores_backward grouped_mm grouped_mm_backward traced_contract
traced_contract_backward traced_ffn traced_ffn_backward traced_thin_expand traced_thin_expand_backward
traced_thin_project tt_chain ttm_lookup ttm_lookup_backward
""".split())

HIGHER_ORDER_OPS = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast"})


def aten_allowed(namespace: str, packet: str) -> bool:
    """Whether ``torch.ops.<namespace>.<packet>`` is in the op tables."""
    if namespace == "aten":
        return packet in _ATEN
    if namespace == "tncompile":
        return packet in TNCOMPILE_OPS
    return False


# ----------------------------------------------------------------- module classes
_MODULE_CLASSES: dict[str, type] | None = None
_REGISTERED: dict[str, type] = {}
# exact names of the classes users registered (:func:`~.graphs.allow_module_class`); discarding a
# name from this set withdraws the registration
SAFE_MODULE_CLASSES: set[str] = set()
# torch.nn classes left out: they wrap processes (DataParallel, DDP), or their output's size is
# a setting a file could inflate (upsampling, fold)
_EXCLUDED_NN = {"DataParallel", "DistributedDataParallel", "Upsample", "UpsamplingNearest2d",
                "UpsamplingBilinear2d", "Fold", "Unfold", "MaxUnpool1d", "MaxUnpool2d", "MaxUnpool3d",
                "LazyLinear", "LazyConv1d", "LazyConv2d", "LazyConv3d", "LazyConvTranspose1d",
                "LazyConvTranspose2d", "LazyConvTranspose3d", "LazyBatchNorm1d", "LazyBatchNorm2d",
                "LazyBatchNorm3d", "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d"}
# tncompile's own module classes a compiled model holds
_TNCOMPILE_MODULE_CLASSES = (TTLinear, TTMEmbedding, TTMTiedLinear, TTMEmbeddingBag, TTExperts, ExpertLinear,
                             CollapsedLayer, FastDropout, SelfAttention, FusedAttention, NestedPadding,
                             AttentionDropoutRate, PendingLayer)
# classes of other libraries, by exact name: loaded from their (fixed) module only when a file names them
_LIBRARY_CLASSES = {"transformers.pytorch_utils.Conv1D": ("transformers.pytorch_utils", "Conv1D")}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def module_class_table() -> dict[str, type]:
    """Exact qualified class name -> class, for every module class a file may hold."""
    global _MODULE_CLASSES
    if _MODULE_CLASSES is None:
        table: dict[str, type] = {_qualified(nn.Module): nn.Module}
        for name in dir(nn):
            cls = getattr(nn, name)
            if isinstance(cls, type) and issubclass(cls, nn.Module) and name not in _EXCLUDED_NN \
                    and cls.__module__.startswith("torch.nn.modules."):
                table[_qualified(cls)] = cls
        for cls in _TNCOMPILE_MODULE_CLASSES:
            table[_qualified(cls)] = cls
        _MODULE_CLASSES = table
    return _MODULE_CLASSES


def lookup_module_class(name: str) -> type | None:
    """The class a file's exact ``name`` stands for, or ``None``."""
    cls = module_class_table().get(name)
    if cls is None and name in SAFE_MODULE_CLASSES:
        cls = _REGISTERED.get(name)
    if cls is None and name in _LIBRARY_CLASSES:
        module, attr = _LIBRARY_CLASSES[name]
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            return None
    return cls


def register_module_class(cls: type) -> None:
    _REGISTERED[_qualified(cls)] = cls
    SAFE_MODULE_CLASSES.add(_qualified(cls))


# ----------------------------------------------------------------- records and values
DATACLASSES = {
    "tncompile.runtime.plans.ContractionPlan": ("tncompile.runtime.plans", "ContractionPlan"),
    "tncompile.runtime.plans.Step": ("tncompile.runtime.plans", "Step"),
    "tncompile.runtime.plans.LookupPlan": ("tncompile.runtime.plans", "LookupPlan"),
    "tncompile.formats.layout.TTLayout": ("tncompile.formats.layout", "TTLayout"),
    "tncompile.formats.layout.TTMLayout": ("tncompile.formats.layout", "TTMLayout"),
    "tncompile.ir.program.InputSpec": ("tncompile.ir.program", "InputSpec"),
    "tncompile.ir.program.PassRecord": ("tncompile.ir.program", "PassRecord"),
    "tncompile.options.CompileOptions": ("tncompile.options", "CompileOptions"),
    "tncompile.train.history.History": ("tncompile.train.history", "History"),
}


def dataclass_of(name: str) -> type | None:
    entry = DATACLASSES.get(name)
    if entry is None:
        return None
    return getattr(importlib.import_module(entry[0]), entry[1])


TORCH_VALUES: dict[str, Any] = {}
for _name in ("float64 float32 float16 bfloat16 complex64 complex128 int64 int32 int16 int8 uint8 bool "
              "float8_e4m3fn float8_e5m2 strided sparse_coo contiguous_format channels_last "
              "channels_last_3d preserve_format").split():
    if hasattr(torch, _name):
        TORCH_VALUES[_name] = getattr(torch, _name)

# safetensors dtype codes -> torch dtypes (the container reader accepts these only)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
for _code, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("C64", "complex64")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_code] = getattr(torch, _attr)


# ----------------------------------------------------------------- pytree node types
_PYTREE_BUILTIN = {None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict",
                   "collections.defaultdict", "collections.namedtuple", "collections.deque",
                   "torch.fx.immutable_collections.immutable_list",
                   "torch.fx.immutable_collections.immutable_dict"}
# transformers' ModelOutput classes: the module is transformers' own output module or a model's
# modeling module; the pattern admits nothing else, and the class must turn out to be a ModelOutput
_TRANSFORMERS_OUTPUT = re.compile(
    r"(transformers\.modeling_outputs|transformers\.models\.[a-z0-9_]+\.modeling_[a-z0-9_]+)\.([A-Z][A-Za-z0-9_]*)\Z")


def pytree_type_allowed(name: Any) -> tuple[bool, str | None]:
    """``(allowed, module to import first or None)`` for a serialized pytree type name."""
    if name in _PYTREE_BUILTIN:
        return True, None
    if isinstance(name, str):
        m = _TRANSFORMERS_OUTPUT.match(name)
        if m:
            return True, m.group(1)
    return False, None
