"""Swap mode: the user's own model, its compressible layers replaced in place.

- :mod:`.swapped`: ``swap_into`` (the layers in, the result API on the model's class:
  :class:`SwapMixin`), ``is_swapped``, ``user_class``;
- :mod:`.subclass`: layer subclasses keep their forward, the network running under it;
- :mod:`.experts`: fused MoE expert parameters, swapped through their owner;
- :mod:`.lowering`: graph mode's lowerings (dropout, attention, tanh GELU) made in the tree;
- :mod:`.hf_attention`: HF's ``"tncompile_sdpa"`` attention (imports transformers: loaded
  only when an HF model is swapped).
"""
from .swapped import SwapMixin, is_swapped, swap_into, user_class

__all__ = ["SwapMixin", "is_swapped", "swap_into", "user_class"]
