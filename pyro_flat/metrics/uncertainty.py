r"""Predictive uncertainty and out-of-distribution (OOD) detection.

Notation: :math:`S` posterior samples, :math:`N` inputs, :math:`C` classes; :math:`p_{snc}` the predictive of
sample :math:`s` and :math:`\bar p_{nc}=\frac1S\sum_sp_{snc}` the BMA predictive; entropies in nats,
:math:`H[p]=-\sum_cp_c\log p_c` with :math:`0\log0=0`.

**OOD convention** (as torch-uncertainty and the OOD literature): OOD inputs are the **positive** class (label 1),
in-distribution inputs the negative class (label 0), and a score is an *uncertainty*: higher means "more likely
OOD". With a wrong sign AUROC becomes :math:`1-\text{AUROC}`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_float, check_probs


def _entropy(probs: Tensor) -> Tensor:
    return -torch.special.xlogy(probs, probs).sum(dim=-1)


def predictive_entropy(probs: Tensor) -> Tensor:
    r"""Entropy of the BMA predictive per input, :math:`H[\bar p_n]=-\sum_c\bar p_{nc}\log\bar p_{nc}`.

    It measures total uncertainty (aleatoric + epistemic), :math:`0\le H\le\log C`.

    :param probs: BMA probabilities :math:`\bar p`, shape ``[N, C]``.
    :returns: the entropies, shape ``[N]``, in nats.
    """
    return _entropy(check_probs(probs))


def mutual_information(sample_probs: Tensor) -> Tensor:
    r"""Mutual information between the label and the parameters per input (the BALD score, epistemic uncertainty).

    .. math:: I_n=H[\bar p_n]-\frac1S\sum_{s=1}^SH[p_{sn}],\qquad \bar p_n=\frac1S\sum_sp_{sn}.

    :math:`0\le I_n\le\log C` by concavity of :math:`H`; negative rounding errors are clamped to 0.

    :param sample_probs: per-sample probabilities :math:`p_{snc}`, shape ``[S, N, C]``; each row sums to one.
    :returns: shape ``[N]``, in nats.
    """
    sample_probs = check_probs(sample_probs, "sample_probs", 3, "[S, N, C]")
    return (_entropy(sample_probs.mean(dim=0)) - _entropy(sample_probs).mean(dim=0)).clamp_min(0)


def _check_scores(scores_in: Tensor, scores_out: Tensor) -> tuple[Tensor, Tensor]:
    scores_in = check_float(scores_in, "scores_in", 1, "[N_in]")
    scores_out = check_float(scores_out, "scores_out", 1, "[N_out]")
    if scores_in.device != scores_out.device or scores_in.dtype != scores_out.dtype:
        raise ValueError(
            f"`scores_in` ({scores_in.dtype} on {scores_in.device}) and `scores_out` ({scores_out.dtype} on "
            f"{scores_out.device}) must share dtype and device"
        )
    return scores_in, scores_out


def ood_auroc(scores_in: Tensor, scores_out: Tensor) -> Tensor:
    r"""Area under the ROC curve for detecting OOD inputs (positive class) by a score (higher = more uncertain).

    Computed exactly as the Mann–Whitney statistic with mid-ranks for ties:

    .. math:: \mathrm{AUROC}=\frac{1}{n_\text{in}n_\text{out}}\sum_{j\in\text{out}}\Big(\#\{i\in\text{in}:
        s_i<s_j\}+\tfrac12\#\{i\in\text{in}:s_i=s_j\}\Big)=\frac{R_\text{out}-n_\text{out}(n_\text{out}+1)/2}
        {n_\text{in}n_\text{out}},

    where :math:`R_\text{out}` is the sum of the mid-ranks of the OOD scores in the pooled sample. The counts come
    from binary searches in the sorted in-distribution scores and are summed as integers, so the result is exact
    up to one final division; cost :math:`O((n_\text{in}+n_\text{out})\log n_\text{in})`. It equals scikit-learn's
    ``roc_auc_score`` with OOD labelled 1 (which interpolates ties linearly, the same thing). 0.5 is chance, 1
    perfect separation.

    :param scores_in: scores of in-distribution inputs, shape ``[N_in]``, finite.
    :param scores_out: scores of OOD inputs, shape ``[N_out]``, finite, same dtype and device.
    :returns: a 0-d tensor in [0, 1].
    """
    scores_in, scores_out = _check_scores(scores_in, scores_out)
    sorted_in = scores_in.sort().values
    below = torch.searchsorted(sorted_in, scores_out, right=False)  # #{in < s_j}
    below_or_tied = torch.searchsorted(sorted_in, scores_out, right=True)  # #{in <= s_j}
    twice_u = (below + below_or_tied).sum()  # int64: exact
    return twice_u.to(scores_in.dtype) / (2 * scores_in.numel() * scores_out.numel())


def ood_aupr(scores_in: Tensor, scores_out: Tensor) -> Tensor:
    r"""Area under the precision–recall curve with OOD as the positive class ("AUPR-Out"), as average precision.

    Step-wise average precision over the distinct score thresholds :math:`t_1>t_2>\dots` (ties form one step):

    .. math:: \mathrm{AP}=\sum_k(R_k-R_{k-1})\,P_k,\qquad P_k=\frac{\mathrm{TP}_k}{\mathrm{TP}_k+\mathrm{FP}_k},\quad
        R_k=\frac{\mathrm{TP}_k}{n_\text{out}},\quad R_0=0,

    with :math:`\mathrm{TP}_k,\mathrm{FP}_k` the numbers of OOD and in-distribution scores :math:`\ge t_k`. This is
    scikit-learn's ``average_precision_score`` (no trapezoidal interpolation, which would be optimistic). Chance
    level is the OOD fraction :math:`n_\text{out}/(n_\text{in}+n_\text{out})`.

    :param scores_in: scores of in-distribution inputs, shape ``[N_in]``, finite.
    :param scores_out: scores of OOD inputs, shape ``[N_out]``, finite, same dtype and device.
    :returns: a 0-d tensor in [0, 1].
    """
    scores_in, scores_out = _check_scores(scores_in, scores_out)
    scores = torch.cat([scores_in, scores_out])
    is_out = torch.cat([torch.zeros_like(scores_in, dtype=torch.long), torch.ones_like(scores_out, dtype=torch.long)])
    scores, order = scores.sort(descending=True)
    true_pos = is_out[order].cumsum(0)
    # the last position of each group of tied scores is where a threshold t_k = score takes effect
    last = torch.ones_like(scores, dtype=torch.bool)
    last[:-1] = scores[:-1] != scores[1:]
    true_pos = true_pos[last]
    predicted_pos = torch.arange(1, scores.numel() + 1, device=scores.device)[last]
    precision = true_pos.to(scores.dtype) / predicted_pos.to(scores.dtype)
    recall_step = torch.diff(true_pos, prepend=true_pos.new_zeros(1)).to(scores.dtype) / scores_out.numel()
    return (recall_step * precision).sum()


def ood_report(probs_in: Tensor, probs_out: Tensor) -> dict[str, float]:
    r"""OOD detection by two uncertainty scores of the BMA predictive, as Python floats.

    Scores (higher = more uncertain): the negative maximum probability :math:`-\max_c\bar p_{nc}` (the
    maximum-softmax-probability baseline of Hendrycks & Gimpel, 2017) and the predictive entropy
    :math:`H[\bar p_n]`. OOD inputs are the positive class.

    :param probs_in: BMA probabilities on in-distribution inputs, shape ``[N_in, C]``.
    :param probs_out: BMA probabilities on OOD inputs, shape ``[N_out, C]``, same :math:`C`.
    :returns: ``{"ood_auroc_maxprob", "ood_aupr_maxprob", "ood_auroc_entropy", "ood_aupr_entropy"}`` (see
        :func:`ood_auroc`, :func:`ood_aupr`).
    """
    probs_in = check_probs(probs_in, "probs_in", 2, "[N_in, C]")
    probs_out = check_probs(probs_out, "probs_out", 2, "[N_out, C]")
    if probs_in.shape[1] != probs_out.shape[1]:
        raise ValueError(
            f"`probs_in` and `probs_out` must have the same number of classes, got {probs_in.shape[1]} and "
            f"{probs_out.shape[1]}"
        )
    report = {}
    scores = {
        "maxprob": (-probs_in.max(dim=1).values, -probs_out.max(dim=1).values),
        "entropy": (_entropy(probs_in), _entropy(probs_out)),
    }
    for name, (score_in, score_out) in scores.items():
        report[f"ood_auroc_{name}"] = float(ood_auroc(score_in, score_out))
        report[f"ood_aupr_{name}"] = float(ood_aupr(score_in, score_out))
    return report


__all__ = ["mutual_information", "ood_aupr", "ood_auroc", "ood_report", "predictive_entropy"]
