"""Calibration metrics against scikit-learn, torchmetrics and direct formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import brier_score_loss, log_loss
from torchmetrics.functional.classification import multiclass_calibration_error

from pyro_flat.metrics import (
    accuracy,
    bma_nll,
    bma_probs,
    brier_score,
    expected_calibration_error,
    reliability_bins,
)

from .conftest import make_problem


@pytest.mark.parametrize("num_classes", [2, 3, 10])
@pytest.mark.parametrize("num_bins", [10, 15])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ece_matches_torchmetrics(num_classes, num_bins, dtype):
    logits, y = make_problem(num_classes=num_classes, num_points=2000, seed=num_classes)
    probs = bma_probs(logits).to(dtype)
    ours = expected_calibration_error(probs, y, num_bins)
    reference = multiclass_calibration_error(probs, y, num_classes=num_classes, n_bins=num_bins, norm="l1")
    assert ours.dtype == dtype
    assert abs(float(ours) - float(reference)) < 1e-5
    assert float(ours) > 0.005  # the fixture is not trivially calibrated


def _bins_by_hand(probs, y, num_bins):
    """An independent, loop-based binning: bin b (1-based) holds confidences in ((b-1)/M, b/M], 0 in bin 1."""
    counts, correct, conf = [0] * num_bins, [0.0] * num_bins, [0.0] * num_bins
    for p, label in zip(probs.tolist(), y.tolist(), strict=True):
        c = max(p)
        b = min(max(math.ceil(c * num_bins), 1), num_bins) - 1
        counts[b] += 1
        correct[b] += float(p.index(c) == label)
        conf[b] += c
    return counts, correct, conf


def test_reliability_bins_match_a_direct_loop(problem):
    logits, y = problem
    probs = bma_probs(logits)
    bins = reliability_bins(probs, y, num_bins=15)
    counts, correct, conf = _bins_by_hand(probs, y, 15)
    torch.testing.assert_close(bins["edges"], torch.linspace(0, 1, 16))
    assert bins["counts"].tolist() == counts
    assert bins["counts"].dtype == torch.int64
    nonzero = [max(n, 1) for n in counts]
    torch.testing.assert_close(bins["accuracy"], torch.tensor([a / n for a, n in zip(correct, nonzero, strict=True)]))
    torch.testing.assert_close(bins["confidence"], torch.tensor([c / n for c, n in zip(conf, nonzero, strict=True)]))
    ece = sum(abs(a - c) for a, c in zip(correct, conf, strict=True)) / len(y)  # n_b |acc_b - conf_b| = |sums|
    assert abs(float(expected_calibration_error(probs, y, 15)) - ece) < 1e-12


def test_ece_bin_edges_are_closed_on_the_right():
    # confidences 0.5 (an edge: goes to (0.4, 0.5]), 0.55, 0.95 and exactly 1.0 (goes to the last bin, not an extra)
    probs = torch.tensor([[0.5, 0.5], [0.45, 0.55], [0.05, 0.95], [0.0, 1.0]])
    y = torch.tensor([0, 1, 0, 1])  # correct, correct, wrong, correct
    bins = reliability_bins(probs, y, num_bins=10)
    assert bins["counts"].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 2]
    torch.testing.assert_close(bins["accuracy"][[4, 5, 9]], torch.tensor([1.0, 1.0, 0.5]))
    torch.testing.assert_close(bins["confidence"][[4, 5, 9]], torch.tensor([0.5, 0.55, 0.975]))
    expected = (1 * 0.5 + 1 * 0.45 + 2 * 0.475) / 4
    torch.testing.assert_close(expected_calibration_error(probs, y, 10), torch.tensor(expected))
    # one bin: |accuracy - mean confidence| over all points
    torch.testing.assert_close(expected_calibration_error(probs, y, 1), torch.tensor(abs(0.75 - 0.75)))


def test_ece_of_a_perfect_and_a_maximally_wrong_classifier():
    y = torch.tensor([0, 1, 2, 1])
    one_hot = torch.nn.functional.one_hot(y, 3).to(torch.float64)
    assert float(expected_calibration_error(one_hot, y)) == 0.0
    assert float(expected_calibration_error(one_hot, (y + 1) % 3)) == 1.0


def test_nll_matches_sklearn_log_loss(problem):
    logits, y = problem
    probs = bma_probs(logits)
    reference = log_loss(y.numpy(), probs.numpy(), labels=list(range(probs.shape[1])))
    assert abs(float(bma_nll(probs, y)) - reference) < 1e-4
    torch.testing.assert_close(bma_nll(probs, y), torch.tensor(reference), rtol=1e-12, atol=0)


def test_nll_clamps_a_zero_probability_to_the_smallest_normal():
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    y = torch.tensor([1, 0])
    expected = (-math.log(torch.finfo(torch.float64).tiny) + math.log(2)) / 2
    torch.testing.assert_close(bma_nll(probs, y), torch.tensor(expected))
    assert math.isfinite(float(bma_nll(probs.float(), y)))


def test_brier_binary_matches_sklearn():
    logits, y = make_problem(num_classes=2, num_points=500)
    probs = bma_probs(logits)
    ours = float(brier_score(probs, y))
    # sklearn halves the binary case by default (range [0, 1]), also for 2-column input; ours sums over classes
    assert abs(ours - 2 * brier_score_loss(y.numpy(), probs[:, 1].numpy())) < 1e-12
    assert abs(ours - brier_score_loss(y.numpy(), probs.numpy(), labels=[0, 1], scale_by_half=False)) < 1e-12
    assert abs(ours - 2 * brier_score_loss(y.numpy(), probs.numpy(), labels=[0, 1])) < 1e-12


def test_brier_multiclass_matches_a_direct_formula_and_sklearn(problem):
    logits, y = problem
    probs = bma_probs(logits)
    num_classes = probs.shape[1]
    direct = sum(
        sum((p[c] - (1.0 if c == label else 0.0)) ** 2 for c in range(num_classes))
        for p, label in zip(probs.tolist(), y.tolist(), strict=True)
    ) / len(y)
    assert abs(float(brier_score(probs, y)) - direct) < 1e-12
    # from C >= 3 sklearn's default keeps the [0, 2] range
    assert abs(float(brier_score(probs, y)) - brier_score_loss(y.numpy(), probs.numpy(), labels=range(10))) < 1e-5


def test_brier_range():
    y = torch.tensor([0, 2, 1])
    one_hot = torch.nn.functional.one_hot(y, 3).to(torch.float64)
    assert float(brier_score(one_hot, y)) == 0.0
    assert float(brier_score(one_hot, (y + 1) % 3)) == 2.0


def test_accuracy_matches_numpy_and_breaks_ties_to_the_lowest_class(problem):
    logits, y = problem
    probs = bma_probs(logits)
    expected = float(np.mean(probs.numpy().argmax(axis=1) == y.numpy()))
    assert float(accuracy(probs, y)) == pytest.approx(expected, abs=1e-15)
    assert 0.3 < expected < 0.9
    tied = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    assert float(accuracy(tied, torch.tensor([0, 1]))) == 0.5


def test_metrics_keep_dtype():
    logits, y = make_problem(num_points=50)
    probs = bma_probs(logits).float()
    for metric in (accuracy, bma_nll, brier_score, expected_calibration_error):
        assert metric(probs, y).dtype == torch.float32
    assert reliability_bins(probs, y)["confidence"].dtype == torch.float32


@pytest.mark.parametrize("metric", [accuracy, bma_nll, brier_score, expected_calibration_error, reliability_bins])
def test_validation_errors(metric):
    probs = torch.tensor([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]])
    y = torch.tensor([1, 0, 1])
    with pytest.raises(ValueError, match=r"`probs` must sum to 1 .* largest deviation is 5\.000e-01"):
        metric(probs / 2, y)
    with pytest.raises(ValueError, match=r"`probs` must hold probabilities in \[0, 1\]"):
        metric(torch.tensor([[1.5, -0.5], [0.6, 0.4], [0.5, 0.5]]), y)
    with pytest.raises(ValueError, match=r"`probs` must have shape \[N, C\], got shape \(3,\)"):
        metric(probs[:, 0], y)
    with pytest.raises(ValueError, match="`probs` must be finite"):
        metric(torch.tensor([[float("nan"), 1.0], [0.6, 0.4], [0.5, 0.5]]), y)
    with pytest.raises(ValueError, match="`probs` must be a floating-point tensor"):
        metric(torch.ones(3, 1, dtype=torch.long), y)
    with pytest.raises(ValueError, match=r"`y` must hold labels in \[0, 1\] for C = 2 classes; got values in \[0, 2\]"):
        metric(probs, torch.tensor([1, 0, 2]))
    with pytest.raises(ValueError, match=r"`y` must hold labels in \[0, 1\]"):
        metric(probs, torch.tensor([1, -1, 0]))
    with pytest.raises(ValueError, match="`y` has 2 labels but the predictions have 3 rows"):
        metric(probs, y[:2])
    with pytest.raises(ValueError, match="`y` must hold integer class labels"):
        metric(probs, y.double())
    with pytest.raises(ValueError, match=r"`y` must have shape \[N\]"):
        metric(probs, y[:, None])


@pytest.mark.parametrize("num_bins", [0, -3, 2.5, True, None])
def test_num_bins_validation(num_bins):
    probs = torch.tensor([[0.2, 0.8], [0.6, 0.4]])
    with pytest.raises(ValueError, match="`num_bins` must be an int >= 1"):
        expected_calibration_error(probs, torch.tensor([1, 0]), num_bins)


def test_sum_tolerance_accepts_float32_rounding():
    logits, y = make_problem(num_classes=100, num_points=200)
    probs32 = torch.softmax(logits[0].float(), dim=-1)  # rows sum to 1 only within float32 rounding
    assert float(bma_nll(probs32, y)) > 0
