"""Renderings of a :class:`~tncompile.ir.Program`: text, JSON and graphviz dot."""
from __future__ import annotations

import json
from typing import Any

import torch
from torch import fx

from ..planning.layer_info import fmt_count, layer_info, ranks_str
from ..runtime.kernels.plans import ContractionPlan
from .modules import module_at

__all__ = ["to_text", "to_json", "to_dot"]


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).replace('torch.', '')}[{','.join(str(s) for s in val.shape)}]"
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return f"{str(tm.dtype).replace('torch.', '')}[{','.join(str(s) for s in tm.shape)}]"
    return ""


def _target(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return str(t)  # aten.linear.default
    module, name = getattr(t, "__module__", None), getattr(t, "__name__", repr(t))
    return f"{module.lstrip('_')}.{name}" if module else name


def _node_module(gm: fx.GraphModule, node: fx.Node):
    """The module a ``call_module`` node calls, or a ``get_attr`` node passes
    on (a fused call's layers); ``None`` for every other node."""
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    if node.op == "get_attr":
        return module_at(gm, node.target)
    return None


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    return repr(a)


def _layer_text(info: dict) -> str:
    if info["tn_params"] is None:
        return f"pending {info['format']} {info['modes']} ranks=pending, dense {fmt_count(info['dense_params'])}"
    s = (f"{info['format']} {info['modes']} ranks={ranks_str(info['ranks'])} "
         f"params {fmt_count(info['dense_params'])}->{fmt_count(info['tn_params'])} "
         f"({info['ratio']:.2%})")
    if info.get("tied_to"):
        s += f" tied_to={info['tied_to']}"
    if info.get("dense_flops_per_token"):
        s += (f" flops/token {fmt_count(info['dense_flops_per_token'])}"
              f"->{fmt_count(info['tn_flops_per_token'])}")
    if info["pending"]:
        s = "pending " + s
    return s


def _plans_text(module) -> str:
    """One indented line per planned bucket (order, flops, largest, speed-up)."""
    plans = getattr(module, "plans", None) or {}
    if not plans:
        return ""
    names = ["x"] + [f"G{k}" for k in range(len(module.layout.site_sizes))]
    return "".join(f"\n    #   plan {plans[b].describe(names)}" for b in sorted(plans))


def _header(program) -> list[str]:
    p = program.num_params()
    passes = " > ".join(r.name for r in program.history) or "(none)"
    lines = [f"# tncompile program  frontend={program.inputs.frontend}  passes: {passes}",
             f"# params {program.original_params:,} -> {p:,}  ratio {p / program.original_params:.4f}"
             f" ({program.original_params / max(p, 1):.1f}x smaller)"]
    if program.inputs.described:
        lines.append("# inputs " + ", ".join(f"{k}: {v}" for k, v in program.inputs.described.items()))
    for k, record in enumerate(program.history, 1):
        matches = getattr(record, "matches", None)  # records saved before rules existed have none
        if matches:
            counts = ", ".join(f"{rule} {n}" for rule, n in matches.items())
            lines.append(f"# matches {k:02d}-{record.name}: {counts}")
    return lines


def to_text(program) -> str:
    """One line a node; tensorized nodes show format, modes, ranks, sizes and FLOPs."""
    gm = program.graph_module
    lines = _header(program)
    for node in gm.graph.nodes:
        shape = _shape(node)
        if node.op == "placeholder":
            body = f"%{node.name} = input"
        elif node.op == "output":
            body = f"return {_arg(node.args[0])}"
        elif node.op == "get_attr":
            kind = "param" if _node_module(gm, node) is None else "layer"
            body = f"%{node.name} = {kind} {node.target}"
        else:
            args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
            body = f"%{node.name} = {_target(node)}({args})"
        extra = ""
        mod = _node_module(gm, node)
        if mod is not None:
            info = layer_info(mod)
            if info is not None:
                extra = "  # " + _layer_text(info) + _plans_text(mod)
                if node.target in program.notes:
                    extra += f"; {program.notes[node.target]}"
            elif node.target in program.notes:
                extra = f"  # dense {type(mod).__name__}: {program.notes[node.target]}"
            else:
                extra = f"  # {type(mod).__name__}"
        lines.append(f"{body}{'  : ' + shape if shape else ''}{extra}")
    return "\n".join(lines) + "\n"


def _plan_json(bucket: int, plan) -> dict[str, Any]:
    out = {"rows": bucket, "order": plan.order(), "fwd_flops": 2 * plan.fwd_flops,
           "largest": plan.largest, "speedup_vs_naive": plan.speedup}
    if isinstance(plan, ContractionPlan):
        out.update(strategy=plan.strategy, bwd_flops=2 * plan.bwd_flops)
    else:
        out.update(strategy="lookup-split", split=plan.split)
    return out


def to_json(program) -> str:
    """Machine-readable form: header, history, nodes (with layer info), notes."""
    gm = program.graph_module
    nodes = []
    for node in gm.graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op, "target": _target(node),
                                 "args": [_arg(a) for a in node.args], "shape": _shape(node)}
        mod = _node_module(gm, node)
        if mod is not None:
            entry["module_type"] = type(mod).__name__
            info = layer_info(mod)
            if info is not None:
                entry["layer"] = info
                plans = getattr(mod, "plans", None) or {}
                entry["plans"] = [_plan_json(b, p) for b, p in sorted(plans.items())]
            if node.target in program.notes:
                entry["note"] = program.notes[node.target]
        nodes.append(entry)
    doc = {
        "frontend": program.inputs.frontend,
        "inputs": program.inputs.described,
        "original_params": program.original_params,
        "params": program.num_params(),
        "ratio": program.ratio,
        "history": [vars(r) for r in program.history],
        "notes": program.notes,
        "nodes": nodes,
    }
    return json.dumps(doc, indent=1, default=str)


def to_dot(program) -> str:
    """Graphviz digraph; tensorized layers are filled boxes."""
    gm = program.graph_module
    out = ["digraph program {", "  rankdir=TB; node [shape=box, fontsize=10];"]
    for node in gm.graph.nodes:
        label = f"{node.name}\\n{_target(node) if node.op != 'placeholder' else 'input'}"
        style = ""
        mod = _node_module(gm, node)
        if mod is not None:
            info = layer_info(mod)
            if info is not None:
                label += f"\\n{info['format']} {info['modes']} r={ranks_str(info['ranks'])}"
                style = ', style=filled, fillcolor="#cde8ff"'
        label = label.replace('"', "'")
        out.append(f'  "{node.name}" [label="{label}"{style}];')
        for inp in node.all_input_nodes:
            out.append(f'  "{inp.name}" -> "{node.name}";')
    out.append("}")
    return "\n".join(out) + "\n"
