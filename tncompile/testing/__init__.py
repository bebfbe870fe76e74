"""Reference models for the demo, tests, benchmarks and ``tncompile inspect``: the paper's
six-encoder, a small encoder and an MLP (:mod:`.models`), and how busy the host was while
something was timed (:mod:`.host_load`). Not part of the compiler."""
from .host_load import HostLoad
from .models import SixEncoder, mlp, six_encoder, small_encoder

__all__ = ["HostLoad", "SixEncoder", "six_encoder", "small_encoder", "mlp"]
