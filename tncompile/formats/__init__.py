"""TT / TTM layouts: mode factorization, rank bounds, counts, TT-SVD."""
from .factorize import balanced_factors, factorize
from .layout import Layout, TTLayout, TTMLayout, normalize_ranks
from .indices import BATCH, network_indices, planner_problem
from .factorization import (random_cores, tt_from_linear_weight, tt_svd, tt_to_dense,
                        ttm_from_embedding_weight, ttm_to_dense)

__all__ = ["factorize", "balanced_factors", "Layout", "TTLayout", "TTMLayout", "normalize_ranks",
           "tt_svd", "tt_from_linear_weight", "ttm_from_embedding_weight", "random_cores",
           "tt_to_dense", "ttm_to_dense", "BATCH", "network_indices", "planner_problem"]
