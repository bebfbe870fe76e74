"""The ``tncompile::`` ops that run on the device (Triton kernels, fake kernels for tracers),
not on the CPU: a dry run's check for CPU kernels on the device path leaves them out."""

DEVICE_OPS = frozenset({"thin_pair", "thin_pair_kept", "merge_factors_", "merge_factors_backward_", "ttm_gather",
                        "ttm_scatter_"})
