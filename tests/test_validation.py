"""The package's shared checks: the one integer check (which argument, what was expected, what was given) and the
one-host-read test of many flags."""

import pytest
import torch

from pyro_flat._validation import all_true, check_int


def test_check_int_accepts_ints_at_the_bound():
    assert check_int(3, "k") == 3
    assert check_int(0, "start", minimum=0) == 0


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "3", None])
def test_check_int_names_the_argument_and_the_bound(value):
    with pytest.raises(ValueError, match=r"^HWA.callback: `k` must be an int >= 1, got "):
        check_int(value, "k", owner="HWA.callback")


def test_all_true_reads_every_flag_at_once():
    ones = torch.ones(3)
    assert all_true([])
    assert all_true([ones.isfinite().all(), (ones > 0).all()])
    assert not all_true([ones.isfinite().all(), (ones > 1).all(), torch.tensor(True)])
