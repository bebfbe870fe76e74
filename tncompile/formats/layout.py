"""Tensor-train layouts: which modes, which ranks, how big, how expensive.

Two formats, both in CoMERA's conventions:

* **TT** (for ``nn.Linear``): the weight ``W`` of shape ``[out, in]`` is read as
  a tensor with indices ``(i_1..i_d, j_1..j_d)`` -- input modes first, then
  output modes -- and stored as ``2d`` cores ``G_k`` of shape
  ``r[k-1] x n[k] x r[k]`` with ``r[0] = r[2d] = 1``.
* **TTM** (for ``nn.Embedding``): the table ``E`` of shape ``[V, D]`` is stored
  as ``d`` cores of shape ``r[k-1] x m[k] x n[k] x r[k]``, ``m`` the
  vocabulary modes and ``n`` the embedding modes.

Ranks are given for the *internal* bonds only (``r[1] .. r[K-1]``); the
boundary ranks are always 1. Every internal bond also carries a rank gate
(one scalar per rank), counted in the parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Sequence

from .factorize import factorize
from ..errors import check_int

__all__ = ["TTLayout", "TTMLayout", "Layout", "normalize_ranks"]


def normalize_ranks(ranks: int | Sequence[int], bounds: Sequence[int]) -> tuple[int, ...]:
    """Broadcast ``ranks`` to every internal bond and clip to ``bounds``.

    Raises ``ValueError`` for a rank below 1 or a sequence of the wrong length.
    """
    if isinstance(ranks, int):
        ranks = [ranks] * len(bounds)
    ranks = [int(r) for r in ranks]
    if len(ranks) != len(bounds):
        raise ValueError(f"expected {len(bounds)} internal ranks, got {len(ranks)}")
    if any(r < 1 for r in ranks):
        raise ValueError(f"ranks must be >= 1, got {tuple(ranks)}")
    return tuple(min(r, b) for r, b in zip(ranks, bounds))


@dataclass(frozen=True)
class _Base:
    ranks: tuple[int, ...] | None

    # -- to be provided by subclasses -----------------------------------
    @property
    def site_sizes(self) -> tuple[int, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def dense_shape(self) -> tuple[int, int]:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- shared ----------------------------------------------------------
    @property
    def num_cores(self) -> int:
        return len(self.site_sizes)

    @property
    def full_ranks(self) -> tuple[int, ...]:
        """``(1, r_1, ..., r_{K-1}, 1)``; requires ranks to be assigned."""
        if self.ranks is None:
            raise ValueError(f"{self.format} layout has no ranks assigned yet")
        return (1, *self.ranks, 1)

    def rank_bounds(self) -> tuple[int, ...]:
        """Largest useful rank of every internal bond (beyond it TT-SVD is exact)."""
        s = self.site_sizes
        return tuple(min(prod(s[:k]), prod(s[k:])) for k in range(1, len(s)))

    def with_ranks(self, ranks: int | Sequence[int]) -> "_Base":
        """A copy with ``ranks`` broadcast to every bond and clipped to the bounds."""
        return replace(self, ranks=normalize_ranks(ranks, self.rank_bounds()))

    def largest_rank_within(self, params: float) -> int:
        """The largest uniform rank (up to the largest bond's bound) whose network has at most
        ``params`` parameters; 1 when even rank 1 has more (bisection: size grows with rank)."""
        lo, hi = 1, max(self.rank_bounds())
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.with_ranks(mid).num_params() <= params:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def copies(self) -> int:
        """Networks of this layout the layer holds (its experts; 1 for a plain layer)."""
        return getattr(self, "experts", 1)

    @property
    def dense_params(self) -> int:
        """Parameters of the dense weight(s) this layout replaces (unpadded)."""
        a, b = self.dense_shape
        return self.copies * a * b

    def num_params(self, include_gates: bool = True) -> int:
        """Parameters of the cores (and rank gates) at the assigned ranks, all copies."""
        r = self.full_ranks
        cores = sum(r[k] * s * r[k + 1] for k, s in enumerate(self.site_sizes))
        return self.copies * (cores + (sum(self.ranks) if include_gates else 0))

    @property
    def ratio(self) -> float:
        return self.num_params() / self.dense_params

    def describe(self) -> str:
        ranks = "pending" if self.ranks is None else ",".join(map(str, self.ranks))
        experts = f" experts={self.copies}" if self.copies > 1 else ""
        return f"{self.format} modes={self.modes_str()} ranks=[{ranks}]{experts}"


@dataclass(frozen=True)
class TTLayout(_Base):
    """TT layout of a linear map ``in_features -> out_features``.

    Attributes
    ----------
    in_features, out_features : int
        The layer's true (unpadded) sizes.
    in_modes, out_modes : tuple of int
        Factorizations of the padded sizes; ``prod(in_modes) >= in_features``.
    ranks : tuple of int or None
        Internal bond ranks, ``len == len(in_modes) + len(out_modes) - 1``.
    experts : int
        Number of networks of this layout the layer holds: a mixture-of-experts
        layer has one per expert (same modes and ranks, own cores and gates).
        Parameter counts cover all of them; shapes and costs are per network.
    """

    in_features: int = 0
    out_features: int = 0
    in_modes: tuple[int, ...] = ()
    out_modes: tuple[int, ...] = ()
    format: str = "TT"
    experts: int = 1

    @classmethod
    def for_shape(cls, in_features: int, out_features: int, num_cores: int = 3,
                  ranks: int | Sequence[int] | None = None, experts: int = 1) -> "TTLayout":
        """Balanced layout with ``num_cores`` cores per side (``experts`` networks of it)."""
        check_int(experts, "experts", 1)
        lay = cls(ranks=None, in_features=in_features, out_features=out_features,
                  in_modes=factorize(in_features, num_cores),
                  out_modes=factorize(out_features, num_cores), experts=experts)
        return lay if ranks is None else lay.with_ranks(ranks)

    @property
    def site_sizes(self) -> tuple[int, ...]:
        return self.in_modes + self.out_modes

    @property
    def dense_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def padded_in(self) -> int:
        return prod(self.in_modes)

    @property
    def padded_out(self) -> int:
        return prod(self.out_modes)

    def core_shapes(self) -> list[tuple[int, int, int]]:
        r = self.full_ranks
        return [(r[k], n, r[k + 1]) for k, n in enumerate(self.site_sizes)]

    def modes_str(self) -> str:
        return f"{'x'.join(map(str, self.in_modes))}->{'x'.join(map(str, self.out_modes))}"

    def dense_flops(self, tokens: int = 1) -> int:
        """Multiply-adds x2 of ``x @ W.T`` for ``tokens`` rows."""
        return 2 * tokens * self.in_features * self.out_features


@dataclass(frozen=True)
class TTMLayout(_Base):
    """TTM layout of an embedding table ``num_embeddings x embedding_dim``.

    Attributes
    ----------
    row_modes : tuple of int
        Factorization of the padded vocabulary (``m``).
    col_modes : tuple of int
        Factorization of the padded embedding dimension (``n``).
    ranks : tuple of int or None
        Internal bond ranks, ``len == len(row_modes) - 1``.
    """

    num_embeddings: int = 0
    embedding_dim: int = 0
    row_modes: tuple[int, ...] = ()
    col_modes: tuple[int, ...] = ()
    format: str = "TTM"

    @classmethod
    def for_shape(cls, num_embeddings: int, embedding_dim: int, num_cores: int = 4,
                  ranks: int | Sequence[int] | None = None) -> "TTMLayout":
        """Balanced layout with ``num_cores`` cores."""
        lay = cls(ranks=None, num_embeddings=num_embeddings, embedding_dim=embedding_dim,
                  row_modes=factorize(num_embeddings, num_cores),
                  col_modes=tuple(sorted(factorize(embedding_dim, num_cores), reverse=True)))
        return lay if ranks is None else lay.with_ranks(ranks)

    @property
    def site_sizes(self) -> tuple[int, ...]:
        return tuple(m * n for m, n in zip(self.row_modes, self.col_modes))

    @property
    def dense_shape(self) -> tuple[int, int]:
        return (self.num_embeddings, self.embedding_dim)

    @property
    def padded_rows(self) -> int:
        return prod(self.row_modes)

    @property
    def padded_cols(self) -> int:
        return prod(self.col_modes)

    def core_shapes(self) -> list[tuple[int, int, int, int]]:
        r = self.full_ranks
        return [(r[k], m, n, r[k + 1])
                for k, (m, n) in enumerate(zip(self.row_modes, self.col_modes))]

    def modes_str(self) -> str:
        return f"{'x'.join(map(str, self.row_modes))}|{'x'.join(map(str, self.col_modes))}"

    def dense_flops(self, tokens: int = 1) -> int:
        """A dense lookup does no arithmetic; as a linear head it is ``2 V D``."""
        return 2 * tokens * self.num_embeddings * self.embedding_dim


Layout = TTLayout | TTMLayout
