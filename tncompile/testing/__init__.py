"""Reference models for the demo, tests, benchmarks and ``tncompile inspect``: the paper's
six-encoder, a small encoder and an MLP (:mod:`.models`). Not part of the compiler."""
from .models import SixEncoder, mlp, six_encoder, small_encoder

__all__ = ["SixEncoder", "six_encoder", "small_encoder", "mlp"]
