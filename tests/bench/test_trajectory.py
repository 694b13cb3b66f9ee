"""The trajectory harness methods (SWA/SWAG, F-SWAG, SAM, bSAM, HWA) run, learn digits and report their bookkeeping."""

import pytest

from pyro_flat.bench import METHODS, RunConfig
from pyro_flat.bench.runner import run_one

TINY = RunConfig(hidden=(32,), num_epochs=6, lr=1e-2, num_bma_samples=3, lambda_max_draws=1, lambda_max_points=64,
                 lambda_max_iters=5)

NEW_METHODS = {
    "sam_torch": "map", "swa": "map", "swag": "map", "swag_diag": "map", "f_swa": "swa", "f_swag": "swag",
    "f_swag_diag": "swag_diag", "bsam": "map", "hwa": "vi", "hwa_total": "vi", "hwa_scales": "vi",
    "vi_cyclical": "vi",
}


def test_registered_with_their_baselines():
    for name, baseline in NEW_METHODS.items():
        assert METHODS[name].baseline == baseline


@pytest.mark.parametrize("method", sorted(NEW_METHODS))
def test_method_learns_digits(method):
    record = run_one(method, "digits", 0, TINY)
    m = record.metrics
    # 6 epochs of a 64-32-10 MLP on digits: every method is far above the 10 % of chance
    assert m["acc"] > 0.75, m
    assert 0 < m["nll"] < 1.5
    info = record.info
    if method in ("swa", "swag", "swag_diag", "f_swa", "f_swag", "f_swag_diag"):
        assert info["num_collected"] == 3  # once per epoch after swa_start = 3 of 6 epochs
        assert info["rank"] == 3
    if method.startswith("hwa"):
        assert info["num_collected"] == 3  # one snapshot per one-epoch cycle of the last 3 epochs
    if method == "bsam":
        assert 0 < info["posterior_std_median"] < 1


def test_swa_start_option_is_validated():
    with pytest.raises(ValueError, match="swa_start"):
        run_one("swag", "digits", 0, TINY.replace(options={"swag": {"swa_start": 6}}))
