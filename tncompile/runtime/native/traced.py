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
(``act(t @ w1 + b1) @ w2``), ``traced_dropout`` and ``traced_attention`` (attention
with dropout), and the backward ops of all but the second. The dropout ops take their
seed as a tensor (:func:`seed`, drawn in the traced graph), so each op is a pure
function of its inputs: a compiler may reorder or recompute it safely.
A TTM lookup traces as one op of its own, which calls the native gathered
product inside (:mod:`tncompile.runtime.kernels.traced_lookup`).
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from .loader import native_ops

__all__ = ["constant_while_traced", "never_traced", "traced_kernels", "thin_expand", "thin_project", "ffn", "dropout", "attention", "seed", "separate_outputs", "empty_grad"]

_THIS = sys.modules[__name__]  # what traced_kernels hands out: this module
_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "relu": F.relu}


def traced_kernels(t: torch.Tensor):
    """While ``torch.compile`` traces, the native kernels as traceable custom
    ops (:mod:`.traced`: fake kernels and autograd registered) when they apply
    to ``t`` -- a CPU fp32/fp64 tensor, no autocast, the kernels built -- else
    ``None``. Outside tracing always ``None``: eager code calls :func:`kernels_for`."""
    if (not torch.compiler.is_compiling() or t.device.type != "cpu"
            or t.dtype not in (torch.float32, torch.float64) or torch.is_autocast_enabled("cpu")
            or not _available()):
        return None
    return _THIS


def constant_while_traced(fn):
    """``torch.compiler.assume_constant_result(fn)`` without its import of ``torch._dynamo``
    (about 1.5-3 s, most of ``import tncompile`` for a user who never calls ``torch.compile``):
    the same mark Dynamo reads, set the same way (``tests/test_import_cost.py`` checks that
    torch's decorator sets exactly these attributes, so a torch that changes it fails there)."""
    fn._dynamo_marked_constant = True
    return fn


def never_traced(fn):
    """``torch.compiler.disable(fn)``, made on the first call after ``torch._dynamo`` is
    imported (``disable`` imports it; without it nothing can be tracing, and ``fn`` runs as
    it is). For host-side work reached under ``torch.compile`` only through a
    :func:`constant_while_traced` function (which Dynamo runs eagerly), so the call that
    makes it is an eager one."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)
    return call


@constant_while_traced
def _available() -> bool:
    """Whether the kernels are (or can be) built: run eagerly while tracing, its answer a constant."""
    return native_ops() is not None


def _native(*tensors: Tensor):
    """The C++ ops when every tensor is a CPU fp32/fp64 tensor of one dtype, else ``None``."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in (torch.float32, torch.float64):
        return None
    if any(t.device.type != "cpu" or t.dtype != first.dtype for t in tensors[1:]):
        return None
    return native_ops()


def seed() -> Tensor:
    """A seed for the dropout ops, drawn from PyTorch's generator inside the traced graph
    (an int64 scalar; under ``torch.compile`` the compiler's own random stream)."""
    return torch.randint(0, 2 ** 62, (), dtype=torch.int64)


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


# ----------------------------------------------------------------- dropout
@torch.library.custom_op("tncompile::traced_dropout", mutates_args=())
def dropout(x: Tensor, p: float, seed: Tensor) -> tuple[Tensor, Tensor]:
    """``(x`` with each element zeroed with probability ``p`` and the rest scaled by
    ``1 / (1 - p)``, the boolean keep-mask``)``, drawn from the counter-based generator
    keyed by ``seed`` (an int64 scalar tensor): the eager kernel's masks for that seed.

    Shapes: ``x`` any -> ``(like x, contiguous; bool like x)``.
    """
    ops = _native(x)
    if ops is not None:
        return ops.dropout_forward(x, p, int(seed))
    generator = torch.Generator(device=x.device).manual_seed(int(seed) & (2 ** 63 - 1))
    keep = torch.rand(x.shape, generator=generator, device=x.device) >= p
    return (x * keep / (1.0 - p)).contiguous(), keep


@dropout.register_fake
def _(x, p, seed):
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=torch.bool)


@torch.library.custom_op("tncompile::traced_dropout_backward", mutates_args=())
def dropout_backward(grad: Tensor, keep: Tensor, scale: float) -> Tensor:
    """``grad * keep * scale``: dropout's input gradient."""
    ops = _native(grad)
    if ops is not None:
        return ops.dropout_backward(grad, keep, scale).contiguous()
    return (grad * keep * scale).contiguous()


@dropout_backward.register_fake
def _(grad, keep, scale):
    return grad.new_empty(grad.shape)


def _dropout_setup(ctx, inputs, output):
    ctx.scale = 1.0 / (1.0 - inputs[1])
    ctx.save_for_backward(output[1])


def _dropout_grad(ctx, grad, _keep_grad):
    (keep,) = ctx.saved_tensors
    return dropout_backward(grad.contiguous(), keep, ctx.scale), None, None


dropout.register_autograd(_dropout_grad, setup_context=_dropout_setup)


# ----------------------------------------------------------------- attention with dropout
def _attention_native(*tensors: Tensor):
    ops = _native(*tensors)
    if ops is None:
        raise RuntimeError("tncompile::traced_attention runs the native CPU kernel: float32/float64 CPU tensors "
                           f"of one dtype, got {[(t.dtype, t.device.type) for t in tensors]}")
    return ops


def _heads_last(b: int, h: int, length: int, width: int, like: Tensor) -> Tensor:
    """An empty ``(b, h, length, width)`` view of ``(b, length, h, width)`` memory: the kernel's layout."""
    return like.new_empty((b, length, h, width)).permute(0, 2, 1, 3)


@torch.library.custom_op("tncompile::traced_attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, p: float, seed: Tensor,
              keep_probs: bool, empty_rows_zero: bool) -> tuple[Tensor, Tensor]:
    """``dropout(softmax(scale q k^T + mask), p) @ v`` and, if ``keep_probs``, the softmax
    weights for backward (a dropped weight saved negated), with the dropout keyed by
    ``seed`` (an int64 scalar tensor); a query with no key gets NaN, or zeros with
    ``empty_rows_zero``.

    Shapes: ``q (B, H, L, E)``, ``k (B, H, S, E)``, ``v (B, H, S, F)``, ``mask`` in q's
    dtype broadcastable to ``(B, H, L, S)`` -> ``(out (B, H, L, F)`` over ``(B, L, H, F)``
    memory, ``weights (B, H, L, S)`` or ``(0,))``.
    """
    ops = _attention_native(q, k, v)
    out, probs = ops.attention_forward(q, k, v, mask, scale, p, int(seed), keep_probs, empty_rows_zero)
    return out, probs if keep_probs else empty_grad(q)


@attention.register_fake
def _(q, k, v, mask, scale, p, seed, keep_probs, empty_rows_zero):
    b, h, length, _ = q.shape
    probs = q.new_empty((b, h, length, k.shape[2])) if keep_probs else empty_grad(q)
    return _heads_last(b, h, length, v.shape[3], q), probs


@torch.library.custom_op("tncompile::traced_attention_backward", mutates_args=())
def attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, probs: Tensor, scale: float,
                       p: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``q, k, v`` from the forward's saved weights (each over ``(B, L, H, ·)`` memory)."""
    ops = _attention_native(grad, q, k, v, probs)
    dq, dk, dv = ops.attention_backward(grad, q, k, v, probs, scale, p)
    return dq, dk, dv


@attention_backward.register_fake
def _(grad, q, k, v, probs, scale, p):
    b, h, length, width = q.shape
    keys = k.shape[2]
    return _heads_last(b, h, length, width, q), _heads_last(b, h, keys, width, q), \
        _heads_last(b, h, keys, v.shape[3], q)


def _attention_setup(ctx, inputs, output):
    q, k, v, mask, scale, p, seed, keep_probs, _ = inputs
    ctx.scale, ctx.p, ctx.keep_probs = scale, p, keep_probs
    if keep_probs:
        ctx.save_for_backward(q, k, v, output[1])


def _attention_grad(ctx, grad, _probs_grad):
    if not ctx.keep_probs:
        raise RuntimeError("tncompile::traced_attention was called with keep_probs=False; its inputs' "
                           "gradients need the weights (call it with keep_probs=True)")
    q, k, v, probs = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad, q, k, v, probs, ctx.scale, ctx.p)
    return dq, dk, dv, None, None, None, None, None, None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)
