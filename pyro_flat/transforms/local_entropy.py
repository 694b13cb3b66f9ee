r"""The local-entropy model transform of Entropy-MCMC: an auxiliary "anchor" latent coupled to every latent site.

For a model with latent sites :math:`\theta` (all of them together; :math:`U(\theta) = -\log p(\theta, \mathcal D)`
up to a constant), :func:`local_entropy` returns the model with joint density

.. math::
    p(\theta, \theta_a \mid \mathcal D) \;\propto\; \exp\Big(-U(\theta) - \frac{\|\theta - \theta_a\|^2}{2\eta}\Big),

i.e. for every latent site ``name`` it adds

* a latent site ``f"{name}_anchor"`` (:data:`ANCHOR_SUFFIX`) of the same shape, with an improper flat prior on
  :math:`\mathbb R^{\text{shape}}` (log density exactly 0; whatever the support of :math:`\theta`), and
* a factor site ``f"{name}_coupling"`` with log density :math:`-\|\theta - \theta_a\|^2/(2\eta)`.

Exact facts (for any :math:`U`, by integrating the Gaussian kernel):

* the :math:`\theta`-marginal is the **original posterior**, :math:`\int e^{-\|\theta-\theta_a\|^2/(2\eta)}\,
  d\theta_a` being a constant;
* the :math:`\theta_a`-marginal is :math:`\propto \exp F(\theta_a;\eta)` with the *local entropy*
  :math:`F(\theta_a;\eta) = \log\int \exp(-U(\theta) - \|\theta-\theta_a\|^2/(2\eta))\,d\theta`: the posterior
  convolved with :math:`\mathcal N(0, \eta I)`, a smoothed density on which sharp modes lose their height. At
  temperature :math:`T` (a sampler targeting :math:`p^{1/T}`) the convolution is with :math:`\mathcal N(0, \eta T I)`.

Any Pyro inference can run on the transformed model; SGLD on it, updating :math:`\theta` and :math:`\theta_a`
jointly, is Entropy-MCMC (:class:`~pyro_flat.infer.mcmc.EntropyMCMC`) [1].

**Mapping to the paper's code.** Li & Zhang write the loss as a mean over the :math:`N` data, so their coupling is
:math:`\|\theta-\theta_a\|^2/(2\eta N)` and their noise :math:`\sqrt{2\alpha T/N}`. Pyro's subsampled plate gives the
*full-data* log joint, so the same :math:`\eta` and :math:`T` are used here, with the step size
:math:`\varepsilon = \alpha/N`. Their weight decay ``wd`` also acts on :math:`\theta_a`; to reproduce it give the
anchors a Gaussian prior with precision :math:`N\cdot\mathrm{wd}` (``anchor_prior_scale = (N wd)^{-1/2}``), which makes
the :math:`\theta`-marginal differ from the posterior.

.. note:: Whenever no outer handler gives the anchor a value (an unconditioned run, e.g. the initialisation of a
    kernel under any ``init_strategy``, or an autoguide's prototype trace), the anchor takes a copy of its site's
    value, as in the authors' code (the transform presets the value, as ``poutine.substitute`` would). Its
    distribution, ``dist.Normal(0, 1).expand(shape).to_event(event_dim).mask(False)``, has log density 0 everywhere
    and real support. A network with batch normalisation needs its statistics recomputed for each anchor draw before
    prediction (``bma_predict`` with ``batchnorm_inputs``).

References:
    [1] `Entropy-MCMC: Sampling from Flat Basins with Ease`, Bolian Li, Ruqi Zhang (ICLR 2024), arXiv:2310.05401
    [2] `Entropy-SGD: Biasing Gradient Descent Into Wide Valleys`, Pratik Chaudhari et al. (ICLR 2017),
        arXiv:1611.01838
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Literal

import pyro
import pyro.distributions as dist
import torch
from pyro.poutine.messenger import Messenger
from torch import Tensor

from ..infer.util import is_latent_site
from ..ops.diffusions import coupling_potential

__all__ = [
    "ANCHOR_SUFFIX",
    "COUPLING_SUFFIX",
    "LocalEntropyMessenger",
    "local_entropy",
    "local_entropy_potential",
    "local_entropy_draws",
    "anchor_name",
]

ANCHOR_SUFFIX = "_anchor"
"""The suffix of the anchor site of a latent site: ``"w"`` -> ``"w_anchor"``."""
COUPLING_SUFFIX = "_coupling"
"""The suffix of the coupling factor site: ``"w"`` -> ``"w_coupling"``."""

_ANCHOR_FLAG = "_local_entropy_anchor"


def anchor_name(name: str) -> str:
    """The anchor site of latent site ``name``."""
    return name + ANCHOR_SUFFIX


def _check_eta(eta: object, owner: str) -> float:
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 < eta < math.inf:
        raise ValueError(f"{owner}: expected eta to be a finite number > 0, got {eta!r}")
    return float(eta)


def _check_optional_scale(scale: object, owner: str) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"{owner}: expected anchor_prior_scale to be None or a finite number > 0, got {scale!r}")
    return float(scale)


def _batched_coupling(theta: Tensor, anchor: Tensor, eta: float, event_dim: int) -> Tensor:
    """:math:`-\\|\\theta - \\theta_a\\|^2/(2\\eta)` summed over the ``event_dim`` rightmost dimensions only."""
    squared = (theta - anchor).pow(2)
    if event_dim:
        squared = squared.sum(tuple(range(-event_dim, 0)))
    return -squared / (2.0 * eta)


class LocalEntropyMessenger(Messenger):
    r"""The effect handler behind :func:`local_entropy`: after every latent sample site it samples the site's anchor
    and adds the coupling factor (see the module docstring for the density).

    :param float eta: :math:`\eta > 0`, the variance of the Gaussian coupling (Entropy-MCMC's default for CIFAR-10
        with ResNet-18 is 4e-4 [1]; the right value depends on the model and data over orders of magnitude).
    :param anchor_prior_scale: ``None`` (default): a flat prior on the anchors, the exact construction; a number
        :math:`s > 0`: a :math:`\mathcal N(0, s^2)` prior on every anchor element (the paper's weight decay on
        :math:`\theta_a`).
    :type anchor_prior_scale: float or None
    :raises ValueError: on a non-positive ``eta`` or ``anchor_prior_scale``, and when the model has a discrete
        latent site (named in the message).
    """

    def __init__(self, eta: float, anchor_prior_scale: float | None = None) -> None:
        self.eta = _check_eta(eta, "local_entropy")
        self.anchor_prior_scale = _check_optional_scale(anchor_prior_scale, "local_entropy")
        self._pending: set[str] = set()
        self._anchor_values: dict[str, Tensor] = {}
        super().__init__()

    def __enter__(self) -> LocalEntropyMessenger:
        self._pending, self._anchor_values = set(), {}
        return super().__enter__()

    def _process_message(self, msg: dict) -> None:
        if msg["type"] != "sample":
            return
        if msg["infer"].get(_ANCHOR_FLAG, False):
            # an anchor: preset to a copy of its site's value, unless an outer handler sets it (condition, substitute)
            value = self._anchor_values.pop(msg["name"])
            if msg["value"] is None:
                msg["value"] = value
        elif is_latent_site(msg):
            # decided here, before outer handlers run: an outer ``poutine.condition`` (as in an MCMC potential) marks
            # the site observed, yet it is a latent of the model and keeps its anchor
            self._pending.add(msg["name"])

    def _postprocess_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or msg["name"] not in self._pending:
            return
        self._pending.discard(msg["name"])
        fn = msg["fn"]
        if fn.support.is_discrete or getattr(fn, "has_enumerate_support", False):
            raise ValueError(
                f"local_entropy: site {msg['name']!r} is discrete ({type(fn).__name__}); the coupling "
                "||theta - theta_a||^2 / (2 eta) needs continuous latent sites"
            )
        name, value, event_dim = msg["name"], msg["value"], fn.event_dim
        self._anchor_values[anchor_name(name)] = value.detach().clone()
        flat = dist.Normal(torch.zeros_like(value), 1.0).to_event(event_dim).mask(False)
        anchor = pyro.sample(anchor_name(name), flat, infer={_ANCHOR_FLAG: True})
        pyro.factor(name + COUPLING_SUFFIX, _batched_coupling(value, anchor, self.eta, event_dim), has_rsample=True)
        if self.anchor_prior_scale is not None:
            prior = dist.Normal(torch.zeros_like(anchor), self.anchor_prior_scale)
            log_prior = prior.log_prob(anchor)
            if event_dim:
                log_prior = log_prior.sum(tuple(range(-event_dim, 0)))
            pyro.factor(anchor_name(name) + "_prior", log_prior, has_rsample=True)


def local_entropy(model: Callable, eta: float, *, anchor_prior_scale: float | None = None) -> Callable:
    r"""The local-entropy transform of a Pyro model (Entropy-MCMC [1]): every latent site ``name`` gets an anchor
    latent ``f"{name}_anchor"`` of the same shape, a flat prior on it, and the coupling factor
    :math:`\exp(-\|\theta - \theta_a\|^2/(2\eta))` (site ``f"{name}_coupling"``). The joint density is

    .. math:: p(\theta, \theta_a\mid\mathcal D) \propto \exp\big(-U(\theta) - \|\theta-\theta_a\|^2/(2\eta)\big),

    whose :math:`\theta`-marginal is the original posterior and whose :math:`\theta_a`-marginal is the posterior
    convolved with :math:`\mathcal N(0, \eta I)` (see the module docstring).

    :param model: a Pyro model with continuous latent sites (e.g. a :class:`~pyro_flat.nn.BayesianMLP`).
    :param float eta: :math:`\eta > 0` (on the scale of the full-data log joint, which equals the paper's
        :math:`\eta` with its mean-loss scaling; see the module docstring).
    :param anchor_prior_scale: ``None`` for the flat anchor prior (default, exact marginals), or the standard
        deviation of a Gaussian anchor prior (the paper's weight decay on :math:`\theta_a`).
    :type anchor_prior_scale: float or None
    :returns: the transformed model, called with the same arguments as ``model`` (picklable if ``model`` is).
    :raises ValueError: on a non-positive ``eta``; on a discrete latent site when the model runs.

    Example::

        flat_model = local_entropy(model, eta=1e-3)
        mcmc = MCMC(SGLD(flat_model, step_size=1e-5), num_samples=100)   # == EntropyMCMC(model, eta=1e-3, ...)
        mcmc.run(x_train, y_train, subsample_size=128)
    """
    return LocalEntropyMessenger(eta, anchor_prior_scale)(model)


class local_entropy_potential:  # noqa: N801 (a function-like transform, named like local_entropy)
    r"""The local-entropy transform of a *potential function* (for kernels built with ``potential_fn``):

    .. math:: U_\eta(\theta, \theta_a) = U(\theta) + \sum_{\text{sites}} \|\theta - \theta_a\|^2/(2\eta),

    where the parameter dict holds every site ``name`` of ``potential_fn`` together with ``f"{name}_anchor"``.

    :param potential_fn: :math:`U`, a callable ``{name: tensor} -> scalar``.
    :param float eta: :math:`\eta > 0`.
    """

    def __init__(self, potential_fn: Callable[[dict[str, Tensor]], Tensor], eta: float) -> None:
        if not callable(potential_fn):
            raise ValueError(f"local_entropy_potential: expected a callable potential_fn, got {potential_fn!r}")
        self.potential_fn = potential_fn
        self.eta = _check_eta(eta, "local_entropy_potential")

    def __call__(self, params: Mapping[str, Tensor]) -> Tensor:
        theta = {k: v for k, v in params.items() if not k.endswith(ANCHOR_SUFFIX)}
        energy = self.potential_fn(theta)
        for name, value in theta.items():
            key = anchor_name(name)
            if key not in params:
                raise ValueError(f"local_entropy_potential: params has site {name!r} but not its anchor {key!r}")
            energy = energy + coupling_potential(value, params[key], self.eta)
        return energy


def local_entropy_draws(
    samples: Mapping[str, Tensor], collect: Literal["theta", "anchor", "both"] = "both"
) -> dict[str, Tensor]:
    r"""Posterior draws of the *original* model's sites from samples of a :func:`local_entropy` model.

    ``samples`` is ``{site: [S, ...]}`` (e.g. ``mcmc.get_samples()``) holding latent sites and/or their anchors.
    With ``collect="theta"`` the latent sites are returned; with ``"anchor"`` the anchors, renamed to their
    latent's name; with ``"both"`` the two sets are concatenated along the draw dimension (:math:`2S` draws, as the
    authors average both networks). The result can go to ``Predictive(model, posterior_samples=...)`` or
    :func:`~pyro_flat.infer.sample_draws`.

    :param samples: stacked samples.
    :param str collect: ``"theta"``, ``"anchor"`` or ``"both"``.
    :raises ValueError: if the requested kind of site is missing from ``samples``.
    """
    if collect not in ("theta", "anchor", "both"):
        raise ValueError(f"local_entropy_draws: expected collect in 'theta', 'anchor', 'both', got {collect!r}")
    theta = {k: v for k, v in samples.items() if not k.endswith(ANCHOR_SUFFIX)}
    anchors = {k[: -len(ANCHOR_SUFFIX)]: v for k, v in samples.items() if k.endswith(ANCHOR_SUFFIX)}
    if collect in ("theta", "both") and not theta:
        raise ValueError("local_entropy_draws: samples hold no latent (non-anchor) site")
    if collect in ("anchor", "both") and not anchors:
        raise ValueError(f"local_entropy_draws: samples hold no anchor site (names ending in {ANCHOR_SUFFIX!r})")
    if collect == "theta":
        return dict(theta)
    if collect == "anchor":
        return anchors
    if set(theta) != set(anchors):
        raise ValueError(
            f"local_entropy_draws: collect='both' needs every site and its anchor, got sites {sorted(theta)} and "
            f"anchors of {sorted(anchors)}"
        )
    return {k: torch.cat([theta[k], anchors[k]]) for k in theta}
