"""Native CPU kernels: C++ built on first use (:mod:`.loader`), and the same kernels as
``torch.library`` custom ops for tracers (:mod:`.traced`, registered on import)."""
from . import traced
from .loader import build_name, clear_stale_lock, kernels_for, native_kernels, native_ops, native_status, watch
from .traced import constant_while_traced, never_traced, traced_kernels

__all__ = ["native_ops", "native_status", "native_kernels", "kernels_for", "traced_kernels", "constant_while_traced", "never_traced", "watch",
           "build_name", "clear_stale_lock", "traced"]
