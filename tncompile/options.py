"""Settings of one compilation, read by the passes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .passes.infra.selection import check_entry
from .errors import check_int, is_int, is_real

__all__ = ["CompileOptions", "check_target_ratio", "check_batch_sizes", "PREFER", "MAX_ROWS", "MAX_BATCH_SIZES",
           "MAX_CORES"]

#: ``compile(prefer=...)``: what wins when a network at the budget's rank would cost
#: more to run than its dense layer.
PREFER = ("speed", "size")


def check_target_ratio(target_ratio: Any, argument: str = "target_ratio") -> float:
    """Validate a size ratio in ``(0, 1]`` and return it as a float."""
    if not is_real(target_ratio):
        raise TypeError(f"{argument} must be a number in (0, 1], got {type(target_ratio).__name__} "
                        f"{target_ratio!r}; e.g. {argument}=0.05 for a model 20x smaller")
    value = float(target_ratio)
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{argument} must be in (0, 1], got {target_ratio!r}; it is "
                         f"params(compiled) / params(model), e.g. 0.05 for 20x smaller")
    return value


#: ``compile(allocation=...)``: how ranks are shared among layers.
ALLOCATIONS = ("auto", "sensitivity", "uniform")

#: Most rows a contraction is planned for (beyond it index arithmetic overflows int32
#: kernels and no device holds the activations).
MAX_ROWS = 2**31 - 1
#: Most batch sizes to plan for (each is a contraction search), and most cores per network
#: (each core a mode >= 2: 16 factor a 65,536-wide dimension).
MAX_BATCH_SIZES = 64
MAX_CORES = 16


def check_batch_sizes(batch_sizes: Any, argument: str = "batch_sizes") -> list[int] | None:
    """Validate ``compile(batch_sizes=...)``: ``None`` or a list of ints in ``[1, 2**31)``."""
    if batch_sizes is None:
        return None
    example = f"e.g. {argument}=[32, 256]"
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, (list, tuple, set, frozenset, range)):
        raise TypeError(f"{argument} must be a list of positive ints, got {type(batch_sizes).__name__} "
                        f"{batch_sizes!r}; {example}")
    if len(batch_sizes) > MAX_BATCH_SIZES:
        raise ValueError(f"{argument}: {len(batch_sizes):,} batch sizes, at most {MAX_BATCH_SIZES} "
                         "(each is a contraction search); give the sizes you train and serve at")
    out = []
    for b in batch_sizes:
        if not is_int(b):
            raise TypeError(f"{argument} entries must be ints, got {type(b).__name__} {b!r}; {example}")
        if not 1 <= b <= MAX_ROWS:
            raise ValueError(f"{argument} entries must be in [1, {MAX_ROWS}], got {b!r}; {example}")
        out.append(int(b))
    return sorted(set(out))


#: ``compile(linear_cores="measured")``: each linear's cores (1, 2 or 3 a side) chosen by
#: timing its network on the device (the ``choose_cores`` pass)
MEASURED_CORES = "measured"
#: the cores a side every linear starts from (and keeps, unless measured otherwise)
DEFAULT_LINEAR_CORES = 3


@dataclass
class CompileOptions:
    """What ``tncompile.compile`` was asked to do; see its docstring."""

    target_ratio: float = 0.05
    target_modules: str | Sequence[str] = "all"
    exclude_modules: str | Sequence[str] | None = None
    rank_pattern: dict[str, int] | None = None
    init: str = "svd"
    batch_sizes: Sequence[int] | None = None
    linear_cores: int | str = 3
    embedding_cores: int = 4
    seed: int | None = 0
    prefer: str = "speed"
    allocation: str = "auto"

    @property
    def cores_per_side(self) -> int:
        """The cores a side ``tensorize`` gives each linear (``choose_cores`` may change them)."""
        return DEFAULT_LINEAR_CORES if self.linear_cores == MEASURED_CORES else self.linear_cores

    def __post_init__(self) -> None:
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}: 'sensitivity' "
                             "spends the parameters where calibration data shows the output needs them, "
                             "'uniform' gives every layer the same rank, 'auto' picks sensitivity with calibration")
        self.target_ratio = check_target_ratio(self.target_ratio)
        if self.prefer not in PREFER:
            raise ValueError(f"prefer must be one of {PREFER}, got {self.prefer!r}: 'speed' keeps every "
                             "network at most as costly as its dense layer, 'size' lets ranks grow past that")
        if self.init not in ("svd", "random"):
            raise ValueError(f"init must be 'svd' or 'random', got {self.init!r}")
        if self.linear_cores != MEASURED_CORES:
            check_int(self.linear_cores, "linear_cores (cores per network, each a mode >= 2, or 'measured': each "
                      "layer's chosen by timing)", 1, MAX_CORES)
        check_int(self.embedding_cores, "embedding_cores (cores per network, each a mode >= 2)", 1, MAX_CORES)
        if self.rank_pattern is not None:
            if not isinstance(self.rank_pattern, dict):
                raise TypeError(f"rank_pattern must be a dict {{module-name suffix or 're:<regex>': rank}}, "
                                f"got {type(self.rank_pattern).__name__} {self.rank_pattern!r}; "
                                "e.g. rank_pattern={'fc1': 8}")
            for k, v in self.rank_pattern.items():
                if not isinstance(k, str):
                    raise TypeError(f"rank_pattern keys must be module-name suffixes or 're:<regex>' "
                                    f"strings, got {k!r}")
                check_entry(k, "rank_pattern")
                check_int(v, f"rank_pattern[{k!r}] (a rank)", 1)
        self.batch_sizes = check_batch_sizes(self.batch_sizes)
        check_int(self.seed, "seed", none_ok=True, error=TypeError)
