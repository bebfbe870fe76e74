"""Integrations with other libraries, imported on demand (each needs its library):

- :mod:`tncompile.integrations.hf`: ``transformers.Trainer`` -- rank control as a
  callback, resuming from a compressed model's checkpoints.
"""
