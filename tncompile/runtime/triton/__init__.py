"""Triton GPU kernels for TT networks, as ``torch.library`` custom ops (tested on the CPU
through Triton's interpreter, ``TRITON_INTERPRET=1``): :mod:`.thin_pair`."""
from .device_ops import DEVICE_OPS
from .thin_pair import (ACTIVATIONS, interpreting, runs_triton, thin_pair, thin_pair_activation_grad, thin_pair_kept,
                        thin_pair_train, triton_available)

__all__ = ["thin_pair", "thin_pair_train", "thin_pair_kept", "thin_pair_activation_grad", "ACTIVATIONS",
           "triton_available", "interpreting", "runs_triton", "DEVICE_OPS"]
