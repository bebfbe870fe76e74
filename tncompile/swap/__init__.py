"""Swap mode: the user's own model, its compressible layers replaced in place.

- :mod:`.swapped`: ``attach`` (the layers in, the result API on the model's class:
  :class:`SwapMixin`), ``is_swapped``, ``user_class``;
- :mod:`.kinds`: each kind of swapped layer (experts, layer subclass, layer, tied head) puts
  and restores itself; ``to_dense`` is one loop over them;
- :mod:`.subclass`: layer subclasses keep their forward, the network running under it;
- :mod:`.expert_params`: fused MoE expert parameters, swapped through their owner;
- :mod:`.lowering`: graph mode's lowerings (dropout, attention, tanh GELU) made in the tree;
- :mod:`.hf_attention`: HF's ``"tncompile_sdpa"`` attention (imports transformers: loaded
  only when an HF model is swapped).
"""
from .kinds import KINDS, SwapKind
from .swapped import SwapMixin, attach, is_swapped, user_class

__all__ = ["SwapMixin", "attach", "is_swapped", "user_class", "KINDS", "SwapKind"]
