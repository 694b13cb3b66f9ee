r"""The Bayesian model average (BMA) of classifier outputs, in one shot or streamed over posterior samples.

For :math:`S` posterior samples :math:`\theta_s` with logits :math:`f_s(x)\in\mathbb R^C`, the BMA predictive is

.. math:: \bar p(y\mid x)=\frac1S\sum_{s=1}^S\operatorname{softmax}(f_s(x))_y,\qquad
    \log\bar p(y\mid x)=\operatorname{logsumexp}_s\big(\log\operatorname{softmax}(f_s(x))_y\big)-\log S,

computed in log space: averaging softmax outputs and then taking the log underflows to :math:`-\infty` for confident
samples, the logsumexp form does not.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_float


def _check_sample_logits(sample_logits: Tensor, name: str = "sample_logits") -> Tensor:
    return check_float(sample_logits, name, 3, "[S, N, C]")


def bma_log_probs(sample_logits: Tensor) -> Tensor:
    r"""Log of the BMA predictive, :math:`\operatorname{logsumexp}_s\log\operatorname{softmax}(f_s)-\log S`.

    :param sample_logits: logits :math:`f_s(x_n)_c`, shape ``[S, N, C]``, finite.
    :returns: :math:`\log\bar p`, shape ``[N, C]``, on the input's device and dtype.
    """
    sample_logits = _check_sample_logits(sample_logits)
    log_probs = torch.log_softmax(sample_logits, dim=-1)
    return torch.logsumexp(log_probs, dim=0) - math.log(sample_logits.shape[0])


def bma_probs(sample_logits: Tensor) -> Tensor:
    r"""The BMA predictive :math:`\bar p_{nc}=\frac1S\sum_s\operatorname{softmax}(f_s(x_n))_c`, from logits.

    Computed as ``exp(bma_log_probs(sample_logits))`` (see :func:`bma_log_probs`).

    :param sample_logits: logits, shape ``[S, N, C]``, finite.
    :returns: probabilities, shape ``[N, C]``; rows sum to one.
    """
    return bma_log_probs(sample_logits).exp()


class StreamingBMA:
    r"""Accumulates the BMA predictive over posterior samples fed one or a few at a time, in :math:`O(NC)` memory.

    After samples :math:`f_1,\dots,f_S` have been passed to :meth:`update` (in any grouping), it holds

    * the running :math:`\operatorname{logsumexp}_s\log\operatorname{softmax}(f_s)` (``[N, C]``), combined with
      :func:`torch.logaddexp`, so :attr:`log_probs` :math:`=\log\bar p` is exact and stable for any logit scale;
    * the running sum of per-sample entropies :math:`\sum_sH[p_s]` (``[N]``), for :attr:`mean_entropy` and the
      :attr:`mutual_information` :math:`H[\bar p]-\frac1S\sum_sH[p_s]`,

    and nothing else, whatever :math:`S`. Logits are detached; the state keeps the dtype and device of the first
    update (later updates must match, so a float32 stream never silently upcasts).

    :meth:`update` makes no host synchronisation: whether the logits are finite is recorded on their device, and a
    NaN or infinite logit raises a ``ValueError`` (naming the first such update) when the results are read.

    Example::

        bma = StreamingBMA()
        for theta in posterior_samples:               # e.g. MCMC draws or guide samples
            bma.update(net(x_test, theta))            # [N, C] logits (or [s, N, C])
        report = pyro_flat.metrics.evaluate(bma, y_test)
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget all samples."""
        self._num_samples = 0
        self._log_sum_probs: Tensor | None = None  # logsumexp_s log softmax(f_s), [N, C]
        self._sum_entropy: Tensor | None = None  # sum_s H[p_s], [N]
        self._num_updates = 0
        self._first_nonfinite: Tensor | None = None  # index of the first update with a non-finite logit, or -1

    @torch.no_grad()
    def update(self, logits: Tensor) -> StreamingBMA:
        r"""Add one sample's logits ``[N, C]`` or several samples' logits ``[s, N, C]``.

        :returns: ``self``, so calls can be chained.
        """
        if isinstance(logits, Tensor) and logits.ndim == 2:
            logits = logits.unsqueeze(0)
        logits = check_float(logits, "logits", 3, "[N, C] or [s, N, C]", finite=False).detach()
        if self._log_sum_probs is not None:
            expected = self._log_sum_probs
            if logits.shape[1:] != expected.shape:
                raise ValueError(
                    f"`logits` must have shape [N, C] = {list(expected.shape)} (or [s, N, C]) like the previous "
                    f"updates, got {list(logits.shape)}"
                )
            if logits.dtype != expected.dtype or logits.device != expected.device:
                raise ValueError(
                    f"`logits` must be {expected.dtype} on {expected.device} like the previous updates, got "
                    f"{logits.dtype} on {logits.device}"
                )
        log_probs = torch.log_softmax(logits, dim=-1)
        log_sum = torch.logsumexp(log_probs, dim=0)
        sum_entropy = -(log_probs.exp() * log_probs).sum(dim=(0, 2))
        finite = torch.isfinite(logits).all()
        if self._first_nonfinite is None:
            self._first_nonfinite = torch.full((), -1, dtype=torch.int64, device=logits.device)
        self._first_nonfinite = torch.where(~finite & (self._first_nonfinite < 0), self._num_updates,
                                            self._first_nonfinite)
        self._num_updates += 1
        if self._log_sum_probs is None:
            self._log_sum_probs, self._sum_entropy = log_sum, sum_entropy
        else:
            self._log_sum_probs = torch.logaddexp(self._log_sum_probs, log_sum)
            self._sum_entropy = self._sum_entropy + sum_entropy
        self._num_samples += logits.shape[0]
        return self

    def _require_samples(self) -> None:
        if self._num_samples == 0:
            raise ValueError("StreamingBMA holds no samples yet: call update(logits) first")
        first = int(self._first_nonfinite)
        if first >= 0:
            raise ValueError(
                f"`logits` must be finite: update {first} (counted from 0) had NaN or Inf values, so the average is "
                "undefined; call reset() and check the model or the posterior draws"
            )

    @property
    def num_samples(self) -> int:
        """:math:`S`, the number of samples seen so far."""
        return self._num_samples

    @property
    def log_probs(self) -> Tensor:
        r""":math:`\log\bar p`, shape ``[N, C]``."""
        self._require_samples()
        return self._log_sum_probs - math.log(self._num_samples)

    @property
    def probs(self) -> Tensor:
        r""":math:`\bar p`, shape ``[N, C]``."""
        return self.log_probs.exp()

    @property
    def predictive_entropy(self) -> Tensor:
        r""":math:`H[\bar p_n]`, shape ``[N]``."""
        log_probs = self.log_probs
        return -(log_probs.exp() * log_probs).sum(dim=-1)

    @property
    def mean_entropy(self) -> Tensor:
        r""":math:`\frac1S\sum_sH[p_{sn}]`, shape ``[N]`` (the expected entropy, aleatoric uncertainty)."""
        self._require_samples()
        return self._sum_entropy / self._num_samples

    @property
    def mutual_information(self) -> Tensor:
        r""":math:`H[\bar p_n]-\frac1S\sum_sH[p_{sn}]`, shape ``[N]``, clamped at 0 (see
        :func:`~pyro_flat.metrics.mutual_information`)."""
        return (self.predictive_entropy - self.mean_entropy).clamp_min(0)


__all__ = ["StreamingBMA", "bma_log_probs", "bma_probs"]
