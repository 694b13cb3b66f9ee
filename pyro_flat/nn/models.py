r"""Bayesian networks as Pyro models: a likelihood around a network made Bayesian by :func:`make_bayesian`.

Every model here is a :class:`~pyro.nn.PyroModule` whose ``forward`` is a Pyro model

.. math:: \theta \sim p(\theta),\qquad y_i \mid x_i, \theta \sim p(y_i \mid f_\theta(x_i)),\quad i \in \mathcal B,

with the log-likelihood of the minibatch :math:`\mathcal B` scaled by :math:`N/|\mathcal B|` through
``pyro.plate("data", N, ...)``, so that SVI and SG-MCMC target the full-data posterior. The minibatch reaches the
model in one of two ways:

* **in-model subsampling** — pass the whole training set and ``subsample_size=B``: the plate draws ``B`` indices
  each call (the ``"data"`` site of the trace), and replaying a trace replays the same minibatch;
* **external minibatches** — pass a minibatch from a ``DataLoader`` and ``num_data=N``.

Per-example outputs are recorded as the deterministic site ``"logits"`` (classification) or ``"loc"``/``"scale"``
(regression) so that :class:`~pyro.infer.Predictive` returns them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from torch import Tensor, nn

from .._validation import check_int
from .bayesian import make_bayesian


def _minibatch(
    x: Tensor, y: Tensor | None, subsample_size: int | None, num_data: int | None
) -> tuple[pyro.plate, Tensor, Tensor | None]:
    """The data plate of a likelihood and the (sub)batch it scores: ``x`` and ``y`` indexed by the plate's subsample
    when the model draws its own minibatch (``subsample_size``); a batch given from outside (``num_data``) or the
    whole data as they are."""
    if y is not None and (not isinstance(y, Tensor) or y.shape != x.shape[:1]):
        raise ValueError(f"`y` must be a tensor of shape [{len(x)}], got {getattr(y, 'shape', y)!r}")
    plate = _data_plate(x, subsample_size, num_data)
    if subsample_size is not None:
        with plate as idx:
            x = x[idx]
            y = None if y is None else y[idx]
    return plate, x, y


def _data_plate(x: Tensor, subsample_size: int | None, num_data: int | None) -> pyro.plate:
    if subsample_size is not None and num_data is not None:
        raise ValueError("pass either `subsample_size` (in-model minibatches) or `num_data` (external), not both")
    if subsample_size is not None:
        if not (isinstance(subsample_size, int) and 0 < subsample_size <= len(x)):
            raise ValueError(f"`subsample_size` must be an int in [1, {len(x)}], got {subsample_size!r}")
        return pyro.plate("data", len(x), subsample_size=subsample_size, device=x.device)
    if num_data is not None:
        if not (isinstance(num_data, int) and num_data >= len(x)):
            raise ValueError(f"`num_data` must be an int >= the batch size {len(x)}, got {num_data!r}")
        return pyro.plate("data", num_data, subsample=torch.arange(len(x), device=x.device))
    return pyro.plate("data", len(x), device=x.device)


class BayesianClassifier(PyroModule):
    r"""A categorical likelihood :math:`p(y\mid x,\theta)=\mathrm{Cat}(y;\ \mathrm{softmax} f_\theta(x))`.

    :param net: a network made (partly) Bayesian by :func:`make_bayesian`; it maps ``[B, *input_shape]`` to
        ``[B, num_classes]`` logits.
    :param num_classes: the number of classes :math:`C`.
    :param autocast: ``None`` (default) or a low-precision dtype (``torch.bfloat16``, ``torch.float16``): the network's
        forward pass runs under :func:`torch.autocast` in it and its logits are cast back to the input's dtype. Only
        the network is autocast: the likelihood, the prior and guide densities, and every algebra an objective does
        with the gradients (a SAM ascent, a Fisher solve) stay in the model's dtype.

    Call as ``model(x, y=None, *, subsample_size=None, num_data=None)``; returns the logits of the (sub)batch.
    """

    def __init__(self, net: nn.Module, num_classes: int, *, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(net, PyroModule):
            raise TypeError("`net` must be a PyroModule; convert it with pyro_flat.nn.make_bayesian first")
        check_int(num_classes, "num_classes", minimum=2)
        if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
            raise ValueError(f"`autocast` must be None or a floating torch.dtype, got {autocast!r}")
        self.net = net
        self.num_classes = num_classes
        self.autocast = autocast

    def _check(self, x: Tensor, y: Tensor | None) -> None:
        if not isinstance(x, Tensor) or x.dim() < 2:
            raise ValueError(f"`x` must be a tensor of shape [batch, features...], got {getattr(x, 'shape', x)!r}")
        if isinstance(y, Tensor) and (y.dtype.is_floating_point or y.dtype == torch.bool):
            raise ValueError(f"`y` must hold integer class labels, got dtype {y.dtype}")

    def forward(self, x: Tensor, y: Tensor | None = None, *, subsample_size: int | None = None,
                num_data: int | None = None) -> Tensor:
        self._check(x, y)
        plate, x, y = _minibatch(x, y, subsample_size, num_data)
        if self.autocast is None:
            logits = self.net(x)
        else:
            with torch.autocast(x.device.type, dtype=self.autocast):
                logits = self.net(x)
            logits = logits.to(x.dtype)
        with plate:
            pyro.deterministic("logits", logits, event_dim=1)
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class BayesianRegressor(PyroModule):
    r"""A Gaussian likelihood :math:`p(y\mid x,\theta)=\mathcal N(y;\ \mu_\theta(x), \sigma_\theta(x)^2)`.

    :param net: a network made Bayesian by :func:`make_bayesian`, mapping ``[B, *input_shape]`` to ``[B, 2]``
        (mean and pre-softplus scale, heteroscedastic) or to ``[B, 1]`` / ``[B]`` (mean; then ``obs_scale`` is used).
    :param obs_scale: a fixed observation noise :math:`\sigma > 0`; ``None`` means the network predicts it as
        :math:`\sigma_\theta(x)=\mathrm{softplus}(\cdot) + 10^{-6}`.
    """

    def __init__(self, net: nn.Module, obs_scale: float | None = None) -> None:
        super().__init__()
        if not isinstance(net, PyroModule):
            raise TypeError("`net` must be a PyroModule; convert it with pyro_flat.nn.make_bayesian first")
        if obs_scale is not None and not obs_scale > 0:
            raise ValueError(f"`obs_scale` must be > 0 or None, got {obs_scale!r}")
        self.net = net
        self.obs_scale = obs_scale

    def forward(self, x: Tensor, y: Tensor | None = None, *, subsample_size: int | None = None,
                num_data: int | None = None) -> Tensor:
        plate, x, y = _minibatch(x, y, subsample_size, num_data)
        out = self.net(x)
        if self.obs_scale is None:
            if out.shape[-1] != 2:
                raise ValueError(
                    f"heteroscedastic regression needs a [batch, 2] network output, got {tuple(out.shape)}"
                )
            loc, scale = out[..., 0], nn.functional.softplus(out[..., 1]) + 1e-6
        else:
            if out.dim() > 2 or (out.dim() == 2 and out.shape[-1] != 1):
                raise ValueError(
                    f"regression with a fixed `obs_scale` needs a [batch] or [batch, 1] output, got {tuple(out.shape)}"
                )
            loc = out.reshape(len(x))
            scale = torch.full_like(loc, self.obs_scale)
        with plate:
            pyro.deterministic("loc", loc)
            pyro.deterministic("scale", scale)
            pyro.sample("obs", dist.Normal(loc, scale), obs=y)
        return loc


def _mlp(in_features: int, out_features: int, hidden: Sequence[int], dropout: float) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = h
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


def _check_mlp_args(in_features: int, hidden: Sequence[int], dropout: float) -> None:
    if not (isinstance(in_features, int) and in_features > 0):
        raise ValueError(f"`in_features` must be a positive int, got {in_features!r}")
    if not all(isinstance(h, int) and h > 0 for h in hidden):
        raise ValueError(f"`hidden` must be a sequence of positive ints, got {hidden!r}")
    if not 0 <= dropout < 1:
        raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}")


class BayesianMLP(BayesianClassifier):
    r"""A Bayesian multilayer perceptron classifier: ReLU hidden layers, all weights and biases latent.

    :param in_features: input dimension (inputs are flattened).
    :param num_classes: number of classes.
    :param hidden: widths of the hidden layers; default ``(256, 256)``.
    :param prior_scale: prior standard deviation of every weight (``N(0, s^2)``); default 1.
    :param dropout: dropout probability after each hidden layer (MC-Dropout when the model is in train mode at
        prediction time); default 0.
    :param packed: all weights one sample site ``"net.weights"`` (:func:`~pyro_flat.nn.pack_latents`, default
        ``True``) or, with ``False``, one site per tensor (``"net.1.weight"``, ...).
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: Sequence[int] = (256, 256),
        *,
        prior_scale: float = 1.0,
        dropout: float = 0.0,
        packed: bool = True,
    ) -> None:
        _check_mlp_args(in_features, hidden, dropout)
        net = make_bayesian(_mlp(in_features, num_classes, hidden, dropout), prior_scale=prior_scale, packed=packed)
        super().__init__(net, num_classes)


class BayesianRegressionMLP(BayesianRegressor):
    """A Bayesian MLP regressor (heteroscedastic by default: the net predicts mean and scale).

    :param in_features: input dimension.
    :param hidden: hidden widths; default ``(50, 50)``.
    :param prior_scale: prior standard deviation of every weight; default 1.
    :param obs_scale: fixed noise scale, or ``None`` to learn a heteroscedastic one.
    :param packed: all weights one sample site (:func:`~pyro_flat.nn.pack_latents`, default ``True``) or one per
        tensor (``False``).
    """

    def __init__(
        self,
        in_features: int = 1,
        hidden: Sequence[int] = (50, 50),
        *,
        prior_scale: float = 1.0,
        obs_scale: float | None = None,
        packed: bool = True,
    ) -> None:
        _check_mlp_args(in_features, hidden, 0.0)
        net = make_bayesian(_mlp(in_features, 2 if obs_scale is None else 1, hidden, 0.0), prior_scale=prior_scale,
                            packed=packed)
        super().__init__(net, obs_scale)


class BayesianCNN(BayesianClassifier):
    r"""A small Bayesian convolutional classifier for 1-D (``[C, L]``) or 2-D (``[C, H, W]``) inputs.

    Two conv blocks (3-wide kernels, padding 1) each followed by a normalisation layer, ReLU and 2x pooling, then a
    global average pool and a linear head. All weights, biases and normalisation affine parameters are latent.

    :param input_shape: ``(channels, length)`` or ``(channels, height, width)``.
    :param num_classes: number of classes.
    :param channels: output channels of the two conv blocks; default ``(16, 32)``.
    :param norm: ``"batch"`` (BatchNorm; refresh its statistics per posterior sample with
        :func:`refresh_batchnorm`), ``"group"`` (GroupNorm with 4 groups, no running statistics) or ``None``.
    :param prior_scale: prior standard deviation; default 1.
    :param dropout: dropout before the head; default 0.
    :param packed: all weights one sample site (:func:`~pyro_flat.nn.pack_latents`, default ``True``) or one per
        tensor (``False``).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (16, 32),
        *,
        norm: str | None = "batch",
        prior_scale: float = 1.0,
        dropout: float = 0.0,
        packed: bool = True,
    ) -> None:
        input_shape = tuple(input_shape)
        if len(input_shape) not in (2, 3) or not all(isinstance(s, int) and s > 0 for s in input_shape):
            raise ValueError(f"`input_shape` must be (C, L) or (C, H, W) of positive ints, got {input_shape!r}")
        if norm not in ("batch", "group", None):
            raise ValueError(f"`norm` must be 'batch', 'group' or None, got {norm!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}")
        two_d = len(input_shape) == 3
        conv, pool = (nn.Conv2d, nn.MaxPool2d) if two_d else (nn.Conv1d, nn.MaxPool1d)
        batchnorm = nn.BatchNorm2d if two_d else nn.BatchNorm1d
        layers: list[nn.Module] = []
        width = input_shape[0]
        for c in channels:
            layers.append(conv(width, c, kernel_size=3, padding=1))
            if norm == "batch":
                layers.append(batchnorm(c))
            elif norm == "group":
                layers.append(nn.GroupNorm(min(4, c), c))
            layers += [nn.ReLU(), pool(2, ceil_mode=True)]
            width = c
        layers += [nn.AdaptiveAvgPool2d(1) if two_d else nn.AdaptiveAvgPool1d(1), nn.Flatten()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(width, num_classes))
        super().__init__(make_bayesian(nn.Sequential(*layers), prior_scale=prior_scale, packed=packed), num_classes)
