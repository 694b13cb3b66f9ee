"""The SA-BMA methods in the harness, and the transfer-learning experiment script in its smoke mode."""

import importlib.util
import sys
from pathlib import Path

import pytest

from pyro_flat.bench import METHODS, RunConfig
from pyro_flat.bench.runner import run_one

TINY = RunConfig(hidden=(32,), num_epochs=4, lr=1e-2, num_bma_samples=4, lambda_max_draws=1, lambda_max_points=64,
                 lambda_max_iters=10, options={"sa_bma": {"rank": 2}})


def test_methods_are_registered_with_their_baselines():
    assert METHODS["sa_bma"].baseline == "vi_low_rank"
    assert METHODS["sa_bma_score"].baseline == "vi_low_rank"
    assert METHODS["sa_bma_diag"].baseline == "vi"
    assert METHODS["vi_low_rank"].baseline is None
    assert "2406.15664" in METHODS["sa_bma"].reference


@pytest.mark.parametrize("method", ["sa_bma", "sa_bma_diag"])
def test_sa_bma_learns_digits(method):
    record = run_one(method, "digits", 0, TINY)
    m = record.metrics
    # 4 epochs (Adam, lr 1e-2) of a 64-32-10 MLP on digits: far above the 10 % of chance
    assert m["acc"] > 0.8 and 0 < m["nll"] < 1.0 and m["lambda_max"] > 0
    assert record.info["radius"] == 1.0


@pytest.mark.slow
def test_transfer_script_smoke(tmp_path):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sa_bma_transfer.py"
    spec = importlib.util.spec_from_file_location("sa_bma_transfer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sa_bma_transfer"] = module
    try:
        spec.loader.exec_module(module)
        records = module.main(["--smoke", "--out", str(tmp_path)])
    finally:
        del sys.modules["sa_bma_transfer"]
    assert {r["method"] for r in records} == set(module.METHODS)
    assert all(0 <= r["acc"] <= 1 and r["nll"] > 0 for r in records)
    table = (tmp_path / "transfer_table.md").read_text()
    assert "| sa_bma |" in table and "λ_max" in table
