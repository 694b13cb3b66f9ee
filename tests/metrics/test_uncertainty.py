"""Uncertainty and OOD metrics against scikit-learn, torchmetrics and direct formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score
from torchmetrics.functional.classification import binary_auroc, binary_average_precision

from pyro_flat.metrics import (
    bma_probs,
    mutual_information,
    ood_aupr,
    ood_auroc,
    ood_report,
    predictive_entropy,
)

from .conftest import make_problem


def _entropy_np(p):
    p = np.asarray(p)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=-1)


def test_predictive_entropy_matches_numpy_and_its_bounds(problem):
    logits, _ = problem
    probs = bma_probs(logits)
    np.testing.assert_allclose(predictive_entropy(probs).numpy(), _entropy_np(probs.numpy()), rtol=1e-12)
    uniform = torch.full((2, 4), 0.25)
    one_hot = torch.eye(4)[:2]
    torch.testing.assert_close(predictive_entropy(uniform), torch.full((2,), math.log(4)))
    assert torch.equal(predictive_entropy(one_hot), torch.zeros(2))  # 0 log 0 = 0, not NaN


def test_mutual_information_matches_a_direct_formula(problem):
    logits, _ = problem
    sample_probs = torch.softmax(logits, dim=-1)
    p = sample_probs.numpy()
    expected = _entropy_np(p.mean(axis=0)) - np.mean([_entropy_np(p[s]) for s in range(p.shape[0])], axis=0)
    got = mutual_information(sample_probs)
    assert got.shape == (logits.shape[1],)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-14)
    assert float(got.min()) >= 0 and float(got.max()) <= math.log(10)


def test_mutual_information_is_zero_for_identical_samples_and_maximal_for_disagreeing_ones():
    probs = torch.softmax(torch.randn(1, 5, 3), dim=-1).expand(4, 5, 3)
    assert float(mutual_information(probs).abs().max()) < 1e-15
    disagree = torch.eye(3)[:, None, :]  # three confident samples, each on a different class
    torch.testing.assert_close(mutual_information(disagree), torch.tensor([math.log(3)]))


def _ood_scores(seed, n_in=300, n_out=200, decimals=1):
    """Overlapping scores rounded to ``decimals`` so that many are tied, within and across the two groups."""
    g = torch.Generator().manual_seed(seed)
    scores_in = torch.round(torch.randn(n_in, generator=g), decimals=decimals)
    scores_out = torch.round(torch.randn(n_out, generator=g) + 0.7, decimals=decimals)
    return scores_in, scores_out


def _labels_and_scores(scores_in, scores_out):
    labels = np.r_[np.zeros(len(scores_in)), np.ones(len(scores_out))]  # OOD is the positive class
    return labels, np.r_[scores_in.numpy(), scores_out.numpy()]


@pytest.mark.parametrize("seed, decimals", [(0, 1), (1, 0), (2, 3), (3, 8)])
def test_auroc_and_aupr_match_sklearn_with_ties(seed, decimals):
    scores_in, scores_out = _ood_scores(seed, decimals=decimals)
    labels, scores = _labels_and_scores(scores_in, scores_out)
    if decimals <= 1:
        assert len(np.unique(scores)) < len(scores) / 5  # heavily tied
    assert abs(float(ood_auroc(scores_in, scores_out)) - roc_auc_score(labels, scores)) < 1e-12
    assert abs(float(ood_aupr(scores_in, scores_out)) - average_precision_score(labels, scores)) < 1e-12
    # a second, independent implementation
    target = torch.as_tensor(labels).long()
    preds = torch.sigmoid(torch.as_tensor(scores))  # torchmetrics wants [0, 1]; a monotone map keeps the ranking
    assert abs(float(ood_auroc(scores_in, scores_out)) - float(binary_auroc(preds, target))) < 1e-4
    assert abs(float(ood_aupr(scores_in, scores_out)) - float(binary_average_precision(preds, target))) < 1e-4


def test_auroc_direct_pair_count_and_edge_cases():
    scores_in = torch.tensor([0.1, 0.4, 0.4, 0.9])
    scores_out = torch.tensor([0.4, 0.95])
    # pairs (out > in) + 1/2 (tie): 0.4 beats 0.1 and ties twice -> 2; 0.95 beats all 4 -> 4; total 6 of 8
    assert float(ood_auroc(scores_in, scores_out)) == 6 / 8
    assert float(ood_auroc(torch.zeros(3), torch.ones(2))) == 1.0
    assert float(ood_auroc(torch.ones(3), torch.zeros(2))) == 0.0
    assert float(ood_auroc(torch.zeros(3), torch.zeros(2))) == 0.5
    assert float(ood_aupr(torch.zeros(3), torch.ones(2))) == 1.0
    assert float(ood_aupr(torch.zeros(3), torch.zeros(2))) == pytest.approx(2 / 5)  # all tied: the OOD fraction


def test_ood_report_sign_convention_and_values():
    # in-distribution inputs get confident predictions, OOD inputs flat ones: both scores must see it
    probs_in = bma_probs(make_problem(num_points=400, scale=1.0, seed=1)[0] * 3)
    probs_out = bma_probs(make_problem(num_points=300, scale=1.0, seed=2)[0] * 0.3)
    report = ood_report(probs_in, probs_out)
    assert set(report) == {"ood_auroc_maxprob", "ood_aupr_maxprob", "ood_auroc_entropy", "ood_aupr_entropy"}
    assert all(isinstance(v, float) for v in report.values())
    assert report["ood_auroc_maxprob"] > 0.9 and report["ood_auroc_entropy"] > 0.9
    score_in, score_out = -probs_in.max(dim=1).values, -probs_out.max(dim=1).values
    assert report["ood_auroc_maxprob"] == float(ood_auroc(score_in, score_out))
    assert report["ood_aupr_maxprob"] == float(ood_aupr(score_in, score_out))
    entropy_in, entropy_out = predictive_entropy(probs_in), predictive_entropy(probs_out)
    labels, scores = _labels_and_scores(entropy_in, entropy_out)
    assert abs(report["ood_auroc_entropy"] - roc_auc_score(labels, scores)) < 1e-12
    assert abs(report["ood_aupr_entropy"] - average_precision_score(labels, scores)) < 1e-12
    # swapping the roles gives 1 - AUROC: the convention is not symmetric
    assert ood_report(probs_out, probs_in)["ood_auroc_maxprob"] == pytest.approx(1 - report["ood_auroc_maxprob"])


def test_float32_scores_stay_float32():
    scores_in, scores_out = _ood_scores(0)
    assert ood_auroc(scores_in.float(), scores_out.float()).dtype == torch.float32
    assert ood_aupr(scores_in.float(), scores_out.float()).dtype == torch.float32


def test_validation_errors():
    scores = torch.tensor([0.1, 0.2])
    with pytest.raises(ValueError, match=r"`scores_in` must have shape \[N_in\], got shape \(2, 1\)"):
        ood_auroc(scores[:, None], scores)
    with pytest.raises(ValueError, match="`scores_out` must not be empty"):
        ood_aupr(scores, scores[:0])
    with pytest.raises(ValueError, match="`scores_out` must be finite"):
        ood_auroc(scores, torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="must share dtype and device"):
        ood_auroc(scores, scores.float())
    with pytest.raises(ValueError, match="`scores_in` must be a floating-point tensor"):
        ood_auroc(torch.tensor([1, 2]), scores)
    with pytest.raises(ValueError, match="same number of classes, got 2 and 3"):
        ood_report(torch.full((2, 2), 0.5), torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"`probs_out` must sum to 1"):
        ood_report(torch.full((2, 2), 0.5), torch.full((2, 2), 0.3))
    with pytest.raises(ValueError, match=r"`sample_probs` must have shape \[S, N, C\]"):
        mutual_information(torch.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="`sample_probs` must sum to 1"):
        mutual_information(torch.full((3, 2, 2), 0.4))
    with pytest.raises(ValueError, match=r"`probs` must hold probabilities in \[0, 1\]"):
        predictive_entropy(torch.tensor([[2.0, -1.0]]))
