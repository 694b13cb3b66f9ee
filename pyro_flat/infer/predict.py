r"""Bayesian model averaging over posterior draws, streamed so that the draws need not sit in memory.

The BMA predictive of a classifier is

.. math:: \bar p(y\mid x) = \frac1S \sum_{s=1}^S p(y \mid x, \theta_s),\qquad \theta_s \sim q(\theta),

where the draws :math:`\theta_s` come from a guide, from MCMC samples (``mcmc.get_samples()``), from the members
of an ensemble, or from any iterator of ``{site name: value}`` dicts. :func:`bma_predict` runs the model once per
draw with its latent sites fixed (``poutine.condition``) and feeds the logits to a
:class:`~pyro_flat.metrics.StreamingBMA`, which keeps :math:`O(NC)` memory whatever :math:`S` is. This is the
memory-bounded counterpart of ``Predictive(model, guide=guide, num_samples=S)(x)["logits"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from pyro import poutine
from torch import Tensor, nn

from ..metrics import StreamingBMA
from ..nn.batchnorm import has_batchnorm, refresh_batchnorm
from ..runtime.sites import latent_sites

Draw = Mapping[str, Tensor]


def guide_draws(guide: Callable, num_samples: int, *args: object, **kwargs: object) -> Iterator[dict[str, Tensor]]:
    """``num_samples`` independent draws of the guide's latent values (detached), one dict per draw.

    ``args``/``kwargs`` are passed to the guide (autoguides only use them to set up plates).
    """
    if not (isinstance(num_samples, int) and num_samples > 0):
        raise ValueError(f"`num_samples` must be a positive int, got {num_samples!r}")
    for _ in range(num_samples):
        with torch.no_grad():
            trace = poutine.trace(guide).get_trace(*args, **kwargs)
        yield {k: v.detach() for k, v in latent_sites(trace).items()}


def sample_draws(samples: Mapping[str, Tensor], num_samples: int | None = None) -> Iterator[dict[str, Tensor]]:
    """Iterate over stacked posterior samples ``{site: [S, ...]}`` (e.g. ``mcmc.get_samples()``), one dict per draw.

    :param num_samples: use only this many draws, evenly spaced over the ``S`` available (default: all).
    """
    if not samples:
        raise ValueError("`samples` is empty: expected a dict {site name: tensor [num_samples, ...]}")
    sizes = {k: v.shape[0] for k, v in samples.items()}
    total = next(iter(sizes.values()))
    if any(s != total for s in sizes.values()):
        raise ValueError(f"all sites of `samples` must have the same number of draws, got {sizes}")
    if num_samples is None:
        index = range(total)
    elif isinstance(num_samples, int) and 0 < num_samples <= total:
        index = torch.linspace(0, total - 1, num_samples).round().long().tolist()
    else:
        raise ValueError(f"`num_samples` must be an int in [1, {total}], got {num_samples!r}")
    for i in index:
        yield {k: v[i] for k, v in samples.items()}


def predict_logits(
    model: nn.Module,
    draw: Draw,
    x: Tensor,
    *,
    batch_size: int | None = None,
) -> Tensor:
    """The model's logits on ``x`` with its latent sites fixed to ``draw`` (no gradient), batched over ``x``."""
    batches = [x] if batch_size is None else torch.split(x, batch_size)
    conditioned = poutine.condition(model, data=dict(draw))
    with torch.no_grad():
        return torch.cat([conditioned(xb) for xb in batches])


def set_prediction_mode(model: nn.Module, *, mc_dropout: bool = False) -> None:
    """Eval mode for prediction (BatchNorm uses its running statistics); with ``mc_dropout`` the dropout layers stay
    active, as in MC-Dropout [1].

    [1] `Dropout as a Bayesian Approximation`, Yarin Gal, Zoubin Ghahramani (ICML 2016), arXiv:1506.02142
    """
    model.eval()
    if mc_dropout:
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.train()


def bma_predict(
    model: nn.Module,
    draws: Iterable[Draw],
    x: Tensor | Mapping[str, Tensor],
    *,
    batch_size: int | None = None,
    mc_dropout: bool = False,
    batchnorm_inputs: Tensor | Iterable | None = None,
    accumulator: StreamingBMA | None = None,
) -> StreamingBMA:
    r"""Stream the Bayesian model average of ``model`` over ``draws`` on inputs ``x``.

    :param model: a classifier Pyro model, e.g. :class:`~pyro_flat.nn.BayesianMLP`.
    :param draws: an iterable of latent-value dicts (:func:`guide_draws`, :func:`sample_draws`, ensemble members).
    :param x: inputs ``[N, ...]`` on the model's device, or a dict of several input sets (e.g. ``{"test": x_test,
        "ood": x_ood}``) that are then predicted with the *same* draws.
    :param batch_size: evaluate ``x`` in chunks of this size (default: all at once).
    :param mc_dropout: keep dropout active at prediction time (MC-Dropout); otherwise the model is put in eval mode.
    :param batchnorm_inputs: training inputs used to recompute BatchNorm statistics for every draw (required when the
        model has BatchNorm layers, since a draw changes the activations).
    :param accumulator: continue an existing accumulator (default: a new one; only for a single input set).
    :returns: the :class:`~pyro_flat.metrics.StreamingBMA` holding :math:`\log\bar p` (a dict of them, keyed like
        ``x``, when ``x`` is a dict).
    """
    if has_batchnorm(model) and batchnorm_inputs is None:
        raise ValueError(
            "the model has BatchNorm layers: pass `batchnorm_inputs` (training inputs) so that their statistics are "
            "recomputed for every posterior draw"
        )
    inputs = dict(x) if isinstance(x, Mapping) else {"x": x}
    if accumulator is not None and len(inputs) > 1:
        raise ValueError("`accumulator` can only be given with a single input tensor `x`")
    accs = {name: StreamingBMA() for name in inputs} if accumulator is None else {"x": accumulator}
    was_training = model.training
    try:
        for draw in draws:
            if batchnorm_inputs is not None:
                refresh_batchnorm(model, draw, batchnorm_inputs)
            set_prediction_mode(model, mc_dropout=mc_dropout)
            for name, xs in inputs.items():
                accs[name].update(predict_logits(model, draw, xs, batch_size=batch_size))
    finally:
        model.train(was_training)
    if any(acc.num_samples == 0 for acc in accs.values()):
        raise ValueError("`draws` was empty: nothing to average")
    return accs if isinstance(x, Mapping) else accs["x"]
