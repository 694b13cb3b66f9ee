"""evaluate() on each input form, the "BMA first, metric second" pitfall, and a real pyro.infer.Predictive output."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal

from pyro_flat.metrics import (
    StreamingBMA,
    accuracy,
    bma_nll,
    bma_probs,
    brier_score,
    evaluate,
    expected_calibration_error,
    mutual_information,
    ood_report,
    predictive_entropy,
)

from .conftest import make_problem

BASE_KEYS = {"acc", "nll", "ece", "brier", "predictive_entropy"}
OOD_KEYS = {"ood_auroc_maxprob", "ood_aupr_maxprob", "ood_auroc_entropy", "ood_aupr_entropy"}


def _forms(logits):
    return {
        "probs": bma_probs(logits),
        "stream": StreamingBMA().update(logits),
        "predictive": {"logits": logits, "w": torch.zeros(logits.shape[0], 3)},
    }


def test_every_input_form_gives_the_same_report(problem):
    logits, y = problem
    ood_logits = 0.3 * make_problem(num_points=200, seed=7)[0]
    reports = {
        name: evaluate(form, y, ood_predictions=ood_form)
        for (name, form), ood_form in zip(_forms(logits).items(), _forms(ood_logits).values(), strict=True)
    }
    assert set(reports["probs"]) == BASE_KEYS | OOD_KEYS  # no samples, no mutual information
    assert set(reports["stream"]) == set(reports["predictive"]) == BASE_KEYS | OOD_KEYS | {"mutual_information"}
    for report in reports.values():
        assert all(type(v) is float for v in report.values())
        for key in BASE_KEYS | OOD_KEYS:
            assert report[key] == pytest.approx(reports["probs"][key], rel=1e-10, abs=1e-12)
    assert reports["stream"]["mutual_information"] == pytest.approx(reports["predictive"]["mutual_information"])


def test_report_values_are_the_metric_functions(problem):
    logits, y = problem
    probs = bma_probs(logits)
    ood_probs = bma_probs(0.3 * make_problem(num_points=200, seed=7)[0])
    report = evaluate({"logits": logits}, y, ood_predictions=ood_probs, num_bins=10)
    assert report["acc"] == float(accuracy(probs, y))
    assert report["nll"] == pytest.approx(float(bma_nll(probs, y)), rel=1e-12)
    assert report["ece"] == pytest.approx(float(expected_calibration_error(probs, y, 10)), rel=1e-12)
    assert report["ece"] != pytest.approx(float(expected_calibration_error(probs, y, 15)), rel=1e-3)
    assert report["brier"] == pytest.approx(float(brier_score(probs, y)), rel=1e-12)
    assert report["predictive_entropy"] == pytest.approx(float(predictive_entropy(probs).mean()), rel=1e-12)
    mi = float(mutual_information(torch.softmax(logits, dim=-1)).mean())
    assert report["mutual_information"] == pytest.approx(mi, rel=1e-10)
    for key, value in ood_report(probs, ood_probs).items():
        assert report[key] == pytest.approx(value, rel=1e-12)


def test_bma_first_metric_second():
    """S = 8, N = 5000, C = 10, logits 2·N(0,1), random labels.

    Reference values NLL(BMA) = 2.49 vs mean member NLL 3.76 and ECE(BMA) = 0.113 vs 0.430; the Monte-Carlo standard
    error of the NLLs at N = 5000 is about 0.01 (population values 2.506 and 3.771), so ±0.05 is a 5σ band.
    """
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(8, 5000, 10, generator=g)
    y = torch.randint(0, 10, (5000,), generator=g)
    report = evaluate({"logits": logits}, y)
    members = [evaluate(torch.softmax(member, dim=-1), y) for member in logits]
    member_nll = sum(m["nll"] for m in members) / 8
    member_ece = sum(m["ece"] for m in members) / 8
    direct = -torch.softmax(logits, dim=-1).mean(dim=0).gather(1, y[:, None]).log().mean()
    assert report["nll"] == pytest.approx(float(direct), rel=1e-12)  # the log of the mean ...
    assert report["nll"] < member_nll - 1.0  # ... not the mean of the logs (Jensen)
    assert abs(report["nll"] - 2.49) < 0.05 and abs(member_nll - 3.76) < 0.05
    assert abs(report["ece"] - 0.113) < 0.02 and abs(member_ece - 0.430) < 0.02


def test_stream_nll_is_computed_in_log_space():
    # confidently wrong float32 samples: the BMA probability of the label underflows to 0, its log does not
    logits = torch.tensor([[[0.0, 200.0]], [[0.0, 150.0]]], dtype=torch.float32)
    y = torch.tensor([0])
    report = evaluate({"logits": logits}, y)
    expected = -(torch.logsumexp(torch.tensor([-200.0, -150.0], dtype=torch.float64), 0) - math.log(2))
    assert report["nll"] == pytest.approx(float(expected), rel=1e-6)
    assert report["nll"] > 140 > evaluate(bma_probs(logits), y)["nll"]  # probs: clamped at float32's tiny, 87.3


def _softmax_regression(x, y=None, num_classes=3):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1], num_classes]).to_event(2))
    logits = pyro.deterministic("logits", x @ w)
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Categorical(logits=logits), obs=y)


def test_pyro_predictive_output():
    x = torch.randn(40, 4)
    y = torch.randint(0, 3, (40,))
    guide = AutoNormal(_softmax_regression)
    guide(x, y)  # set the guide up on the observed model
    predictive = Predictive(_softmax_regression, guide=guide, num_samples=12)
    samples = predictive(x)
    assert samples["logits"].shape == (12, 1, 40, 3)  # Predictive keeps a singleton plate dimension
    report = evaluate(samples, y, ood_predictions=predictive(5 * torch.randn(30, 4)))
    assert set(report) == BASE_KEYS | OOD_KEYS | {"mutual_information"}
    logits = samples["logits"].squeeze(1)
    assert report["nll"] == pytest.approx(evaluate(StreamingBMA().update(logits), y)["nll"], rel=1e-12)
    assert report["nll"] == pytest.approx(float(bma_nll(bma_probs(logits), y)), rel=1e-12)


def test_validation_errors(problem):
    logits, y = problem
    with pytest.raises(ValueError, match=r"""without a "logits" key \(found keys: \['obs', 'w'\]\)"""):
        evaluate({"w": logits, "obs": y}, y)
    with pytest.raises(ValueError, match=r"must be BMA probabilities of shape \[N, C\], got shape \[8, 600, 10\]"):
        evaluate(logits, y)
    with pytest.raises(ValueError, match=r"`predictions\['logits'\]` must have shape \[S, N, C\]"):
        evaluate({"logits": logits[0]}, y)
    with pytest.raises(ValueError, match="`predictions` must be BMA probabilities"):
        evaluate(logits.numpy(), y)
    with pytest.raises(ValueError, match="`predictions` is a StreamingBMA without samples"):
        evaluate(StreamingBMA(), y)
    with pytest.raises(ValueError, match="`y` has 599 labels but the predictions have 600 rows"):
        evaluate(bma_probs(logits), y[1:])
    with pytest.raises(ValueError, match="`ood_predictions` has 3 classes but `predictions` has 10"):
        evaluate(bma_probs(logits), y, ood_predictions=torch.full((5, 3), 1 / 3))
    with pytest.raises(ValueError, match="`predictions` must sum to 1"):
        evaluate(torch.softmax(logits[0], -1) * 0.9, y)
    with pytest.raises(ValueError, match="`num_bins` must be an int >= 1"):
        evaluate(bma_probs(logits), y, num_bins=0)
