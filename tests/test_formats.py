import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from tncompile.formats import (TTLayout, TTMLayout, balanced_factors, factorize, random_cores,
                               tt_from_linear_weight, tt_svd, tt_to_dense, ttm_from_embedding_weight,
                               ttm_to_dense)


@pytest.mark.parametrize("n,d,expected", [(768, 3, (8, 8, 12)), (3072, 3, (12, 16, 16)),
                                          (128, 4, (2, 4, 4, 4))])
def test_factorize_paper_shapes(n, d, expected):
    assert factorize(n, d) == expected


def _prime_factor_count(n: int) -> int:
    """Prime factors of ``n`` with multiplicity (trial division)."""
    count, p = 0, 2
    while p * p <= n:
        while n % p == 0:
            n, count = n // p, count + 1
        p += 1
    return count + (n > 1)


@given(st.integers(2, 50000), st.integers(1, 4))
@example(9, 3)  # 8 is under 9 and 9..11 have fewer than 3 prime factors: impossible, though 2**3 < 9 * 1.25
@settings(max_examples=60, deadline=None)
def test_factorize_covers_and_is_bounded(n, d):
    try:
        modes = factorize(n, d)
    except ValueError:
        # only impossible when no size within 25% padding has d prime factors (each mode >= 2)
        assert not any(_prime_factor_count(N) >= d for N in range(max(n, 2 ** d), int(n * 1.25) + 1))
        return
    assert len(modes) == d and all(m >= 2 for m in modes)
    assert n <= math.prod(modes) <= max(2 ** d, int(n * 1.25))


def _factorize_exhaustively(n: int, d: int) -> tuple[int, ...]:
    """Every product within the padding scored, none skipped (factorize's definition)."""
    from tncompile import tuning
    scored = []
    for N in range(max(n, 2 ** d), int(math.floor(n * (1 + tuning.MAX_MODE_PADDING))) + 1):
        f = balanced_factors(N, d)
        if f is not None:
            scored.append((sum(f) * N / n * (1 + tuning.PAD_PENALTY if N != n else 1), N, f))
    best = min(s[0] for s in scored)
    return next(f for score, _, f in scored if score <= best + 1e-12)   # the first within rounding, as factorize


@given(st.integers(2, 20000), st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_factorize_stops_early_only_where_no_larger_product_can_win(n, d):
    try:
        expected = _factorize_exhaustively(n, d)
    except ValueError:     # nothing within the padding
        with pytest.raises(ValueError):
            factorize(n, d)
        return
    assert factorize(n, d) == expected


def test_a_million_row_table_factors_in_bounded_time_and_memory():
    """Every product up to 25% past a million used to be tried and memoized process-wide:
    ~560 MB kept after compiling DLRM's 26 tables, and most of the compile's time."""
    import time
    import tracemalloc
    balanced_factors.cache_clear()
    tracemalloc.start()
    start = time.perf_counter()
    assert factorize(1_000_003, 4) == (29, 29, 34, 35) and factorize(1_000_000, 3) == (100, 100, 100)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20 and seconds < 30
    assert balanced_factors.cache_info().maxsize is not None


def test_factorize_pads_primes_and_bert_vocab():
    modes = factorize(30522, 4)  # 30522 = 2 * 3 * 5087: pad a little
    assert math.prod(modes) >= 30522 and math.prod(modes) < 30522 * 1.01
    assert max(modes) <= 16
    p = factorize(7919, 3)  # a prime
    assert math.prod(p) > 7919 and max(p) < 30


def test_balanced_factors_minimal_sum():
    assert balanced_factors(64, 3) == (4, 4, 4)
    assert balanced_factors(13, 2) is None


def test_rank_bounds_and_param_count():
    lay = TTLayout.for_shape(768, 3072, 3, ranks=30)
    assert lay.rank_bounds() == (8, 64, 768, 256, 16)
    assert lay.ranks == (8, 30, 30, 30, 16)
    r = (1, 8, 30, 30, 30, 16, 1)
    cores = sum(r[k] * n * r[k + 1] for k, n in enumerate(lay.site_sizes))
    assert lay.num_params() == cores + sum(lay.ranks)
    assert lay.num_params(include_gates=False) == cores
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        lay.with_ranks(0)


@pytest.mark.parametrize("shape,d", [((12, 20), 2), ((30, 8), 3), ((27, 16), 2)])
def test_tt_svd_exact_at_full_rank(shape, d):
    out_f, in_f = shape
    w = torch.randn(out_f, in_f, dtype=torch.float64)
    lay = TTLayout.for_shape(in_f, out_f, d).with_ranks(10 ** 6)
    assert torch.allclose(tt_to_dense(tt_from_linear_weight(w, lay), lay), w, atol=1e-10)


def test_tt_svd_error_falls_with_rank():
    w = torch.randn(48, 64, dtype=torch.float64)
    lay = TTLayout.for_shape(64, 48, 3)
    errs = [(tt_to_dense(tt_from_linear_weight(w, lay.with_ranks(r)), lay.with_ranks(r)) - w).norm() / w.norm()
            for r in (1, 2, 4, 8, 16, 64)]
    assert all(a >= b - 1e-12 for a, b in zip(errs, errs[1:]))
    assert errs[0] > 0.5 and errs[-1] < 1e-10


def test_ttm_svd_exact_and_padded():
    e = torch.randn(101, 12, dtype=torch.float64)  # 101 is prime: padded rows
    lay = TTMLayout.for_shape(101, 12, 2)
    assert lay.padded_rows > 101
    full = lay.with_ranks(10 ** 6)
    assert torch.allclose(ttm_to_dense(ttm_from_embedding_weight(e, full), full), e, atol=1e-10)


def test_tt_svd_generic_tensor():
    t = torch.randn(3, 4, 5, dtype=torch.float64)
    cores = tt_svd(t, (100, 100))
    rebuilt = torch.einsum("aib,bjc,ckd->ijk", *cores)
    assert torch.allclose(rebuilt, t, atol=1e-12)


@pytest.mark.parametrize("layout,var", [(TTLayout.for_shape(256, 512, 3, ranks=8), 1 / (3 * 256)),
                                        (TTMLayout.for_shape(1000, 64, 3, ranks=8), 1.0)])
def test_random_init_matches_dense_variance(layout, var):
    # one draw's entries share cores, so average the mean square over draws
    gen = torch.Generator().manual_seed(1)
    to_dense = tt_to_dense if isinstance(layout, TTLayout) else ttm_to_dense
    ms = [to_dense(random_cores(layout, var, gen), layout).pow(2).mean().item() for _ in range(40)]
    assert 0.75 * var < sum(ms) / len(ms) < 1.25 * var


def test_randomized_truncation_close_to_exact_and_rng_untouched(monkeypatch):
    import tncompile.formats.factorization as dec
    w = torch.randn(256, 48, dtype=torch.float64) @ torch.randn(48, 512, dtype=torch.float64)
    lay = TTLayout.for_shape(512, 256, 2).with_ranks(6)  # bond bound 512: randomized path
    state = torch.random.get_rng_state()
    fast = (tt_to_dense(tt_from_linear_weight(w, lay), lay) - w).norm()
    assert torch.equal(state, torch.random.get_rng_state())
    monkeypatch.setattr(dec, "_truncated_svd", lambda m, r: torch.linalg.svd(m, full_matrices=False))
    exact = (tt_to_dense(tt_from_linear_weight(w, lay), lay) - w).norm()
    assert exact <= fast <= 1.02 * exact
