r"""One call from posterior predictions to a report of accuracy, calibration and uncertainty metrics."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from .._validation import check_int
from ._checks import check_labels, check_probs
from .bma import StreamingBMA
from .calibration import accuracy, bma_nll, brier_score, expected_calibration_error
from .uncertainty import ood_report, predictive_entropy

Predictions = Tensor | StreamingBMA | Mapping[str, Tensor]


def _as_stream(logits: object) -> StreamingBMA:
    """A ``Predictive`` "logits" site ``[S, N, C]`` (singleton batch dims between S and N are squeezed)."""
    if isinstance(logits, Tensor) and logits.ndim > 3 and all(d == 1 for d in logits.shape[1:-2]):
        logits = logits.reshape(logits.shape[0], *logits.shape[-2:])
    if not isinstance(logits, Tensor) or logits.ndim != 3:
        shape = list(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"`predictions['logits']` must have shape [S, N, C], got {shape}")
    return StreamingBMA().update(logits)


def _resolve(predictions: object, name: str) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(probs [N, C], log_probs [N, C] or None, mean per-sample entropy [N] or None)``."""
    if isinstance(predictions, Mapping):
        if "logits" not in predictions:
            raise ValueError(
                f'`{name}` is a dict without a "logits" key (found keys: {sorted(map(str, predictions))}); record '
                'the network output in the model with pyro.deterministic("logits", f(x)) so that Predictive returns it'
            )
        predictions = _as_stream(predictions["logits"])
    if isinstance(predictions, StreamingBMA):
        if predictions.num_samples == 0:
            raise ValueError(f"`{name}` is a StreamingBMA without samples: call update(logits) first")
        return predictions.probs, predictions.log_probs, predictions.mean_entropy
    if isinstance(predictions, Tensor):
        if predictions.ndim != 2:
            raise ValueError(
                f"`{name}` as a tensor must be BMA probabilities of shape [N, C], got shape {list(predictions.shape)}; "
                'for per-sample logits [S, N, C] pass {"logits": logits}, a StreamingBMA or bma_probs(logits)'
            )
        return check_probs(predictions, name), None, None
    raise ValueError(
        f"`{name}` must be BMA probabilities [N, C], a StreamingBMA or a dict with a 'logits' entry [S, N, C] "
        f"(pyro.infer.Predictive output), got {type(predictions).__name__}"
    )


def evaluate(
    predictions: Predictions,
    y: Tensor,
    *,
    ood_predictions: Predictions | None = None,
    num_bins: int = 15,
) -> dict[str, float]:
    r"""Accuracy, calibration and uncertainty metrics of a BMA predictive, as a dict of Python floats.

    ``predictions`` (and ``ood_predictions``) may be any of

    * a tensor ``[N, C]`` of **BMA probabilities** :math:`\bar p` (rows sum to one);
    * a :class:`~pyro_flat.metrics.StreamingBMA` that has seen the samples' logits;
    * the output dict of :class:`pyro.infer.Predictive` holding a ``"logits"`` site of shape ``[S, N, C]`` — the
      model must record it, e.g. ``pyro.deterministic("logits", net(x))``. Singleton dimensions between
      :math:`S` and :math:`N` (from plates) are squeezed. Other keys are ignored.

    The BMA is formed *first* (in log space for samples), then each metric is computed on it. Keys:

    * ``"acc"`` — :func:`~pyro_flat.metrics.accuracy`;
    * ``"nll"`` — :math:`-\frac1N\sum_i\log\bar p(y_i\mid x_i)` (:func:`~pyro_flat.metrics.bma_nll`; from
      :math:`\log\bar p` directly when samples are given, so no clamp is needed);
    * ``"ece"`` — :func:`~pyro_flat.metrics.expected_calibration_error` with ``num_bins`` equal-width bins;
    * ``"brier"`` — :func:`~pyro_flat.metrics.brier_score` (multiclass, in [0, 2]);
    * ``"predictive_entropy"`` — mean over inputs of :math:`H[\bar p_n]`;
    * ``"mutual_information"`` — mean over inputs of :math:`H[\bar p_n]-\frac1S\sum_sH[p_{sn}]`; only when samples
      are available (a ``StreamingBMA`` or ``Predictive`` output), absent for a probability tensor;
    * with ``ood_predictions``: ``"ood_auroc_maxprob"``, ``"ood_aupr_maxprob"``, ``"ood_auroc_entropy"``,
      ``"ood_aupr_entropy"`` (:func:`~pyro_flat.metrics.ood_report`; OOD is the positive class).

    :param predictions: the in-distribution predictions, one of the forms above, on :math:`N` inputs.
    :param y: labels, int64 of shape ``[N]``, on the predictions' device.
    :param ood_predictions: optional predictions on OOD inputs, any form above, with the same :math:`C`.
    :param int num_bins: ECE bins, default 15 (see :func:`~pyro_flat.metrics.expected_calibration_error`).
    :returns: ``dict[str, float]``.
    """
    num_bins = check_int(num_bins, "num_bins")
    probs, log_probs, mean_entropy = _resolve(predictions, "predictions")
    y = check_labels(y, probs.shape[0], probs.shape[1], probs)
    if log_probs is None:
        nll = bma_nll(probs, y)
    else:
        nll = -log_probs.gather(1, y[:, None]).mean()
    entropy = predictive_entropy(probs)
    report = {
        "acc": float(accuracy(probs, y)),
        "nll": float(nll),
        "ece": float(expected_calibration_error(probs, y, num_bins)),
        "brier": float(brier_score(probs, y)),
        "predictive_entropy": float(entropy.mean()),
    }
    if mean_entropy is not None:
        report["mutual_information"] = float((entropy - mean_entropy).clamp_min(0).mean())
    if ood_predictions is not None:
        probs_out = _resolve(ood_predictions, "ood_predictions")[0]
        if probs_out.shape[1] != probs.shape[1]:
            raise ValueError(
                f"`ood_predictions` has {probs_out.shape[1]} classes but `predictions` has {probs.shape[1]}"
            )
        report.update(ood_report(probs, probs_out))
    return report


__all__ = ["Predictions", "evaluate"]
