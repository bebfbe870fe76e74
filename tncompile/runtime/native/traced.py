"""The native kernels as ``torch.library.custom_op``\\ s: traceable, with fake kernels and autograd.

The C++ kernels (:mod:`tncompile.runtime.native`) serve the eager CPU path,
called inside tncompile's autograd Functions with no per-call Python on the
way. Tracers cannot run them: under ``FakeTensorMode``, ``torch.export`` or
``torch.compile`` they see real C++ code meeting tensors without data. The ops
here wrap the same kernels for those tracers:

* ``register_fake``: the output's shape and dtype from the inputs' (what
  ``FakeTensorMode`` and the compilers run instead of the kernel);
* ``register_autograd``: each forward op's backward is another op here, so
  forward and backward trace as two opaque calls;
* off CPU, for dtypes the kernels lack, or where they are not built, each op
  computes the same with PyTorch's own ops.

``torch.library.opcheck`` checks every op against its fake kernel and its
autograd formula (``tests/test_native_ops.py``). Ops: ``traced_thin_expand``
(``t @ w + bias``), ``traced_thin_project`` (``x @ w``), ``traced_ffn``
(``act(t @ w1 + b1) @ w2``), and the backward ops of the first and third.
A TTM lookup traces as one op of its own, which calls the native gathered
product inside (:mod:`tncompile.runtime.traced_lookup`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native_ops

__all__ = ["thin_expand", "thin_project", "ffn", "separate_outputs", "empty_grad"]

_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "relu": F.relu}


def _native(*tensors: Tensor):
    """The C++ ops when every tensor is a CPU fp32/fp64 tensor of one dtype, else ``None``."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in (torch.float32, torch.float64):
        return None
    if any(t.device.type != "cpu" or t.dtype != first.dtype for t in tensors[1:]):
        return None
    return native_ops()


def empty_grad(like: Tensor) -> Tensor:
    """What a backward op returns for a gradient nobody asked for."""
    return like.new_empty((0,))


def separate_outputs(outputs: list[Tensor], inputs: tuple[Tensor, ...]) -> list[Tensor]:
    """Copy any output that shares memory with an input or an earlier output
    (the kernels return slices of one buffer; a custom op's outputs may not alias)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        out.append(t)
    return out


# ----------------------------------------------------------------- t @ w + bias
@torch.library.custom_op("tncompile::traced_thin_expand", mutates_args=())
def thin_expand(t: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """``t (M, r) @ w (r, N) + bias (N,)`` -> ``(M, N)``."""
    ops = _native(t, w, *([bias] if bias is not None else []))
    if ops is not None:
        return ops.thin_expand(t, w, bias).contiguous()
    return torch.addmm(bias, t, w) if bias is not None else t @ w


@thin_expand.register_fake
def _(t, w, bias):
    return t.new_empty((t.shape[0], w.shape[1]))


@torch.library.custom_op("tncompile::traced_thin_expand_backward", mutates_args=())
def thin_expand_backward(g: Tensor, t: Tensor, w: Tensor, need_t: bool, need_w: bool,
                         need_bias: bool) -> list[Tensor]:
    """``(g @ w.T, t.T @ g, g.sum(0))``, each only if needed (else an empty tensor)."""
    ops = _native(g, t, w)
    if ops is not None:
        d_t, d_w, d_bias = ops.thin_expand_backward(g, t, w, need_t, need_w, need_bias)
    else:
        d_t, d_w, d_bias = g @ w.t(), t.t() @ g, g.sum(0)
    return separate_outputs([d_t.contiguous() if need_t else empty_grad(g), d_w.contiguous() if need_w else empty_grad(g),
                      d_bias.contiguous() if need_bias else empty_grad(g)], (g, t, w))


@thin_expand_backward.register_fake
def _(g, t, w, need_t, need_w, need_bias):
    return [g.new_empty(t.shape) if need_t else empty_grad(g), g.new_empty(w.shape) if need_w else empty_grad(g),
            g.new_empty((w.shape[1],)) if need_bias else empty_grad(g)]


def _thin_expand_setup(ctx, inputs, output):
    t, w, bias = inputs
    ctx.save_for_backward(t, w)
    ctx.has_bias = bias is not None


def _thin_expand_grad(ctx, grad):
    t, w = ctx.saved_tensors
    need_t, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_bias = ctx.has_bias and ctx.needs_input_grad[2]
    d_t, d_w, d_bias = thin_expand_backward(grad, t, w, need_t, need_w, need_bias)
    return (d_t if need_t else None), (d_w if need_w else None), (d_bias if need_bias else None)


thin_expand.register_autograd(_thin_expand_grad, setup_context=_thin_expand_setup)


# ----------------------------------------------------------------- x @ w
@torch.library.custom_op("tncompile::traced_thin_project", mutates_args=())
def thin_project(x: Tensor, w: Tensor) -> Tensor:
    """``x (M, N) @ w (N, r)`` -> ``(M, r)``."""
    ops = _native(x, w)
    if ops is not None and x.is_contiguous():
        return ops.thin_project(x, w).contiguous()
    return x @ w


@thin_project.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[1]))


def _thin_project_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _thin_project_grad(ctx, grad):
    x, w = ctx.saved_tensors
    d_x = thin_expand(grad, w.t(), None) if ctx.needs_input_grad[0] else None  # (M, r) @ (r, N): thin in
    d_w = x.t() @ grad if ctx.needs_input_grad[1] else None
    return d_x, d_w


thin_project.register_autograd(_thin_project_grad, setup_context=_thin_project_setup)


# ----------------------------------------------------------------- act(t @ w1 + b1) @ w2
@torch.library.custom_op("tncompile::traced_ffn", mutates_args=())
def ffn(t: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, activation: str) -> Tensor:
    """``act(t (M, r1) @ w1 (r1, F) + b1) @ w2 (F, r2)`` -> ``(M, r2)``, the hidden ``(M, F)`` never kept."""
    ops = _native(t, w1, w2, *([b1] if b1 is not None else []))
    if ops is not None:
        return ops.ffn_forward(t, w1, b1, w2, activation).contiguous()
    h = torch.addmm(b1, t, w1) if b1 is not None else t @ w1
    return _ACTIVATIONS[activation](h) @ w2


@ffn.register_fake
def _(t, w1, b1, w2, activation):
    return t.new_empty((t.shape[0], w2.shape[1]))


@torch.library.custom_op("tncompile::traced_ffn_backward", mutates_args=())
def ffn_backward(du: Tensor, t: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, activation: str,
                 need_t: bool, need_w1: bool, need_b1: bool, need_w2: bool) -> list[Tensor]:
    """Gradients of ``t, w1, b1, w2`` (empty when not needed), the hidden activation recomputed."""
    ops = _native(du, t, w1, w2, *([b1] if b1 is not None else []))
    if ops is not None:
        grads = ops.ffn_backward(du, t, w1, b1, w2, activation, need_t, need_w1, need_b1, need_w2)
    else:  # the same gradients from PyTorch ops (a custom op's body runs below autograd)
        h = torch.addmm(b1, t, w1) if b1 is not None else t @ w1
        d_a = du @ w2.t()
        if activation == "relu":
            d_h = torch.ops.aten.threshold_backward(d_a, h, 0.0)
        else:
            d_h = torch.ops.aten.gelu_backward(d_a, h, approximate="tanh" if activation == "gelu_tanh" else "none")
        grads = [d_h @ w1.t(), t.t() @ d_h, d_h.sum(0), _ACTIVATIONS[activation](h).t() @ du]
    needs = (need_t, need_w1, need_b1 and b1 is not None, need_w2)
    return separate_outputs([g.contiguous() if need and g is not None else empty_grad(du) for g, need in zip(grads, needs)],
                     (du, t, w1, w2, *([b1] if b1 is not None else [])))


@ffn_backward.register_fake
def _(du, t, w1, b1, w2, activation, need_t, need_w1, need_b1, need_w2):
    shapes = (t.shape, w1.shape, (w1.shape[1],), w2.shape)
    needs = (need_t, need_w1, need_b1 and b1 is not None, need_w2)
    return [du.new_empty(s) if need else empty_grad(du) for s, need in zip(shapes, needs)]


def _ffn_setup(ctx, inputs, output):
    t, w1, b1, w2, activation = inputs
    ctx.save_for_backward(t, w1, b1, w2)
    ctx.activation = activation


def _ffn_grad(ctx, du):
    t, w1, b1, w2 = ctx.saved_tensors
    need = ctx.needs_input_grad
    d_t, d_w1, d_b1, d_w2 = ffn_backward(du.contiguous(), t, w1, b1, w2, ctx.activation, need[0], need[1],
                                         need[2] and b1 is not None, need[3])
    return ((d_t if need[0] else None), (d_w1 if need[1] else None),
            (d_b1 if need[2] and b1 is not None else None), (d_w2 if need[3] else None), None)


ffn.register_autograd(_ffn_grad, setup_context=_ffn_setup)
