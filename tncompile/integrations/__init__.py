"""Integrations with other libraries and whole workflows, imported on demand:

- :mod:`tncompile.integrations.pretrained`: ``compress_pretrained`` -- calibrate, compile
  and distill a pretrained model (published as ``tncompile.compress_pretrained``);
- :mod:`tncompile.integrations.hf`: ``transformers.Trainer`` -- rank control as a
  callback, resuming from a compressed model's checkpoints (needs transformers).
"""
