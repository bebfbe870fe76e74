"""The thin pair ``y = (x @ A) @ B + bias`` in one Triton launch, its ``r``-wide middle on chip.

A TT linear's network, its input cores merged into ``A (in, r)`` and its output cores
(and gates) into ``B (r, out)`` (:meth:`~tncompile.runtime.TTLinear.merged_factors`), is
two thin GEMMs. Run as two cuBLAS calls they write the ``rows x r`` intermediate to memory
and read it back, two launches per layer and direction. Here each program takes
``BLOCK_M`` rows: it accumulates ``h = x A`` over the input in registers, then multiplies
``h`` by ``B`` one ``BLOCK_N`` column block at a time, adding the bias on the way out. With
few rows (a batch of one sequence: 4 row blocks) the output's columns are split among
programs as well, each forming its rows' ``h`` again (cheap: ``r`` is small), so a launch
has about :data:`PROGRAMS` programs to spread over the device.

:func:`thin_pair` is a ``torch.library`` custom op (``tncompile::thin_pair``) with a fake
kernel (so ``torch.compile``, export and capture see one opaque call) and an autograd
formula whose input gradient is the same kernel on ``(B^T, A^T)`` (``dx = (dy B^T) A^T``)
and whose weight gradients are two GEMMs. For training, :func:`thin_pair_train` keeps the
middle from the forward launch (``tncompile::thin_pair_kept`` writes ``[x A, 1]`` beside
``y``), so its backward is three launches -- ``dx`` by the same kernel keeping ``u = dy B^T``,
``dA = x^T u``, and ``[dB; dbias] = [x A, 1]^T dy`` -- where a dense linear runs ``dx``,
``dW`` and the bias sum: a TT linear's step launches what a dense one does. Where it runs:

* CUDA tensors: the compiled Triton kernel;
* CPU tensors with ``TRITON_INTERPRET=1`` (set before Triton is imported: it decides
  how Triton's own language functions load): the same kernel through Triton's
  interpreter (how CI tests it without a GPU);
* otherwise, or without Triton: the same arithmetic in PyTorch ops.

Accumulation is in float32 (float64 for float64 inputs); float32 products are IEEE (no
TF32, as PyTorch's default matmul); 16-bit inputs multiply ``h`` rounded to their dtype,
as a 16-bit matmul would. (Triton's interpreter multiplies bfloat16 operands wrongly -- NumPy
has no bfloat16 -- so on the CPU their products are formed in float32 from the same
bfloat16 values: exact, as the tensor cores' are, accumulated in float32 as theirs are.)
``TTLinear`` runs :func:`thin_pair_train` at any row count under ``tuning.TRITON_KERNELS``
(off until ``benchmarks/bench_gpu.py`` measures it on a GPU).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from .device_ops import direct

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch do not ship Triton: the PyTorch path runs
    triton = tl = None

__all__ = ["thin_pair", "thin_pair_train", "thin_pair_kept", "thin_pair_activation_grad", "ACTIVATIONS",
           "triton_available", "interpreting", "runs_triton"]

BLOCK_M, BLOCK_K, BLOCK_N = 32, 32, 32
#: programs a launch aims for (about two per SM of an H100): below it, columns are split too
PROGRAMS = 256


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: CPU tensors run the kernels through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_triton(x: Tensor) -> bool:
    """Whether the Triton kernels run on tensors like ``x``: CUDA tensors, CPU tensors under
    the interpreter, and ``meta`` ones (a dry run's fake device, which takes CUDA's path:
    the ops' fake kernels run there)."""
    return triton_available() and x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) \
        and (x.is_cuda or x.is_meta or (x.device.type == "cpu" and interpreting()))


def _thin_pair_kernel(x_ptr, a_ptr, b_ptr, bias_ptr, y_ptr, t_ptr, M, K, N, R, COLS,
                      sxm, sxk, sak, sar, sbr, sbn, sym, syn, stm, str_,
                      f_ptr, fb_ptr, fbias_ptr, d_ptr, G, sfm, sfg, sgb, sgk, sdm, sdk,
                      HAS_BIAS: tl.constexpr, KEEP: tl.constexpr, ONES: tl.constexpr,
                      ACT: tl.constexpr, DACT: tl.constexpr, F_BIAS: tl.constexpr,
                      ACC: tl.constexpr, LOW: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    if DACT != 0:   # x is dy of ``act(f fb + fbias)``: the forward's middle f, read once
        gg = tl.arange(0, BLOCK_G)
        f = tl.load(f_ptr + rows[:, None] * sfm + gg[None, :] * sfg,
                    mask=(rows[:, None] < M) & (gg[None, :] < G), other=0.0)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * sxm + ks[None, :] * sxk,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        if DACT != 0:   # dy * act'(pre), pre formed again from the middle (as the forward formed it)
            fb = tl.load(fb_ptr + gg[:, None] * sgb + ks[None, :] * sgk,
                         mask=(gg[:, None] < G) & (ks[None, :] < K), other=0.0)
            if UPCAST:
                pre = tl.dot(f.to(ACC), fb.to(ACC), input_precision="ieee", out_dtype=ACC)
            elif LOW:
                pre = tl.dot(f, fb, out_dtype=ACC)
            else:
                pre = tl.dot(f.to(ACC), fb.to(ACC), input_precision="ieee", out_dtype=ACC)
            if F_BIAS:
                pre += tl.load(fbias_ptr + ks, mask=ks < K, other=0.0).to(ACC)[None, :]
            if DACT == 1:       # gelu: Phi(z) + z phi(z)
                slope = 0.5 * (1.0 + tl.erf(pre * 0.7071067811865476)) \
                    + pre * tl.exp(-0.5 * pre * pre) * 0.3989422804014327
            elif DACT == 2:     # gelu, tanh approximation
                z = 1.5957691216057308 * (pre + 0.044715 * pre * pre * pre)
                th = 2.0 * tl.sigmoid(tl.minimum(tl.maximum(z, -80.0), 80.0)) - 1.0   # no exp overflow
                slope = 0.5 * (1.0 + th) + 0.5 * pre * (1.0 - th * th) * 0.7978845608028654 \
                    * (1.0 + 0.134145 * pre * pre)
            else:               # relu
                slope = (pre > 0.0).to(ACC)
            dpre = x.to(ACC) * slope
            stored = K * (tl.program_id(1) == 0).to(tl.int32)     # the first column program writes dy'
            tl.store(d_ptr + rows[:, None] * sdm + ks[None, :] * sdk, dpre.to(d_ptr.dtype.element_ty),
                     mask=(rows[:, None] < M) & (ks[None, :] < stored))
            x = dpre.to(x.dtype)
        a = tl.load(a_ptr + ks[:, None] * sak + rr[None, :] * sar,
                    mask=(ks[:, None] < K) & (rr[None, :] < R), other=0.0)
        if UPCAST:
            h += tl.dot(x.to(ACC), a.to(ACC), input_precision="ieee", out_dtype=ACC)
        elif LOW:
            h += tl.dot(x, a, out_dtype=ACC)
        else:
            h += tl.dot(x.to(ACC), a.to(ACC), input_precision="ieee", out_dtype=ACC)
    first = tl.program_id(1) * COLS      # this program's columns of y: [first, first + COLS)
    if KEEP:  # the middle, for the weight gradients: (rows, R), or (rows, R + 1) ending in ones
        kept = tl.where(rr[None, :] == R, 1.0, h) if ONES else h
        width = (R + 1 if ONES else R) * (tl.program_id(1) == 0).to(tl.int32)   # the first column program's
        tl.store(t_ptr + rows[:, None] * stm + rr[None, :] * str_, kept.to(t_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (rr[None, :] < width))
    for n0 in range(first, tl.minimum(first + COLS, N), BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        b = tl.load(b_ptr + rr[:, None] * sbr + ns[None, :] * sbn,
                    mask=(rr[:, None] < R) & (ns[None, :] < N), other=0.0)
        if UPCAST:
            y = tl.dot(h.to(b.dtype).to(ACC), b.to(ACC), input_precision="ieee", out_dtype=ACC)
        elif LOW:
            y = tl.dot(h.to(b.dtype), b, out_dtype=ACC)
        else:
            y = tl.dot(h, b.to(ACC), input_precision="ieee", out_dtype=ACC)
        if HAS_BIAS:
            y += tl.load(bias_ptr + ns, mask=ns < N, other=0.0).to(ACC)[None, :]
        if ACT == 1:        # gelu
            y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
        elif ACT == 2:      # gelu, tanh approximation
            z = 1.5957691216057308 * (y + 0.044715 * y * y * y)
            y = y * tl.sigmoid(tl.minimum(tl.maximum(z, -80.0), 80.0))                # no exp overflow
        elif ACT == 3:      # relu
            y = tl.maximum(y, 0.0)
        tl.store(y_ptr + rows[:, None] * sym + ns[None, :] * syn, y.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (ns[None, :] < N))


@functools.cache
def _kernel(device_type: str):
    """The kernel compiled for CUDA, or wrapped for Triton's interpreter on the CPU."""
    if device_type == "cuda":
        return triton.jit(_thin_pair_kernel)
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(_thin_pair_kernel)


#: the activations an epilogue applies, by name (``tt_feed_forward``'s), and their kernel codes
ACTIVATIONS = {"gelu": 1, "gelu_tanh": 2, "relu": 3}


def activation_code(activation: Optional[str]) -> int:
    """The kernel's code for ``activation`` (0 for none); a clear error for an unknown name."""
    if activation is None:
        return 0
    if activation not in ACTIVATIONS:
        raise ValueError(f"thin_pair_train: unknown activation {activation!r}; use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[activation]


def activate(pre: Tensor, code: int) -> Tensor:
    """The epilogue's activation (``code`` of :data:`ACTIVATIONS`, 0: none) in PyTorch ops."""
    if code == 0:
        return pre
    if code == 3:
        return torch.relu(pre)
    return torch.nn.functional.gelu(pre, approximate="tanh" if code == 2 else "none")


def _slope(pre: Tensor, code: int) -> Tensor:
    """``act'(pre)`` for ``code``'s activation, in PyTorch ops (the kernel's formulas)."""
    if code == 3:
        return (pre > 0).to(pre.dtype)
    if code == 1:
        return 0.5 * (1 + torch.erf(pre * 0.7071067811865476)) + pre * torch.exp(-0.5 * pre * pre) * 0.3989422804014327
    th = torch.tanh(0.7978845608028654 * (pre + 0.044715 * pre ** 3))
    return 0.5 * (1 + th) + 0.5 * pre * (1 - th * th) * 0.7978845608028654 * (1 + 0.134145 * pre * pre)


def _input_grad(dy: Tensor, f: Tensor, fb: Tensor, fbias: Optional[Tensor], code: int) -> Tensor:
    """``dy * act'(f fb + fbias)`` in PyTorch ops: the gradient at an activation's input, its
    input formed again from the middle ``f`` (what the kernel does tile by tile)."""
    pre = f @ fb if fbias is None else torch.addmm(fbias, f, fb)
    return dy * _slope(pre, code)


def _launch(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor], keep: bool, ones: bool, act: int = 0,
            dact: Optional[tuple[Tensor, Tensor, Optional[Tensor], int]] = None
            ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(y, t, d)`` for 2-D ``x``: ``y = act((x' a) b + bias)``, ``t`` the middle ``x' a``
    when ``keep`` (ending in a column of ones when ``ones``), else ``None``. ``x' = x`` unless
    ``dact = (f, fb, fbias, code)``: then ``x`` is the gradient at an activation's output,
    ``x' = x * act'(f fb + fbias)`` is that at its input, formed tile by tile from the
    forward's middle ``f (rows, G)`` and factor ``fb (G, K)``, and returned as ``d``."""
    m, k = x.shape
    r, n = b.shape
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    t = torch.empty(m, r + ones, device=x.device, dtype=x.dtype) if keep else None
    d = torch.empty(m, k, device=x.device, dtype=x.dtype) if dact is not None else None
    if m == 0:
        return y, t, d
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    kept = t if t is not None else y
    f, fb, fbias, code = dact if dact is not None else (y, y, None, 0)
    dout = d if d is not None else y
    row_blocks, col_blocks = triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)
    # few rows: y's columns split among programs too (each forms its rows' x A again) so the
    # device has PROGRAMS programs to run; many rows: one program per row block
    split = max(1, min(col_blocks, triton.cdiv(PROGRAMS, row_blocks)))
    cols = triton.cdiv(col_blocks, split) * BLOCK_N
    g = fb.shape[0] if dact is not None else 1
    _kernel(x.device.type)[(row_blocks, triton.cdiv(n, cols))](
        x, a, b, bias if bias is not None else y, y, kept, m, k, n, r, cols,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
        kept.stride(0), kept.stride(1),
        f, fb, fbias if fbias is not None else y, dout, g, f.stride(0), f.stride(1), fb.stride(0), fb.stride(1),
        dout.stride(0), dout.stride(1),
        HAS_BIAS=bias is not None, KEEP=keep, ONES=ones, ACT=act, DACT=code, F_BIAS=fbias is not None,
        ACC=acc, LOW=x.dtype in (torch.float16, torch.bfloat16),
        UPCAST=x.dtype == torch.bfloat16 and x.device.type == "cpu",
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(r + ones)),
        BLOCK_G=max(16, triton.next_power_of_2(g)))
    return y, t, d


def _pair(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor], keep: bool, ones: bool, act: int = 0,
          dact: Optional[tuple[Tensor, Tensor, Optional[Tensor], int]] = None
          ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """:func:`_launch` where Triton runs, else the same arithmetic in PyTorch ops."""
    a, b = a.to(x.dtype), b.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if dact is not None:
        f, fb, fbias, code = dact
        fb, fbias = fb.to(x.dtype), None if fbias is None else fbias.to(x.dtype)
        dact = (f, fb, fbias, code)
    if runs_triton(x):
        return _launch(x, a, b, bias, keep, ones, act, dact)
    d = None
    if dact is not None:
        x = d = _input_grad(x, *dact)
    t = x @ a
    y = activate(t @ b if bias is None else torch.addmm(bias, t, b), act)
    if keep and ones:
        t = torch.cat([t, t.new_ones(t.shape[0], 1)], 1)
    return y, (t if keep else None), d


@torch.library.custom_op("tncompile::thin_pair", mutates_args=())
def thin_pair(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``(x @ a) @ b + bias``: one launch (no gradient kept; :func:`thin_pair_train` for training).

    Parameters
    ----------
    x : Tensor, shape ``(..., in)``
    a : Tensor, shape ``(in, r)``
    b : Tensor, shape ``(r, out)``
    bias : Tensor of shape ``(out,)``, or None

    Returns
    -------
    Tensor, shape ``(..., out)``, ``x``'s dtype.
    """
    y, _, _ = _pair(x.reshape(-1, x.shape[-1]), a, b, bias, keep=False, ones=False)
    return y.reshape(*x.shape[:-1], b.shape[1])


@thin_pair.register_fake
def _(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> Tensor:
    return x.new_empty(*x.shape[:-1], b.shape[1])


def _kept(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor], activation: int = 0) -> tuple[Tensor, Tensor]:
    """``(y, t1)``: ``y = act((x a) b + bias)`` as :func:`thin_pair` (``activation``: a code of
    :data:`ACTIVATIONS`, 0 for none), and the middle ``x a`` kept for the weight gradients,
    as ``t1 (rows, r + 1)`` whose last column is ones when there is a bias (``t1^T dy`` is
    then ``dB`` and the bias gradient in one GEMM), else ``(rows, r)``; in the same launch.
    ``x``: ``(rows, in)``."""
    y, t, _ = _pair(x, a, b, bias, keep=True, ones=bias is not None, act=activation)
    return y, t


thin_pair_kept = torch.library.custom_op("tncompile::thin_pair_kept", _kept, mutates_args=())


@thin_pair_kept.register_fake
def _(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor], activation: int = 0) -> tuple[Tensor, Tensor]:
    # an int, not a bool, beside a SymInt: torch 2.11 turns ``SymInt + bool`` into a sympy
    # boolean under dynamic shapes ('BooleanTrue' object has no attribute 'as_coeff_Mul': the
    # three opcheck failures of the H100 run)
    ones = 1 if bias is not None else 0
    return x.new_empty(x.shape[0], b.shape[1]), x.new_empty(x.shape[0], a.shape[1] + ones)


def _activation_grad(dy: Tensor, bt: Tensor, at: Tensor, kept: Tensor, b: Tensor, bias: Optional[Tensor],
                     activation: int) -> tuple[Tensor, Tensor, Tensor]:
    """The backward launch of ``y = act(x A B + bias)``: ``(dx, u, dpre)`` with
    ``dpre = dy * act'(pre)`` (``pre = (x A) B + bias`` formed again from the kept middle
    ``kept[:, :r]``, never stored by the forward), ``u = dpre B^T`` and ``dx = u A^T``.
    ``dy (rows, out)``, ``bt = B^T (out, r)``, ``at = A^T (r, in)``, ``kept (rows, r[+1])``,
    ``b (r, out)``; ``activation`` a code of :data:`ACTIVATIONS`."""
    r = b.shape[0]
    dx, u, dpre = _pair(dy, bt, at, None, keep=True, ones=False, dact=(kept[:, :r], b, bias, activation))
    return dx, u, dpre


thin_pair_activation_grad = torch.library.custom_op("tncompile::thin_pair_activation_grad", _activation_grad,
                                                    mutates_args=())


@thin_pair_activation_grad.register_fake
def _(dy: Tensor, bt: Tensor, at: Tensor, kept: Tensor, b: Tensor, bias: Optional[Tensor],
      activation: int) -> tuple[Tensor, Tensor, Tensor]:
    return dy.new_empty(dy.shape[0], at.shape[1]), dy.new_empty(dy.shape[0], bt.shape[1]), torch.empty_like(dy)


def _kept_call(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor], activation: int = 0
               ) -> tuple[Tensor, Tensor]:
    """:func:`thin_pair_kept`, its implementation called directly in an eager step (:func:`.direct`)."""
    return _kept(x, a, b, bias, activation) if direct(x) else thin_pair_kept(x, a, b, bias, activation)


def _activation_grad_call(dy: Tensor, bt: Tensor, at: Tensor, kept: Tensor, b: Tensor, bias: Optional[Tensor],
                          activation: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`thin_pair_activation_grad`, called directly in an eager step (:func:`.direct`)."""
    op = _activation_grad if direct(dy) else thin_pair_activation_grad
    return op(dy, bt, at, kept, b, bias, activation)


class _ThinPairTrain(torch.autograd.Function):
    """:func:`thin_pair_kept`'s ``y`` with the gradients of ``act(x A B + bias)``: three launches
    backward -- ``dx`` with ``u = dy' B^T`` kept (the same kernel on ``(B^T, A^T)``, which with
    an activation first forms ``dy' = dy * act'(pre)`` from the kept middle and writes it),
    ``dA = x^T u`` and ``[dB; dbias] = t1^T dy'`` -- where a dense linear runs ``dx``, ``dW``
    and the bias sum, and its activation one more each way."""

    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor], activation: int) -> Tensor:
        y, t1 = _kept_call(x, a, b, bias, activation)
        ctx.save_for_backward(x, a, b, t1, bias if activation else None)
        ctx.has_bias, ctx.activation = bias is not None, activation
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, a, b, t1, bias = ctx.saved_tensors
        need_x, need_a, need_b, need_bias, _ = ctx.needs_input_grad
        code = ctx.activation
        dx = da = db = dbias = None
        if code and need_x:
            dx, u, dy = _activation_grad_call(dy, b.t(), a.t(), t1, b, bias, code)
        else:
            if code:   # no dx: dy' in PyTorch ops
                dy = _input_grad(dy, t1[:, :b.shape[0]], b.to(dy.dtype), None if bias is None else bias.to(dy.dtype),
                                 code)
            if need_x:
                dx, u = _kept_call(dy, b.t(), a.t(), None)
            elif need_a:
                u = dy @ b.t().to(dy.dtype)
        da = (x.t() @ u).to(a.dtype) if need_a else None
        if need_b or need_bias:
            grads = t1.t() @ dy
            r = b.shape[0]
            db = grads[:r].to(b.dtype) if need_b else None
            dbias = grads[r].to(dy.dtype) if need_bias and ctx.has_bias else None
        return dx, da, db, dbias, None


def _setup_context(ctx, inputs, output) -> None:
    x, a, b, bias = inputs
    ctx.save_for_backward(x, a, b)
    ctx.has_bias = bias is not None


def _backward(ctx, dy: Tensor):
    x, a, b = ctx.saved_tensors
    flat_x, flat_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dx, u = thin_pair_kept(flat_dy, b.t(), a.t(), None, 0)      # (dy B^T) A^T, the middle kept
    da = flat_x.t() @ u                                         # (in, r)
    grads = (flat_x @ a.to(x.dtype)).t() @ flat_dy              # (r, out): the middle recomputed
    dbias = flat_dy.sum(0) if ctx.has_bias else None
    return dx.reshape(x.shape), da.to(a.dtype), grads.to(b.dtype), dbias


thin_pair.register_autograd(_backward, setup_context=_setup_context)


def thin_pair_train(x: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor] = None,
                    activation: Optional[str] = None) -> Tensor:
    """``act((x @ a) @ b + bias)`` for training: one launch forward (keeping the ``r``-wide
    middle, not the activation's input), three backward (``dx`` by the same kernel, which
    first applies the activation's derivative; ``dA`` and ``[dB; dbias]`` as one GEMM each):
    a dense linear's count, its activation's two kernels folded in. Shapes as
    :func:`thin_pair`; ``activation``: None or a key of :data:`ACTIVATIONS`."""
    code = activation_code(activation)
    y = _ThinPairTrain.apply(x.reshape(-1, x.shape[-1]), a, b, bias, code)
    return y.reshape(*x.shape[:-1], b.shape[1])
