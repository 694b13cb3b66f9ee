r"""The local-entropy model transform of Entropy-MCMC: an auxiliary "anchor" latent coupled to every latent site.

For a model with latent sites :math:`\theta` (all of them together; :math:`U(\theta) = -\log p(\theta, \mathcal D)`
up to a constant), :func:`local_entropy` couples each site to an anchor :math:`\theta_a` of the same shape and support.
The coupling lives in the unconstrained coordinates in which samplers move: with :math:`t` = ``biject_to(support).inv``
(the identity for real-valued sites such as network weights), :math:`z = t(\theta)` and :math:`u = t(\theta_a)`, the
joint density is

.. math::
    p(\theta, \theta_a \mid \mathcal D) \;\propto\; p(\theta\mid\mathcal D)\,
    \exp\Big(-\frac{\|t(\theta) - t(\theta_a)\|^2}{2\eta}\Big)\,\big|\det J_t(\theta_a)\big|,

i.e. for every latent site ``name`` it adds

* a latent site ``f"{name}_anchor"`` (:data:`ANCHOR_SUFFIX`) with the site's shape and support and an improper prior
  that is flat in the unconstrained coordinates (density :math:`|\det J_t(\theta_a)|` on the support), and
* a factor site ``f"{name}_coupling"`` with log density :math:`-\|t(\theta) - t(\theta_a)\|^2/(2\eta)`.

Exactly, for any :math:`U`: the :math:`\theta`-marginal is the **original posterior**, and the :math:`u`-marginal is
the posterior of the unconstrained coordinates convolved with :math:`\mathcal N(0, \eta I)`
(:math:`\mathcal N(0, \eta T I)` at temperature :math:`T`), on which sharp modes lose their height (the local entropy
of [2]); anchors are valid values of their site. Any Pyro inference can run on the transformed model; SGLD on it,
updating :math:`\theta` and :math:`\theta_a` jointly, is Entropy-MCMC (:class:`~pyro_flat.infer.mcmc.EntropyMCMC`)
[1]. The same :math:`\eta` and :math:`T` as the authors' code are used here, with the step size
:math:`\varepsilon = \alpha/N` for their learning rate :math:`\alpha` (Pyro's subsampled plate gives the full-data
log joint; their mean-loss scaling divides by :math:`N`).

An outer ``pyro.condition`` of a site makes it an observation (no anchor), as inside, unless the same condition gives
its anchor too (then both are latent values of the joint, as in Pyro's HMC/NUTS potential); an outer ``poutine.do``
is refused. Whenever no handler gives an anchor a value, it takes a copy of its site's value, as in the authors' code.
Derivation, the paper's hyperparameters and the rules for every outer handler: the *SG-MCMC and Entropy-MCMC* page of
the documentation (``docs/methods/sgmcmc.md``).

References:
    * [1] `Entropy-MCMC: Sampling from Flat Basins with Ease`, Bolian Li, Ruqi Zhang (ICLR 2024), arXiv:2310.05401
    * [2] `Entropy-SGD: Biasing Gradient Descent Into Wide Valleys`, Pratik Chaudhari et al. (ICLR 2017),
      arXiv:1611.01838
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import pyro
import pyro.distributions as dist
import torch
from pyro.poutine.messenger import Messenger
from torch import Tensor
from torch.distributions import biject_to, constraints

from .._validation import check_positive
from ..ops.diffusions import coupling_potential
from ..runtime.sites import is_latent_site
from ._outer import hidden_outside, outer_conditions

__all__ = [
    "ANCHOR_SUFFIX",
    "COUPLING_SUFFIX",
    "FlatAnchorPrior",
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


def _sum_event(x: Tensor, event_dim: int) -> Tensor:
    return x.sum(tuple(range(-event_dim, 0))) if event_dim else x


class FlatAnchorPrior(dist.TorchDistribution):
    r"""The anchors' improper prior: flat in the unconstrained coordinates :math:`u = t(x)` of ``support``, i.e. the
    density :math:`|\det J_t(x)|` on the support, with :math:`t` = ``biject_to(support).inv``. It cannot be sampled;
    :class:`LocalEntropyMessenger` presets its value.

    :param support: the constraint of the anchored site.
    :param batch_shape: the site's batch shape.
    :param event_shape: the site's event shape.
    """

    arg_constraints: dict = {}

    def __init__(self, support: constraints.Constraint, batch_shape: torch.Size, event_shape: torch.Size) -> None:
        self._support = support
        super().__init__(batch_shape, event_shape, validate_args=False)

    @property
    def support(self) -> constraints.Constraint:
        return self._support

    def log_prob(self, value: Tensor) -> Tensor:
        to_support = biject_to(self._support)
        log_det = -to_support.log_abs_det_jacobian(to_support.inv(value), value)
        return _sum_event(log_det, len(self.event_shape) - to_support.codomain.event_dim).expand(self.batch_shape)

    def expand(self, batch_shape: torch.Size, _instance: object = None) -> FlatAnchorPrior:
        return FlatAnchorPrior(self._support, torch.Size(batch_shape), self.event_shape)


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
        self.eta = check_positive(eta, "eta", owner="local_entropy")
        self.anchor_prior_scale = check_positive(anchor_prior_scale, "anchor_prior_scale", owner="local_entropy",
                                                 allow_none=True)
        self._pending: set[str] = set()
        self._visible: dict[str, bool] = {}
        self._anchor_values: dict[str, Tensor] = {}
        super().__init__()

    def __enter__(self) -> LocalEntropyMessenger:
        self._pending, self._visible, self._anchor_values = set(), {}, {}
        return super().__enter__()

    def _process_message(self, msg: dict) -> None:
        if msg["type"] != "sample":
            return
        if msg["infer"].get(_ANCHOR_FLAG, False):
            # an anchor: preset to a copy of its site's value, unless a handler gives it a value (condition, replay)
            value = self._anchor_values.pop(msg["name"])
            if msg["value"] is None:
                msg["value"] = value
        elif is_latent_site(msg) and not hidden_outside(self, msg, "local_entropy"):
            self._pending.add(msg["name"])

    def _postprocess_message(self, msg: dict) -> None:
        if msg["type"] != "sample":
            return
        name = msg["name"]
        if msg["infer"].get(_ANCHOR_FLAG, False):
            site = name[: -len(ANCHOR_SUFFIX)]
            if msg["stop"] and self._visible.get(site, False):
                raise ValueError(
                    f"local_entropy: a poutine.block outside the transformed model hides the anchor {name!r} while "
                    f"its site {site!r} stays visible; apply the block inside the transform or hide both"
                )
            return
        if name not in self._pending:
            return
        self._pending.discard(name)
        if msg["is_observed"] and not outer_conditions(self, anchor_name(name)):
            return  # an observation given by an outer condition: no anchor, as if conditioned inside
        fn = msg["fn"]
        if fn.support.is_discrete or getattr(fn, "has_enumerate_support", False):
            raise ValueError(
                f"local_entropy: site {name!r} is discrete ({type(fn).__name__}); the coupling "
                "||t(theta) - t(theta_a)||^2 / (2 eta) needs continuous latent sites"
            )
        self._visible[name] = not msg["stop"]
        value, support, event_dim = msg["value"], fn.support, fn.event_dim
        self._anchor_values[anchor_name(name)] = value.detach().clone()
        batch_dim = value.dim() - event_dim
        prior = FlatAnchorPrior(support, value.shape[:batch_dim], value.shape[batch_dim:])
        anchor = pyro.sample(anchor_name(name), prior, infer={_ANCHOR_FLAG: True})
        to_unconstrained = biject_to(support).inv
        unconstrained_dim = to_unconstrained.codomain.event_dim
        z, u = to_unconstrained(value), to_unconstrained(anchor)
        pyro.factor(
            name + COUPLING_SUFFIX,
            -_sum_event((z - u).pow(2), unconstrained_dim) / (2.0 * self.eta),
            has_rsample=True,
        )
        if self.anchor_prior_scale is not None:
            log_prior = dist.Normal(torch.zeros_like(u), torch.full_like(u, self.anchor_prior_scale)).log_prob(u)
            pyro.factor(anchor_name(name) + "_prior", _sum_event(log_prior, unconstrained_dim), has_rsample=True)


def local_entropy(model: Callable, eta: float, *, anchor_prior_scale: float | None = None) -> Callable:
    r"""The local-entropy transform of a Pyro model (Entropy-MCMC [1]): every latent site ``name`` gets an anchor
    latent ``f"{name}_anchor"`` with the site's shape and support, flat in the unconstrained coordinates, and the
    coupling factor :math:`\exp(-\|t(\theta) - t(\theta_a)\|^2/(2\eta))` (site ``f"{name}_coupling"``). The
    :math:`\theta`-marginal is the original posterior; the anchors' is the posterior smoothed by
    :math:`\mathcal N(0, \eta I)` in the unconstrained coordinates (module docstring).

    :param model: a Pyro model with continuous latent sites (e.g. a :class:`~pyro_flat.nn.BayesianMLP`).
    :param float eta: :math:`\eta > 0` (on the scale of the full-data log joint, which equals the paper's
        :math:`\eta` with its mean-loss scaling; see the module docstring).
    :param anchor_prior_scale: ``None`` for the flat anchor prior (default, exact marginals), or the standard
        deviation of a Gaussian prior on the anchors' unconstrained values (the paper's weight decay on
        :math:`\theta_a`).
    :type anchor_prior_scale: float or None
    :returns: the transformed model, called with the same arguments as ``model`` (picklable if ``model`` is).
    :raises ValueError: on a non-positive ``eta``; when the model runs, on a discrete latent site or an outer
        ``poutine.do``.

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
        self.eta = check_positive(eta, "eta", owner="local_entropy_potential")

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

    ``samples`` is ``{site: [S, ...]}`` (e.g. ``mcmc.get_samples()``, whose values, anchors included, are in each
    site's support) holding latent sites and/or their anchors. With ``collect="theta"`` the latent sites are returned;
    with ``"anchor"`` the anchors, renamed to their latent's name (an anchor is a valid value of its site); with
    ``"both"`` the two sets are concatenated along the draw dimension (:math:`2S` draws, as the
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
