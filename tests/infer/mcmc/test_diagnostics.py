"""check_mixing: split R-hat over two or more chains, a warning when it is clearly above 1."""

import pytest
import torch
from pyro.infer import MCMC

from pyro_flat.infer.mcmc import SGLD, EntropyMCMC, NotMixedWarning, check_mixing

from .models import normal_normal


@pytest.fixture
def sequential(monkeypatch):
    """Pyro's MCMC runs the chains one after the other in this process."""
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 1)


def test_independent_stationary_chains_pass_and_drifting_ones_warn_by_name():
    torch.manual_seed(0)
    mixed = {"w": torch.randn(4, 500, 3)}
    rhat = check_mixing(mixed)
    assert rhat["w"] == pytest.approx(1.0, abs=0.02)
    drifting = {"w": torch.randn(4, 500, 3), "nu": torch.linspace(20.0, 4.0, 500).expand(4, 500) + torch.randn(4, 500)}
    with pytest.warns(NotMixedWarning, match=r"split R-hat above 1.1 at 'nu' \d+\.\d\d") as caught:
        rhat = check_mixing(drifting)
    assert "'w'" not in str(caught[0].message) and rhat["nu"] > 1.5


def test_chains_stuck_apart_warn():
    torch.manual_seed(1)
    with pytest.warns(NotMixedWarning, match="'w'"):
        check_mixing({"w": torch.randn(2, 100) + torch.tensor([[0.0], [5.0]])})


def test_entropy_mcmc_chains_far_from_the_posterior_warn_under_mcmc(sequential):
    # the situation in miniature: two chains whose warm-up is far too short to leave the start
    data = torch.zeros(4)
    with pytest.warns(UserWarning, match="sequentially"):
        mcmc = MCMC(EntropyMCMC(normal_normal, eta=0.01, step_size=1e-3), num_samples=200, warmup_steps=0,
                    num_chains=2, initial_params={"y": torch.tensor([20.0, -20.0])}, disable_progbar=True)
    mcmc.run(data)
    with pytest.warns(NotMixedWarning, match="'y'"):
        check_mixing(mcmc)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"site 'w' .* \[chains >= 2, draws >= 4"):
        check_mixing({"w": torch.randn(1, 100)})
    with pytest.raises(ValueError, match="expected draws"):
        check_mixing({})


def test_sgld_chains_at_the_posterior_do_not_warn(sequential):
    with pytest.warns(UserWarning, match="sequentially"):
        mcmc = MCMC(SGLD(normal_normal, step_size=0.05), num_samples=400, warmup_steps=100, num_chains=2,
                    disable_progbar=True)
    mcmc.run(torch.zeros(4))
    assert check_mixing(mcmc)["y"] < 1.1
