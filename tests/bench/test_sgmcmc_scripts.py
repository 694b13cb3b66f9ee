"""The SG-MCMC experiment and speed scripts of ``benchmarks/`` run end to end in their smoke sizes."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their shared timing module `_timing`
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_sharp_flat_smoke(tmp_path):
    _load("sgmcmc_sharp_flat").main(["--smoke", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "sharp_flat_smoke.json").read_text())
    assert {"SGLD", "Entropy-SGD", "Entropy-SGLD", "Entropy-MCMC (theta)", "Entropy-MCMC (theta_a)"} <= set(
        record["methods"])
    # 400 gradient evaluations from the sharp mode are far too few for SGLD to cross the ~8-nat barrier
    assert record["methods"]["SGLD"]["flat_fraction"] < 0.05
    assert (tmp_path / "sharp_flat_smoke.png").stat().st_size > 1000


def test_logistic_smoke(tmp_path):
    _load("sgmcmc_logistic").main(["--smoke", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "logistic_digits_smoke.json").read_text())
    # digits 1 vs 7 is nearly separable: SGD's iterate is above 95 % after 200 gradient evaluations
    assert record["methods"]["SGD"]["current_acc_mean"][-1] > 95
    assert "Entropy-MCMC (theta)" in record["methods"]


def test_speed_benchmark_smoke(tmp_path):
    out = tmp_path / "speed.md"
    _load("sgmcmc").main(["--repeats", "1", "--steps", "10", "--out", str(out)])
    text = out.read_text()
    assert "MCMC(EntropyMCMC) / MCMC(SGLD)" in text and "torch SGLD, idiomatic" in text
