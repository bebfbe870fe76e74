"""Trace into ``nn.TransformerEncoder`` / ``nn.TransformerEncoderLayer`` /
``nn.MultiheadAttention`` with torch.fx.

torch.fx keeps every ``torch.nn`` module a leaf, so a model built from
``nn.TransformerEncoder`` showed none of its linears, and tracing into it fails
(its inference fast path branches on tensors). Here the tracer runs a
fx-traceable spelling of their training-mode math instead:

* an encoder is its layers in turn, then its ``norm``;
* an encoder layer is ``norm_first`` or post-norm residual blocks over
  ``self_attn``, ``linear1 -> activation -> dropout -> linear2``, exactly as its
  slow path computes;
* a self-attention call (``query is key is value``) is ``in_proj`` (an
  ``nn.Linear`` on the module's own ``in_proj_weight`` / ``in_proj_bias``),
  :class:`~tncompile.runtime.fused.attention.SelfAttention` and ``out_proj``.

``in_proj`` and ``attend`` are attached to each ``nn.MultiheadAttention`` (and
``nested_padding`` to an encoder whose inference fast path returns zeros at
padded positions) only while tracing (:func:`attention_parts`), so the user's
model keeps its state dict.
Other calls (cross-attention, separate q/k/v weights, subclasses with a forward
of their own) stay one opaque module call, as before.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch import nn

from ..runtime.fused.attention import NestedPadding, SelfAttention
from ..runtime.layers.module_kinds import linear_on, runs_as

__all__ = ["attention_parts", "traced_call"]


def _packed(mha: nn.Module) -> bool:
    """An ``nn.MultiheadAttention`` whose projections can be spelled as modules."""
    return (runs_as(mha, nn.MultiheadAttention) and mha._qkv_same_embed_dim and mha.in_proj_weight is not None
            and mha.bias_k is None and not mha.add_zero_attn)


@contextlib.contextmanager
def attention_parts(model: nn.Module) -> Iterator[None]:
    """Attach ``in_proj`` and ``attend`` to every packed ``nn.MultiheadAttention``
    of ``model`` for the duration of a trace."""
    added: list[tuple[nn.Module, str]] = []
    for mod in model.modules():
        if isinstance(mod, nn.MultiheadAttention) and _packed(mod) and "in_proj" not in mod._modules:
            mod.add_module("in_proj", linear_on(mod.in_proj_weight, mod.in_proj_bias, mod.training))
            mod.add_module("attend", SelfAttention(mod.num_heads, mod.dropout, mod.batch_first).train(mod.training))
            added += [(mod, "in_proj"), (mod, "attend")]
        elif isinstance(mod, nn.TransformerEncoder) and getattr(mod, "use_nested_tensor", False) \
                and "nested_padding" not in mod._modules:
            mod.add_module("nested_padding", NestedPadding(getattr(mod, "mask_check", True)).train(mod.training))
            added.append((mod, "nested_padding"))
    try:
        yield
    finally:
        for mod, name in added:
            del mod._modules[name]


def _self_attention(mha: nn.Module, query, key, value, key_padding_mask=None, need_weights: bool = True,
                    attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False):
    """``nn.MultiheadAttention.forward`` for ``query is key is value`` (``is_causal`` is
    only a hint there: the mask given is what applies)."""
    qkv = mha.in_proj(query)
    out, weights = mha.attend(qkv, attn_mask, key_padding_mask, need_weights, average_attn_weights)
    return mha.out_proj(out), weights


def _encoder_layer(layer: nn.Module, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
    """``nn.TransformerEncoderLayer.forward`` (its slow path)."""
    def attention(x):
        return layer.dropout1(layer.self_attn(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                                              need_weights=False, is_causal=is_causal)[0])

    def feed_forward(x):
        return layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(x)))))

    x = src
    if layer.norm_first:
        x = x + attention(layer.norm1(x))
        return x + feed_forward(layer.norm2(x))
    x = layer.norm1(x + attention(x))
    return layer.norm2(x + feed_forward(x))


def _encoder(encoder: nn.Module, src, mask=None, src_key_padding_mask=None, is_causal: bool | None = None):
    """``nn.TransformerEncoder.forward`` without the nested-tensor fast path."""
    out = src
    for layer in encoder.layers:
        out = layer(out, src_mask=mask, is_causal=bool(is_causal), src_key_padding_mask=src_key_padding_mask)
    if mask is None and src_key_padding_mask is not None and "nested_padding" in encoder._modules:
        out = encoder.nested_padding(out, src, src_key_padding_mask)  # the fast path's zeros, in inference
    return encoder.norm(out) if encoder.norm is not None else out


def traced_call(module: nn.Module, args: tuple, kwargs: dict) -> Callable[[], Any] | None:
    """What the tracer should run for a call of ``module`` instead of keeping it a
    leaf, or ``None`` (keep the usual behaviour)."""
    if isinstance(module, nn.TransformerEncoder) and runs_as(module, nn.TransformerEncoder):
        return lambda: _encoder(module, *args, **kwargs)
    if isinstance(module, nn.TransformerEncoderLayer) and runs_as(module, nn.TransformerEncoderLayer) \
            and isinstance(getattr(module.self_attn, "_modules", {}).get("in_proj"), nn.Linear):
        return lambda: _encoder_layer(module, *args, **kwargs)
    if isinstance(module, nn.MultiheadAttention) and "in_proj" in module._modules:
        query, key, value = (list(args) + [kwargs.get(k) for k in ("query", "key", "value")[len(args):]])[:3]
        if query is key is value:
            rest = {k: v for k, v in kwargs.items() if k not in ("query", "key", "value")}
            return lambda: _self_attention(module, query, key, value, *args[3:], **rest)
    return None
