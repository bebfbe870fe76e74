"""Triton GPU kernels for TT networks, as ``torch.library`` custom ops (tested on the CPU
through Triton's interpreter, ``TRITON_INTERPRET=1``): :mod:`.thin_pair`."""
from .thin_pair import interpreting, runs_triton, thin_pair, triton_available

__all__ = ["thin_pair", "triton_available", "interpreting", "runs_triton"]
