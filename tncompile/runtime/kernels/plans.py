"""The plans the runtime executes, and where it gets new ones.

A :class:`ContractionPlan` (a TT network's pairwise order for one bucket of
rows) and a :class:`LookupPlan` (a TTM lookup's split point) are plain data:
the compile-time planner (:mod:`tncompile.planning`) searches for them and the
runtime only runs them, the way a virtual machine runs bytecode it did not
write. Buckets are powers of two of the row count (:func:`bucket_of`).

When a layer meets a bucket nobody planned, it asks the registered planner
(:func:`get_planner`). The planner is registered by :mod:`tncompile.planning`
when ``tncompile`` is imported: the runtime depends on the *interface*
(:class:`Planner`), never on the planning code itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

__all__ = ["Step", "ContractionPlan", "LookupPlan", "bucket_of", "Planner", "set_planner", "get_planner"]

Indices = tuple[str, ...]


def bucket_of(rows: int) -> int:
    """Power-of-two bucket (>= rows) whose plan serves ``rows`` rows."""
    return 1 if rows <= 1 else 1 << (int(rows) - 1).bit_length()


@dataclass(frozen=True)
class Step:
    """``C = tensordot(A, B, (a_axes, b_axes))``; C's indices are A's free then B's free.

    The ``grad_*`` fields are the backward's recipe, fixed at plan time:
    ``dA = permute(tensordot(dC, B, (grad_a_c_axes, grad_a_b_axes)), grad_a_perm)``
    and ``dB = permute(tensordot(A, dC, (grad_b_a_axes, grad_b_c_axes)), grad_b_perm)``.
    """

    a: int
    b: int
    a_axes: tuple[int, ...]
    b_axes: tuple[int, ...]
    a_idx: Indices
    b_idx: Indices
    c_idx: Indices
    flops: int           # multiply-adds
    size: int            # elements of C
    grad_a_c_axes: tuple[int, ...] = ()
    grad_a_b_axes: tuple[int, ...] = ()
    grad_a_perm: tuple[int, ...] | None = None
    grad_b_a_axes: tuple[int, ...] = ()
    grad_b_c_axes: tuple[int, ...] = ()
    grad_b_perm: tuple[int, ...] | None = None

    @classmethod
    def make(cls, a, b, a_axes, b_axes, ai, bi, ci, flops, size) -> "Step":
        """A step with its backward recipe derived from the forward's axes."""
        a_free = [k for k in range(len(ai)) if k not in a_axes]
        b_free = [k for k in range(len(bi)) if k not in b_axes]
        n_a_free = len(a_free)
        got_a = [ai[k] for k in a_free] + [bi[k] for k in sorted(b_axes)]
        got_b = [ai[k] for k in sorted(a_axes)] + [bi[k] for k in b_free]

        def perm(got, target):
            p = tuple(got.index(x) for x in target)
            return None if p == tuple(range(len(p))) else p

        return cls(a, b, tuple(a_axes), tuple(b_axes), ai, bi, ci, flops, size,
                   grad_a_c_axes=tuple(range(n_a_free, len(ci))), grad_a_b_axes=tuple(b_free),
                   grad_a_perm=perm(got_a, ai),
                   grad_b_a_axes=tuple(a_free), grad_b_c_axes=tuple(range(n_a_free)),
                   grad_b_perm=perm(got_b, bi))


@dataclass
class ContractionPlan:
    """Pairwise order for one network at one bucket size.

    Attributes
    ----------
    rows : int
        The bucket (number of rows of the batch index) it was planned for.
    inputs, output : index tuples of the operands and of the result.
    steps : list of Step
        In execution order; operand ids are SSA (inputs first, then results).
    out_perm : tuple of int or None
        Permutation from the last step's index order to ``output``.
    fwd_flops, bwd_flops, write, largest : int
        Multiply-adds forward and backward (reverse mode through the steps),
        elements written by both, largest intermediate.
    naive_cost : float
        The cost of the naive left-to-right order.
    strategy : str
        Which candidate won.
    cost : float
        The planner's cost of this order (same units as ``naive_cost``).
    kernels : int
        Eager kernels forward and backward.
    bias_fusable : bool
        The last step yields ``(rows, outputs...)``: a bias can join its GEMM.
    batch : str or None
        The index whose size varies within the bucket (the rows).
    sizes : dict or None
        Every other index's size.
    """

    rows: int
    inputs: list[Indices]
    output: Indices
    steps: list[Step]
    out_perm: tuple[int, ...] | None
    fwd_flops: int
    bwd_flops: int
    write: int
    largest: int
    naive_cost: float
    strategy: str
    write_weight: float = 0.0
    candidates: dict[str, float] = field(default_factory=dict)
    kernels: int = 0
    bias_fusable: bool = False
    batch: str | None = None
    sizes: dict[str, int] | None = None
    cost: float = 0.0

    def __getstate__(self) -> dict:
        # the executor caches generated code on the plan (``_program*``): never saved
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    @property
    def speedup(self) -> float:
        """Cost of the naive left-to-right order over this plan's."""
        return self.naive_cost / self.cost if self.cost else 1.0

    def order(self, names: Sequence[str] | None = None) -> str:
        """The steps as a nested expression, e.g. ``(x.(G0.G1))``."""
        exprs = list(names) if names is not None else [f"t{i}" for i in range(len(self.inputs))]
        for s in self.steps:
            exprs.append(f"({exprs[s.a]}.{exprs[s.b]})")
        return exprs[-1] if self.steps else exprs[0]

    def describe(self, names: Sequence[str] | None = None) -> str:
        return (f"rows<={self.rows}: {self.order(names)}  fwd {self.fwd_flops * 2:,} flops, "
                f"fwd+bwd {(self.fwd_flops + self.bwd_flops) * 2:,}, largest {self.largest:,}, "
                f"{self.speedup:.1f}x vs naive [{self.strategy}]")


@dataclass
class LookupPlan:
    """Split point and cost of a TTM lookup for buckets of ``rows`` ids.

    The cores are split at ``split``: the left ones merge into a table
    ``L[M_L, N_L, r]``, the right ones into ``R[M_R, r, N_R]``, and an id is
    one product ``L[i_L] @ R[i_R]``.
    """

    rows: int
    split: int
    fwd_flops: int
    largest: int
    cost: float
    naive_cost: float
    candidates: dict[int, float] = field(default_factory=dict)
    ranks: tuple[int, ...] | None = None   # the layout's ranks it was planned for

    @property
    def speedup(self) -> float:
        return self.naive_cost / self.cost if self.cost else 1.0

    def order(self, names=None) -> str:
        return f"split at core {self.split}: L[ids_L] @ R[ids_R]"

    def describe(self, names=None) -> str:
        return (f"rows<={self.rows}: {self.order()}  fwd {2 * self.fwd_flops:,} flops, "
                f"largest {self.largest:,}, {self.speedup:.1f}x vs per-id chain")


class Planner(Protocol):
    """What the runtime asks of a planner (implemented by :mod:`tncompile.planning`)."""

    def plan_contraction(self, layout, transpose: bool, rows: int) -> ContractionPlan:
        """The order for a TT/TTM-head network ``layout`` over ``rows`` rows."""

    def plan_lookup(self, layout, rows: int) -> LookupPlan:
        """The split for a TTM lookup of ``rows`` ids."""


_planner: list[Planner] = []


def set_planner(planner: Planner) -> None:
    """Register the planner layers ask for buckets nobody planned yet."""
    _planner[:] = [planner]


def get_planner() -> Planner:
    """The registered planner (``tncompile.planning`` registers one on import)."""
    if not _planner:
        raise RuntimeError("no contraction planner is registered: import tncompile (its planning "
                           "package registers one) before running TT/TTM layers")
    return _planner[0]
