"""The frontend: a dense model to a torch.fx graph (fx first, ``torch.export`` as fallback).

- :mod:`.tracing`: ``trace`` (fx, or export with outlined linears, embeddings and experts),
  ``split_example_inputs``;
- :mod:`.nn_trace`: traceable spellings of ``nn.TransformerEncoder(Layer)`` and
  ``nn.MultiheadAttention``;
- :mod:`.dropout_modes`: dropout a trace baked in, made to follow ``train()`` / ``eval()``;
- :mod:`.layers`: which modules are layers a pass can compress.
"""
from .layers import is_compressible, kind_of
from .tracing import split_example_inputs, trace

__all__ = ["trace", "split_example_inputs", "is_compressible", "kind_of"]
