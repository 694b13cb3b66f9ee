"""The package's shared checks: the one integer check and the one real-number check (which argument, what was
expected, what was given) and the one-host-read test of many flags."""

import re

import pytest
import torch

from pyro_flat._validation import all_true, check_int, check_positive, check_real


def test_check_int_accepts_ints_at_the_bound():
    assert check_int(3, "k") == 3
    assert check_int(0, "start", minimum=0) == 0


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "3", None])
def test_check_int_names_the_argument_and_the_bound(value):
    with pytest.raises(ValueError, match=r"^HWA.callback: `k` must be an int >= 1, got "):
        check_int(value, "k", owner="HWA.callback")


def test_check_real_accepts_numbers_in_the_interval_as_floats():
    assert check_real(2, "rho", low=0) == 2.0 and isinstance(check_real(2, "rho", low=0), float)
    assert check_real(0, "rho", low=0) == 0.0  # a closed end
    assert check_real(1, "p", low=0, high=1) == 1.0
    assert check_real(-1e300, "x") == -1e300


@pytest.mark.parametrize(("value", "bounds", "said"), [
    (0, {"low": 0, "low_open": True}, "a finite number > 0"),
    (-0.5, {"low": 0}, "a finite number >= 0"),
    (float("inf"), {"low": 0}, "a finite number >= 0"),
    (float("nan"), {"low": 0}, "a finite number >= 0"),
    (True, {"low": 0}, "a finite number >= 0"),
    ("1", {"low": 0}, "a finite number >= 0"),
    (None, {}, "a finite number"),
    (1, {"low": 0, "high": 1, "high_open": True}, r"a number in \[0, 1\)"),
    (0, {"low": 0, "high": 1, "low_open": True}, r"a number in \(0, 1\]"),
    (2, {"high": 1}, "a finite number <= 1"),
])
def test_check_real_names_the_argument_and_the_numbers_it_accepts(value, bounds, said):
    with pytest.raises(ValueError, match=rf"^SAM: `rho` must be {said}, got {re.escape(repr(value))}$"):
        check_real(value, "rho", owner="SAM", **bounds)


def test_all_true_reads_every_flag_at_once():
    ones = torch.ones(3)
    assert all_true([])
    assert all_true([ones.isfinite().all(), (ones > 0).all()])
    assert not all_true([ones.isfinite().all(), (ones > 1).all(), torch.tensor(True)])


def test_a_one_element_tensor_is_the_number_it_holds_and_nothing_else_is_a_number():
    assert check_real(torch.tensor(0.5), "rho", low=0) == 0.5 and type(check_real(torch.tensor(2), "x")) is float
    assert check_real(torch.tensor([0.25]), "rho") == 0.25
    assert check_int(torch.tensor(3), "k") == 3 and type(check_int(torch.tensor(3), "k")) is int
    for value in (torch.tensor(float("nan")), torch.tensor(True), torch.tensor([1.0, 2.0]), torch.tensor(-1.0)):
        with pytest.raises(ValueError, match=r"^`rho` must be a finite number >= 0"):
            check_real(value, "rho", low=0)
    for value in (torch.tensor(3.0), torch.tensor(True), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match=r"^`k` must be an int >= 1"):
            check_int(value, "k")


def _sgld(step_size):
    from pyro_flat.infer.mcmc import SGLD

    return SGLD(potential_fn=lambda p: (p["x"] ** 2).sum(), step_size=step_size).schedule(0)


def _sam(rho):
    from pyro_flat.optim import SAM

    return SAM([torch.zeros(1, requires_grad=True)], torch.optim.SGD, rho=rho, lr=0.1).rho


def _sghmc(friction):
    from pyro_flat.infer.mcmc import SGHMC

    return SGHMC(potential_fn=lambda p: (p["x"] ** 2).sum(), step_size=0.1, friction=friction).friction


def _entropy_sgld(outer_step_size):
    from pyro_flat.infer.mcmc import EntropySGLD

    return EntropySGLD(potential_fn=lambda p: (p["x"] ** 2).sum(), eta=1.0, step_size=0.1,
                       outer_step_size=outer_step_size).outer_step_size


@pytest.mark.parametrize("build", [_sgld, _sam, _sghmc, _entropy_sgld], ids=lambda f: f.__name__[1:])
def test_every_number_argument_takes_a_tensor_by_the_same_rule(build):
    """SGLD's step size as rho: the number a one-element tensor holds, or the same refusal."""
    assert build(torch.tensor(0.25)) == build(0.25) == 0.25
    for bad in (torch.tensor(float("nan")), float("nan"), torch.tensor([0.1, 0.2])):
        with pytest.raises(ValueError, match=r"must be a (finite number|number in)"):
            build(bad)
    assert check_positive(torch.tensor(1e-3), "step_size") == 1e-3
