"""Triton GPU kernels for TT networks, as ``torch.library`` custom ops (tested on the CPU
through Triton's interpreter, ``TRITON_INTERPRET=1``): :mod:`.thin_pair`. Importing it
registers the ``"triton"`` backend with the ops' ways (:mod:`.backend`); the runtime does
not import it (:mod:`..optional_backends` loads it on first use)."""
from .device_ops import DEVICE_OPS
from .thin_pair import (ACTIVATIONS, interpreting, runs_triton, thin_pair, thin_pair_activation_grad, thin_pair_kept,
                        thin_pair_train, triton_available)
from .backend import TRITON, register_triton

__all__ = ["thin_pair", "thin_pair_train", "thin_pair_kept", "thin_pair_activation_grad", "ACTIVATIONS",
           "triton_available", "interpreting", "runs_triton", "DEVICE_OPS", "TRITON",
           "register_triton"]
