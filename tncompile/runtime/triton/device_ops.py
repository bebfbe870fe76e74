"""The ``tncompile::`` ops that run on the device (Triton kernels, fake kernels for tracers),
and when an eager call may skip the dispatcher to reach one.

A dry run's check for CPU kernels on the device path leaves :data:`DEVICE_OPS` out. In an
eager step on plain tensors the layers call an op's implementation directly
(:func:`direct`): a ``torch.library`` custom op's dispatch costs ~15 us of host time per
call, as much as the launch it leads to. Tracers, fake tensors, dispatch modes and
functorch's wrapped tensors go through the op (its fake kernel, its registration).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["DEVICE_OPS", "direct"]

DEVICE_OPS = frozenset({"thin_pair", "thin_pair_kept", "thin_pair_activation_grad", "merge_factors_", "merge_factors_backward_", "ttm_gather",
                        "ttm_scatter_"})


def direct(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` may run an op's implementation without the dispatcher: a
    plain tensor holding data, no tracer, no dispatch mode, no functorch transform."""
    return (type(t) is torch.Tensor and not t.is_meta and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None and not torch._C._functorch.is_functorch_wrapped_tensor(t))
