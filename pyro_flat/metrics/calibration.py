r"""Accuracy and calibration of a Bayesian-model-average (BMA) predictive.

Notation: :math:`N` inputs, :math:`C` classes, labels :math:`y_i\in\{0,\dots,C-1\}` and the BMA predictive
:math:`\bar p_{ic}=\bar p(y=c\mid x_i)=\frac1S\sum_s p_s(y=c\mid x_i)` over :math:`S` posterior samples (see
:func:`pyro_flat.metrics.bma_probs`). Every function takes ``probs`` = :math:`\bar p` of shape ``[N, C]`` and
``y`` of shape ``[N]`` (int64) and returns tensors on the input's device and dtype.

**BMA first, metric second.** Pass the probabilities *of the average*, never average a metric over samples: by
Jensen's inequality the NLL of the BMA is at most the mean NLL of the members, and the gap is large (with
:math:`S=8`, :math:`C=10`, logits :math:`2\,\mathcal N(0,1)` and random labels: 2.49 against 3.76).

Input checks raise ``ValueError``: shapes, NaN/Inf, probabilities outside [0, 1] or rows not summing to one within
:math:`\max(10^{-6},\sqrt{\varepsilon_{\text{dtype}}})`, labels out of range, mismatched lengths, ``num_bins < 1``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import check_int
from ._checks import check_labels, check_probs


def _check(probs: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    probs = check_probs(probs)
    return probs, check_labels(y, probs.shape[0], probs.shape[1], probs)


def accuracy(probs: Tensor, y: Tensor) -> Tensor:
    r"""Top-1 accuracy :math:`\frac1N\sum_i\mathbb 1[\arg\max_c\bar p_{ic}=y_i]`.

    Ties in :math:`\arg\max` go to the lowest class index (:func:`torch.argmax`).

    :param probs: BMA probabilities :math:`\bar p`, shape ``[N, C]``.
    :param y: labels, int64 of shape ``[N]``.
    :returns: a 0-d tensor in [0, 1].
    """
    probs, y = _check(probs, y)
    return (probs.argmax(dim=1) == y).to(probs.dtype).mean()


def bma_nll(probs: Tensor, y: Tensor) -> Tensor:
    r"""Negative log-likelihood of the BMA, :math:`-\frac1N\sum_i\log\bar p_{iy_i}` — the log *of the mean*.

    To keep a probability of exactly 0 (an underflow) finite, :math:`\bar p_{iy_i}` is clamped from below at the
    smallest positive normal number of the dtype (``torch.finfo(dtype).tiny``: :math:`\log` = −708 in float64,
    −87 in float32), which changes nothing else. scikit-learn's ``log_loss`` instead clips at the machine epsilon
    (−36 in float64), so the two differ only when some :math:`\bar p_{iy_i}<\varepsilon`. When log-probabilities
    are available (:class:`~pyro_flat.metrics.StreamingBMA`, :func:`~pyro_flat.metrics.bma_log_probs`), NLL from them
    needs no clamp; :func:`~pyro_flat.metrics.evaluate` does that.

    :param probs: BMA probabilities :math:`\bar p`, shape ``[N, C]``.
    :param y: labels, int64 of shape ``[N]``.
    :returns: a 0-d tensor :math:`\ge0`.
    """
    probs, y = _check(probs, y)
    p_true = probs.gather(1, y[:, None]).squeeze(1)
    return -p_true.clamp_min(torch.finfo(probs.dtype).tiny).log().mean()


def reliability_bins(probs: Tensor, y: Tensor, num_bins: int = 15) -> dict[str, Tensor]:
    r"""Bin the top-label confidences :math:`\hat c_i=\max_c\bar p_{ic}` into ``num_bins`` equal-width bins.

    The bins are :math:`B_1=[0,1/M]` and :math:`B_b=((b-1)/M,\,b/M]` for :math:`b=2..M` (:math:`M` = ``num_bins``):
    closed on the right, as in the reference code of Guo et al. [1], so a confidence of exactly 1.0 (common in
    float32) falls in the last bin. (torchmetrics' bins are closed on the left and put 1.0 in an extra bin; the two
    agree unless a confidence lies exactly on an edge.)

    :param probs: BMA probabilities :math:`\bar p`, shape ``[N, C]``.
    :param y: labels, int64 of shape ``[N]``.
    :param int num_bins: number of bins :math:`M\ge1`, default 15 (see :func:`expected_calibration_error`).
    :returns: a dict of tensors: ``"edges"`` ``[M+1]`` (:math:`0,1/M,\dots,1`), ``"counts"`` ``[M]`` (int64,
        :math:`n_b=|B_b|`), ``"accuracy"`` ``[M]`` (:math:`\mathrm{acc}_b`, the fraction of points of the bin
        whose top class is right) and ``"confidence"`` ``[M]`` (:math:`\mathrm{conf}_b`, their mean
        :math:`\hat c_i`); accuracy and confidence are 0 for empty bins.

    [1] `On Calibration of Modern Neural Networks`, Chuan Guo, Geoff Pleiss, Yu Sun, Kilian Q. Weinberger
    (ICML 2017), arXiv:1706.04599
    """
    probs, y = _check(probs, y)
    num_bins = check_int(num_bins, "num_bins")
    confidence, prediction = probs.max(dim=1)
    correct = (prediction == y).to(probs.dtype)
    edges = torch.linspace(0, 1, num_bins + 1, dtype=probs.dtype, device=probs.device)
    # bucketize(right=False) gives i with edges[i-1] < c <= edges[i]; c = 0 gives 0, mapped to the first bin
    index = (torch.bucketize(confidence, edges, right=False) - 1).clamp_(0, num_bins - 1)
    counts = torch.bincount(index, minlength=num_bins)
    sum_correct = torch.zeros(num_bins, dtype=probs.dtype, device=probs.device).index_add_(0, index, correct)
    sum_conf = torch.zeros(num_bins, dtype=probs.dtype, device=probs.device).index_add_(0, index, confidence)
    denominator = counts.clamp_min(1).to(probs.dtype)
    return {
        "edges": edges,
        "counts": counts,
        "accuracy": sum_correct / denominator,
        "confidence": sum_conf / denominator,
    }


def expected_calibration_error(probs: Tensor, y: Tensor, num_bins: int = 15) -> Tensor:
    r"""Top-label expected calibration error with the L1 norm and equal-width bins on [0, 1].

    .. math:: \mathrm{ECE}=\sum_{b=1}^{M}\frac{n_b}{N}\,\big|\mathrm{acc}_b-\mathrm{conf}_b\big|,

    where the bins :math:`B_b` split [0, 1] into :math:`M` = ``num_bins`` intervals of width :math:`1/M` (closed on
    the right; see :func:`reliability_bins`), :math:`n_b` is the number of points whose confidence
    :math:`\hat c_i=\max_c\bar p_{ic}` lies in :math:`B_b`, :math:`\mathrm{acc}_b` the fraction of them with
    :math:`\arg\max_c\bar p_{ic}=y_i` and :math:`\mathrm{conf}_b` their mean confidence. Empty bins contribute 0.
    This equals torchmetrics' ``multiclass_calibration_error(probs, y, num_classes=C, n_bins=M, norm="l1")``
    unless a confidence lies exactly on a bin edge.

    **The binning is a choice, and papers differ:** F-BNN (Nguyen et al., 2023) and bSAM (Möllenhoff & Khan, 2023)
    use 20 equal-width bins, SA-BMA (Lim et al., 2024) 15 equal-width bins and Entropy-MCMC (Li & Zhang, 2024) 10
    equal-*mass* bins. ECE is biased and its value depends on the bins, so numbers are **not comparable across
    papers**; compare methods only under one setting, and state it.

    :param probs: BMA probabilities :math:`\bar p`, shape ``[N, C]``.
    :param y: labels, int64 of shape ``[N]``.
    :param int num_bins: :math:`M\ge1`, default 15: the common default (Guo et al. 2017, torchmetrics, SA-BMA).
    :returns: a 0-d tensor in [0, 1].
    """
    bins = reliability_bins(probs, y, num_bins)
    weights = bins["counts"].to(bins["accuracy"].dtype) / bins["counts"].sum()
    return (weights * (bins["accuracy"] - bins["confidence"]).abs()).sum()


def brier_score(probs: Tensor, y: Tensor) -> Tensor:
    r"""Multiclass Brier score :math:`\frac1N\sum_{i=1}^N\sum_{c=1}^C(\bar p_{ic}-\mathbb 1[y_i=c])^2`, in [0, 2].

    Summed over classes, averaged over points (Brier 1950). For :math:`C=2` this is twice the usual binary Brier
    score :math:`\frac1N\sum_i(\bar p_{i1}-y_i)^2`: scikit-learn's ``brier_score_loss`` halves the binary case
    (``scale_by_half="auto"``, also for 2-column input) and keeps [0, 2] from :math:`C\ge3`; ours equals
    ``brier_score_loss(y, probs, labels=range(C), scale_by_half=False)`` for every :math:`C`.

    :param probs: BMA probabilities :math:`\bar p`, shape ``[N, C]``.
    :param y: labels, int64 of shape ``[N]``.
    :returns: a 0-d tensor in [0, 2].
    """
    probs, y = _check(probs, y)
    one_hot = torch.nn.functional.one_hot(y, probs.shape[1]).to(probs.dtype)
    return (probs - one_hot).square().sum(dim=1).mean()


__all__ = ["accuracy", "bma_nll", "brier_score", "expected_calibration_error", "reliability_bins"]
