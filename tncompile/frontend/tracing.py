"""Frontend: capture a model as a ``torch.fx.GraphModule``.

First ``torch.fx`` symbolic tracing with every compressible layer kept as a
leaf (``call_module``). Models fx cannot trace (HuggingFace transformers 5.x,
data-dependent Python) go through ``torch.export.export(strict=False)`` with
every input dimension dynamic where the model allows (``Dim.AUTO``); the
exported ATen graph is then *outlined*: the nodes of each compressible layer
(``aten.linear``, ``aten.embedding``, HF ``Conv1D``'s ``view/addmm/view``) and
of each ``nn.Dropout`` are folded back into one ``call_module`` node on the
model's own module, found through ``node.meta["nn_module_stack"]``. Both paths
therefore hand the passes the same kind of graph. Mixture-of-experts weights
(fused 3-D parameters multiplied by a grouped GEMM) are outlined into an
:class:`~tncompile.runtime.layers.experts.ExpertLinear` named after the parameter.
"""
from __future__ import annotations

import inspect
import operator
import warnings
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

from .dropout_modes import follow_training_mode
from ..errors import TraceError
from ..ir.modules import rehome_reads
from ..ir.program import InputSpec
from .layers import is_compressible
from .nn_trace import attention_parts, traced_call
from ..runtime.fused.attention import NestedPadding, SelfAttention
from ..runtime.layers.experts import ExpertLinear
from ..runtime.layers.module_kinds import embedding_on, linear_on, replaces_forward

__all__ = ["trace", "split_example_inputs"]


class LeafTracer(fx.Tracer):
    """fx tracer that keeps compressible layers as leaves. A subclass of
    ``nn.Embedding`` / ``nn.Linear`` with a forward of its own (BART's
    positional embedding adds an offset, scaled embeddings multiply) is traced
    into, so that its extra operations stay in the graph around the plain
    lookup / product (``canonicalize`` makes that a module call)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if own_forward(m):
            return False
        return is_compressible(m) or isinstance(m, (SelfAttention, NestedPadding)) or super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward, args: tuple, kwargs: dict):
        """``nn.TransformerEncoder`` and its parts run a traceable spelling (:mod:`.nn_trace`)."""
        spelled = traced_call(m, args, kwargs)
        if spelled is None:
            return super().call_module(m, forward, args, kwargs)
        path = self.path_of_module(m)
        with fx.proxy.ScopeContextManager(self.scope, fx.proxy.Scope(path, type(m))) as _scope:
            self.module_stack[_scope.module_path] = (path, _scope.module_type)
            try:
                return spelled()
            finally:
                self.module_stack.popitem()


def own_forward(module: nn.Module) -> bool:
    """An ``nn.Embedding`` / ``nn.Linear`` subclass whose forward is not the base class's."""
    return replaces_forward(module, (nn.Embedding, nn.Linear))


def plain_copy(module: nn.Module) -> nn.Module:
    """A plain ``nn.Embedding`` / ``nn.Linear`` on ``module``'s own parameters."""
    if isinstance(module, nn.Embedding):
        return embedding_on(module.weight, module.padding_idx, module.max_norm, module.norm_type,
                            module.scale_grad_by_freq, module.sparse, module.training)
    return linear_on(module.weight, module.bias, module.training)


def split_example_inputs(example_inputs: Any) -> tuple[tuple, dict] | None:
    """Normalize ``example_inputs`` (tuple of args, dict of kwargs, or one tensor)."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    raise TypeError("example_inputs must be a tuple of positional inputs, a dict of keyword "
                    f"inputs or a single tensor, got {type(example_inputs).__name__}")


def trace(model: nn.Module, example_inputs: Any = None, run_real: bool = True) -> tuple[fx.GraphModule, InputSpec]:
    """Capture ``model``; see the module docstring.

    Shapes are propagated on fake tensors (``FakeTensorMode``: shapes and dtypes, no data,
    nothing allocated), so example inputs of any size cost no memory. Where a model cannot
    run on fake tensors (it reads a value), it runs on the inputs themselves -- unless
    ``run_real`` is False (inputs read from a file), which then raises ``ValueError``.

    Raises
    ------
    TraceError
        When fx fails and there are no ``example_inputs`` for export, or both fail.
    ValueError
        When ``example_inputs`` do not fit the model.
    """
    example = split_example_inputs(example_inputs)
    name = type(model).__name__
    try:
        gm = _fx_graph(model)
    except Exception as fx_err:  # fx raises many kinds
        if example is None:
            raise TraceError(
                f"torch.fx could not trace {name} ({type(fx_err).__name__}: {fx_err}). "
                f"Pass example_inputs=(...) (a tuple of positional inputs or a dict of keyword "
                f"inputs, e.g. {{'input_ids': ids}}) so tncompile can use torch.export instead."
            ) from fx_err
        return _trace_export(model, *example, fx_err)
    if example is not None:
        try:
            _propagate_shapes(gm, model, *example, run_real=run_real)
        except ValueError:
            omitted = _omitted_none_arguments(model, *example)
            if not omitted:
                raise
            # ``if weights is not None:`` was traced on a proxy: the graph always uses the
            # argument the example leaves out. Trace again with it fixed to None (fx then
            # refuses a value for it, by name).
            gm = _fx_graph(model, concrete_args=omitted)
            _propagate_shapes(gm, model, *example, run_real=run_real)
    return gm, InputSpec("fx", described=_describe(example))


def _fx_graph(model: nn.Module, concrete_args: dict[str, Any] | None = None) -> fx.GraphModule:
    """``model`` traced by torch.fx (``concrete_args`` fixed), in its training mode."""
    with attention_parts(model):  # nn.MultiheadAttention's projections as modules, while tracing
        graph = LeafTracer().trace(model, concrete_args=concrete_args)
        gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    gm.training = model.training
    follow_training_mode(gm, model, model.training)
    _drop_annotations(gm)
    return gm


def _omitted_none_arguments(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, None]:
    """``{name: None}`` for each argument of ``model.forward`` that the example leaves out and
    that defaults to ``None``."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    return {name: None for name, p in signature.parameters.items()
            if name not in bound.arguments and p.default is None
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _drop_annotations(gm: fx.GraphModule) -> None:
    """Forget Python type annotations of graph values: they are cosmetic, and
    fx cannot pickle the generated code that refers to them."""
    for node in gm.graph.nodes:
        node.type = None
    gm.recompile()


def _describe(example) -> dict[str, str]:
    if example is None:
        return {}
    return InputSpec.from_example("fx", *example).described


def _propagate_shapes(gm: fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict, run_real: bool = True) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"example_inputs do not fit {type(model).__name__}.forward: {e}") from e
    bound.apply_defaults()
    values = [bound.arguments.get(p.target, p.args[0] if p.args else None) for p in placeholders]
    try:
        try:
            with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
                _ShapeRecorder(gm).run(*pytree.tree_map_only(torch.Tensor, fake.from_tensor, values))
        except _NodeFailed:
            if not run_real:
                raise
            with torch.no_grad():  # the model reads a value (or fails): run it on the inputs themselves
                _ShapeRecorder(gm).run(*values)
    except _NodeFailed as failed:
        e, node = failed.__cause__, failed.node
        where = (f"layer {node.target!r} ({type(gm.get_submodule(node.target)).__name__})"
                 if node.op == "call_module" else f"the operation {node.name!r} ({node.format_node()})")
        raise ValueError(f"example_inputs do not fit {type(model).__name__}: {where} failed with "
                         f"{type(e).__name__}: {e}") from e


class _NodeFailed(Exception):
    def __init__(self, node: fx.Node):
        super().__init__(node.format_node())
        self.node = node


class _ShapeRecorder(fx.Interpreter):
    """Run the graph once and record each value's ``tensor_meta`` (what fx's
    ``ShapeProp`` does, but a failure names the node and keeps its real cause
    instead of printing a traceback to stderr)."""

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as e:
            raise _NodeFailed(n) from e
        tensors = [v for v in pytree.tree_leaves(result) if isinstance(v, torch.Tensor)]
        if tensors:
            n.meta["tensor_meta"] = fx.node.map_aggregate(
                result, lambda v: _extract_tensor_metadata(v) if isinstance(v, torch.Tensor) else v)
        n.meta["type"] = type(result)
        return result


# ----------------------------------------------------------------- export path
def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict):
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(v):
        if isinstance(v, torch.Tensor):
            return {i: torch.export.Dim.AUTO for i in range(v.dim())}
        return None

    return {k: pytree.tree_map(spec, v) for k, v in bound.arguments.items()}


def _without_cache(model: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` with ``use_cache=False`` when ``model.forward`` takes ``use_cache``
    (HF decoders) and the caller did not set it: a key/value cache is generation
    state, which a training graph neither needs nor can return (``torch.export``
    rejects GPT-2's ``DynamicCache`` output; Llama's would be dropped)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    if "use_cache" not in params:
        return kwargs
    if kwargs.get("use_cache"):
        raise ValueError(f"example_inputs set use_cache=True for {type(model).__name__}: tncompile compiles "
                         "training graphs, which return no key/value cache. Leave use_cache out (it is "
                         "then fixed to False) or set it to False.")
    return {**kwargs, "use_cache": False}


def _trace_export(model: nn.Module, args: tuple, kwargs: dict, fx_err: Exception
                  ) -> tuple[fx.GraphModule, InputSpec]:
    name = type(model).__name__
    kwargs = _without_cache(model, kwargs)
    try:
        dynamic = _dynamic_shapes(model, args, kwargs)
    except TypeError as e:
        raise ValueError(f"example_inputs do not fit {name}.forward: {e}") from e
    try:
        ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as ex_err:
        raise TraceError(
            f"could not capture {name}: torch.fx failed ({type(fx_err).__name__}: {fx_err}) and "
            f"torch.export(strict=False) on example_inputs failed ({type(ex_err).__name__}: "
            f"{str(ex_err).splitlines()[0] if str(ex_err) else ''}). Check that the model runs on "
            f"example_inputs; outputs that are not tensors (or containers of them) must be turned "
            f"off in example_inputs."
        ) from ex_err
    stateful = ep.module()
    graph = stateful.graph
    shapes = _shape_constraints(graph, ep.range_constraints)
    for node in list(graph.nodes):  # shape guards live in an unpicklable submodule: InputSpec.shapes checks them
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    graph._tracer_cls = None  # export's tracer cannot re-trace the code when unpickling
    gm = fx.GraphModule(stateful, graph, class_name=name)
    gm._tracer_cls, gm._tracer_extras = None, {}
    _outline_modules(gm, model)
    _outline_experts(gm)
    gm.training = model.training
    follow_training_mode(gm, model, model.training)
    spec = InputSpec.from_example("export", args, kwargs)
    spec.shapes = shapes
    _warn_size_one(spec)
    return gm, spec


def _warn_size_one(spec: InputSpec) -> None:
    """torch.export fixes every size-1 dim of the example inputs: say so at compile time."""
    fixed = [f"{name} dim {i}" for name, dims in spec.shapes for i, d in enumerate(dims) if d == 1]
    if fixed:
        warnings.warn(f"example_inputs have size 1 at {', '.join(fixed)}: torch.export fixes size-1 dims, so the "
                      "compiled model accepts only size 1 there. Pass examples of size >= 2 (e.g. a batch of 2) "
                      "to keep those dims dynamic.", stacklevel=4)


def _finite(bound) -> int | None:
    """A range bound as an ``int``; ``None`` for an infinite or missing one."""
    if bound is None or "oo" in str(bound):
        return None
    try:
        return int(bound)
    except (TypeError, ValueError):
        return None


def _shape_constraints(graph: fx.Graph, ranges: dict) -> tuple:
    """``InputSpec.shapes`` of an exported graph: every tensor input's sizes,
    fixed (``int``) or a symbol with its range."""
    out = []
    for node in graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if not isinstance(val, torch.Tensor):
            continue
        dims = []
        for d in val.shape:
            if isinstance(d, int):
                dims.append(int(d))
                continue
            expr = d.node.expr
            if getattr(expr, "is_number", False):  # specialized by the trace
                dims.append(int(expr))
                continue
            if not getattr(expr, "is_Symbol", False):
                dims.append(("", 0, None))  # a size computed from others: checked through them
                continue
            vr = ranges.get(expr)
            dims.append((str(expr), _finite(getattr(vr, "lower", None)) or 0, _finite(getattr(vr, "upper", None))))
        out.append((node.name, tuple(dims)))
    return tuple(out)


_CORE_OPS = {torch.ops.aten.embedding.default: 1, torch.ops.aten.linear.default: 0}  # op -> input position


def _outline_core_op(gm: fx.GraphModule, path: str, module: nn.Module, nodes: list[fx.Node]) -> None:
    """Replace the single ``aten.embedding`` / ``aten.linear`` among a module's
    nodes by a call of a plain copy of it (:func:`plain_copy`) at ``path``."""
    core = [n for n in nodes if n.target in _CORE_OPS]
    want = torch.ops.aten.embedding.default if isinstance(module, nn.Embedding) else torch.ops.aten.linear.default
    if len(core) != 1 or core[0].target is not want:
        return  # not one plain lookup / product: leave the ATen ops (the layer stays dense)
    node = core[0]
    rehome_reads(gm, path)
    gm.set_submodule(path, plain_copy(module), strict=False)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(path, (node.args[_CORE_OPS[node.target]],))
    new.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")}
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


_BAG_OPS = {torch.ops.aten.embedding_bag.padding_idx, torch.ops.aten.embedding_bag.default,
            torch.ops.aten._embedding_bag.default, torch.ops.aten._embedding_bag_forward_only.default}


def _outline_bag(gm: fx.GraphModule, path: str, module: nn.EmbeddingBag, nodes: list[fx.Node]) -> None:
    """Replace the ``aten.embedding_bag`` of an ``nn.EmbeddingBag`` (args: weight,
    indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights, ...)
    by a call of the module with ``(indices, offsets, per_sample_weights)``; the
    reshape and offsets export made for a 2-D input stay in the graph."""
    bags = [n for n in nodes if n.target in _BAG_OPS]
    if len(bags) != 1:
        return
    node = bags[0]
    args = list(node.args) + [None] * (9 - len(node.args))
    outputs = [u for u in node.users if u.target is operator.getitem]
    result = [u for u in outputs if u.args[1] == 0]
    if len(result) != 1 or any(u.users for u in outputs if u.args[1] != 0) or len(outputs) != len(node.users):
        return  # something reads the bag's other outputs: leave the ATen op
    indices, offsets, weights = args[1], args[2], args[6]
    gm.set_submodule(path, module, strict=False)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(path, (indices, offsets), {"per_sample_weights": weights} if weights is not None else {})
    new.meta = {k: v for k, v in result[0].meta.items() if k in ("val", "tensor_meta", "nn_module_stack")}
    result[0].replace_all_uses_with(new)
    for u in outputs:
        gm.graph.erase_node(u)
    gm.graph.erase_node(node)


def _outline_target(module: nn.Module) -> bool:
    return is_compressible(module) or isinstance(module, nn.Dropout)


def _outline_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    """Fold each call of a compressible / dropout module back into a ``call_module`` node."""
    groups: dict[str, tuple[str, list[fx.Node]]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        key, (path, _) = next(reversed(stack.items()))
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if _outline_target(module):
            groups.setdefault(key, (path, []))[1].append(node)
    for path, nodes in groups.values():
        module = model.get_submodule(path)
        if isinstance(module, nn.EmbeddingBag):
            _outline_bag(gm, path, module, nodes)
            continue
        if own_forward(module):  # only its lookup / product: its own extra operations stay in the graph
            _outline_core_op(gm, path, module, nodes)
            continue
        members = set(nodes)
        tensor_inputs = {a for n in nodes for a in n.all_input_nodes
                         if a not in members and a.op != "get_attr"
                         and isinstance(a.meta.get("val"), torch.Tensor)}
        escaping = [n for n in nodes if any(u not in members for u in n.users)]
        if len(tensor_inputs) != 1 or len(escaping) != 1:
            continue  # not a clean single-input/single-output call: leave it as ATen ops
        (inp,), out = tuple(tensor_inputs), escaping[0]
        gm.set_submodule(path, model.get_submodule(path), strict=False)
        with gm.graph.inserting_before(out):
            new = gm.graph.call_module(path, (inp,))
        new.meta = {k: v for k, v in out.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")}
        out.replace_all_uses_with(new)
        for n in reversed(nodes):
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()


# grouped GEMMs of mixture-of-experts layers: (rows sorted by expert, (experts, in, out), offsets)
GROUPED_MM_OPS = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback", "tncompile::grouped_mm"})


def _op_name(node: fx.Node) -> str | None:
    name = getattr(node.target, "name", None)
    return name() if callable(name) and node.op == "call_function" else None


def _expert_weight(arg) -> tuple[fx.Node, bool] | None:
    """``(get_attr node, transposed)`` when ``arg`` reads a 3-D parameter as
    ``(experts, in, out)``: the parameter itself (stored transposed) or
    ``transpose(W, -2, -1)`` of an ``(experts, out, in)`` one."""
    if not isinstance(arg, fx.Node):
        return None
    if arg.op == "get_attr":
        return arg, True
    if (arg.op == "call_function" and arg.target in (torch.ops.aten.transpose.int, torch.transpose)
            and isinstance(arg.args[0], fx.Node) and arg.args[0].op == "get_attr"
            and len(arg.users) == 1 and {d % 3 for d in arg.args[1:3]} == {1, 2}):
        return arg.args[0], False
    return None


def _outline_experts(gm: fx.GraphModule) -> None:
    """Fold each grouped GEMM over a fused expert parameter into a ``call_module``
    of an :class:`~tncompile.runtime.layers.experts.ExpertLinear` at the parameter's path."""
    changed = False
    for node in list(gm.graph.nodes):
        if _op_name(node) not in GROUPED_MM_OPS:
            continue
        args = list(node.args) + [node.kwargs[k] for k in ("weight", "offs") if k in node.kwargs]
        if len(args) != 3 or set(node.kwargs) - {"weight", "offs"}:
            continue
        found = _expert_weight(args[1])
        if found is None:
            continue
        attr, transposed = found
        try:
            param = gm.get_parameter(attr.target)
        except AttributeError:
            continue
        if param.dim() != 3 or len(attr.users) != 1:
            continue  # the parameter is read elsewhere too: leave the graph as it is
        parent_path, _, leaf = attr.target.rpartition(".")
        parent = gm.get_submodule(parent_path)
        del parent._parameters[leaf]
        gm.set_submodule(attr.target, ExpertLinear(param, transposed=transposed), strict=False)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(attr.target, (args[0], args[2]))
        new.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")}
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
