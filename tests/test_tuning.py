"""``tuning.override``: tuned values set for a scope and put back, even on an error (issue 54)."""
import pytest

from tncompile import tuning


def test_override_sets_for_the_scope_and_restores():
    before = (tuning.TRITON_KERNELS, tuning.CHAIN_ROWS)
    with tuning.override(TRITON_KERNELS=not before[0], CHAIN_ROWS=before[1] + 1):
        assert (tuning.TRITON_KERNELS, tuning.CHAIN_ROWS) == (not before[0], before[1] + 1)
        with tuning.override(CHAIN_ROWS=1):
            assert tuning.CHAIN_ROWS == 1
        assert tuning.CHAIN_ROWS == before[1] + 1
    assert (tuning.TRITON_KERNELS, tuning.CHAIN_ROWS) == before
    with pytest.raises(RuntimeError), tuning.override(GROUP_FACTORS=False):
        raise RuntimeError("inside")
    assert tuning.GROUP_FACTORS is True


def test_an_unknown_name_is_refused_naming_the_known_ones():
    with pytest.raises(KeyError, match="TRITON_KERNEL.*is not a tuned value.*TRITON_KERNELS"):
        with tuning.override(TRITON_KERNEL=True):
            pass
    with pytest.raises(KeyError):
        with tuning.override(override=True):  # a function, not a value
            pass
