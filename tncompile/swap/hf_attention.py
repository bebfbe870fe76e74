"""HuggingFace attention on tncompile's native CPU attention kernel.

A ``transformers`` model calls its attention through ``ALL_ATTENTION_FUNCTIONS``,
keyed by ``config._attn_implementation``. Under ``"sdpa"`` with dropout on CPU
that is PyTorch's unfused math path: head-transposed copies of ``q``/``k``/``v``,
the scores, the weights, a Bernoulli mask and the dropped weights written out
(in a swap-mode all-MiniLM-L6-v2 step at 32x128 the Bernoulli draws alone
took about a sixth of the step). :data:`NAME` (``"tncompile_sdpa"``) is
``"sdpa"`` with one difference: a training call with dropout on CPU runs
:func:`~tncompile.runtime.ways.attention.native_attention` (one head's
scores in cache, the dropout drawn by the native counter-based generator).
Every other call -- eval, no dropout, CUDA, a mask that needs a gradient,
``output_attentions``, softcapping -- is ``transformers``' own
``sdpa_attention_forward``, unchanged. A query the mask leaves no key gets zeros,
as from ``sdpa``; under ``torch.compile`` the kernel runs as a traceable op.
Its masks are the ``"sdpa"`` ones (``sdpa_mask``).

Swap mode switches a model's configs from ``"sdpa"`` to :data:`NAME` when the
``lower_dropout`` pass is in the pipeline (:mod:`tncompile.swap.lowering`).
"""
from __future__ import annotations

from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..runtime.ways.attention import native_sdpa

__all__ = ["NAME", "register", "attention_forward", "native_call"]

NAME = "tncompile_sdpa"


def register() -> None:
    """Make :data:`NAME` a valid ``attn_implementation`` (attention and mask), once per process."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, attention_forward)
    if NAME not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(NAME, sdpa_mask)


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[Tensor, None]:
    """``transformers``' attention-function signature (as ``sdpa_attention_forward``).

    Shapes
    ------
    ``query (B, H, L, E)``, ``key (B, Hkv, S, E)``, ``value (B, Hkv, S, F)``,
    ``attention_mask`` (bool, ``True`` = attend, or additive) broadcastable to
    ``(B, H, L, S)`` or ``None`` -> ``((B, L, H, F), None)``.
    """
    out = native_call(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if out is not None:
        return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def native_call(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                dropout: float, scaling: float | None, is_causal: bool | None, kwargs: dict) -> Tensor | None:
    """The native kernel's ``(B, L, H, F)`` output for a training call with dropout on
    CPU that it computes exactly as ``sdpa_attention_forward`` would, else ``None``."""
    if not dropout or query.device.type != "cpu" or query.dim() != 4:
        return None
    if kwargs.get("softcap") is not None or kwargs.get("output_attentions") or kwargs.get("position_bias") is not None:
        return None
    length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and length > 1 and attention_mask is None
    if causal and key.shape[2] > length:  # as sdpa_attention_forward: a prefill into an empty static cache
        key, value = key[:, :, :length], value[:, :, :length]
    out = native_sdpa(query, key, value, attention_mask, dropout, causal, scaling, enable_gqa=True)
    return None if out is None else out.transpose(1, 2)  # (B, L, H, F): the kernel's own memory layout
