r"""Entropy-MCMC: SGLD on the local-entropy transform of a model, updating the weights and their anchors jointly.

**Warm-up.** Coupled with stiffness :math:`1/\eta`, a site and its anchor drift together under the force on the
site alone: along directions much wider than :math:`\sqrt{\eta}` the pair moves like SGLD at *half* the step size
(its centre takes :math:`z' = z - \tfrac{\varepsilon}{2}\nabla\tilde U + \sqrt{\varepsilon T}\,\xi`), so from a
start far in the tail (e.g. the prior median of a weakly identified scale) the paper's joint step needs twice
SGLD's warm-up. By default each warm-up step is therefore followed by an exact draw of the anchors from their
conditional given the sites, :math:`u\mid z\sim\mathcal N(z, \eta T I)` (with an anchor prior of scale
:math:`s`: :math:`\mathcal N(zs^2/(s^2+\eta),\ T\eta s^2/(s^2+\eta)\,I)`), a Gibbs step that leaves the joint
invariant: the coupling's pull then averages to zero and the sites relax at SGLD's speed, the anchors following.
The warm-up is ``MCMC``'s; a driver that takes every transition as a warm-up call (the comparison harness) sets the
kernel's ``anchor_warmup_steps`` to its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions.transforms import Transform

from ..._validation import check_positive
from ...ops.diffusions import coupling_potential
from ...transforms.local_entropy_model import (
    ANCHOR_SUFFIX,
    anchor_name,
    local_entropy,
    local_entropy_potential,
)
from .base import ModelPotential, Params, initialize_sg_model
from .sgld import SGLD

__all__ = ["EntropyMCMC", "CoupledPotential"]


class CoupledPotential:
    r"""The potential of :func:`~pyro_flat.transforms.local_entropy` ``(model, eta)`` in the kernel's unconstrained
    coordinates, computed without tracing the anchor and coupling sites: the model's own potential plus the coupling
    (and the anchor prior), added analytically,

    .. math:: U_\eta(z, u) = U(z) + \sum_{\text{sites}} \Big(\frac{\|z - u\|^2}{2\eta}
        \;\big[-\log\mathcal N(u; 0, s^2 I)\big]\Big),

    where :math:`z` and :math:`u` are a site's and its anchor's unconstrained values (the anchor's flat prior and the
    sampler's Jacobian cancel) and the bracket is present only with an anchor prior scale :math:`s`. It equals the
    potential of the transformed model exactly.

    :param potential: the model's :class:`~pyro_flat.infer.mcmc.ModelPotential`.
    :param float eta: :math:`\eta > 0`.
    :param anchor_prior_scale: :math:`s`, or ``None`` for the flat anchor prior.
    :type anchor_prior_scale: float or None
    """

    def __init__(self, potential: ModelPotential, eta: float, anchor_prior_scale: float | None = None) -> None:
        self.potential = potential
        self.eta = eta
        self.anchor_prior_scale = anchor_prior_scale
        self.sites = list(potential.transforms)

    def __call__(self, params: Mapping[str, Tensor]) -> Tensor:
        energy = self.potential({name: params[name] for name in self.sites})
        for name in self.sites:
            anchor = params[anchor_name(name)]
            energy = energy + coupling_potential(params[name], anchor, self.eta)
            if self.anchor_prior_scale is not None:
                scale = torch.full((), self.anchor_prior_scale, dtype=anchor.dtype, device=anchor.device)
                prior = dist.Normal(torch.zeros_like(scale), scale)
                energy = energy - prior.log_prob(anchor).sum()
        return energy


class EntropyMCMC(SGLD):
    r"""Entropy-MCMC [1]: :class:`~pyro_flat.infer.mcmc.SGLD` on :func:`~pyro_flat.transforms.local_entropy`
    ``(model, eta)``, an :class:`~pyro.infer.mcmc.MCMCKernel` that samples from flat basins.

    Both the sites :math:`z` and their anchors :math:`u` (sites ``f"{name}_anchor"``, unconstrained coordinates)
    take the SGLD step on :math:`U(z) + \|z-u\|^2/(2\eta)`:

    .. math::
        z' &= z - \varepsilon\big[\nabla\tilde U(z) + (z-u)/\eta\big] + \sqrt{2\varepsilon T}\,\xi_1, \\
        u' &= u - \varepsilon\,(u-z)/\eta + \sqrt{2\varepsilon T}\,\xi_2 .

    The sites' marginal is the tempered posterior, the anchors' that posterior smoothed by
    :math:`\mathcal N(0, \eta T I)`. After warm-up (and throughout with ``warmup_anchors="joint"``) it is the same
    chain as ``SGLD(local_entropy(model, eta))`` at the same seed, faster (the coupling is added analytically,
    :class:`CoupledPotential`). The SG-MCMC page of the documentation has the maths and the mapping of the paper's
    hyperparameters (``step_size`` :math:`=\alpha/N`).

    **Warm-up** (module docstring): by default the anchors are drawn from their conditional given the sites after
    each warm-up step, so that the sites relax from their start at SGLD's speed, not half of it.

    :param model: a Pyro model with continuous latents and a subsampled data plate; exactly one of ``model`` and
        ``potential_fn``.
    :param potential_fn: alternatively, a potential :math:`U(\{name: tensor\})`; the kernel adds the anchors (then
        ``initial_params`` need only hold the sites; missing anchors start at the sites' values).
    :param float eta: :math:`\eta > 0` (no default: it spans orders of magnitude between problems).
    :param str collect: which sites ``MCMC`` keeps: ``"theta"`` (default, the weights), ``"anchor"`` (the flat
        :math:`\theta_a`) or ``"both"``; :func:`~pyro_flat.transforms.local_entropy_draws` turns the samples into draws
        of the original model.
    :param anchor_prior_scale: ``None`` (flat anchor prior, default) or the scale of a Gaussian prior on the anchors.
    :type anchor_prior_scale: float or None
    :param str warmup_anchors: ``"conditional"`` (default: anchors drawn from their conditional during warm-up,
        see the module docstring) or ``"joint"`` (the paper's joint step during warm-up too).
    :param kwargs: the options of every kernel (:class:`~pyro_flat.infer.mcmc.StochasticGradientKernel`):
        ``step_size`` (:math:`\varepsilon`, required), ``temperature`` (:math:`T`), ``init_strategy`` (anchors copy
        their site), ``thinning``, ``divergence_check_every``, ``jit_compile`` (captures the model's potential with
        the coupling), ``jit_options``.

    .. warning:: Like SGLD, biased at a finite step size. The coupling adds the stiffness :math:`1/\eta`: keep
        :math:`\varepsilon < \eta` (the chain on :math:`(\theta,\theta_a)` is unstable for
        :math:`\varepsilon \gtrsim \eta`).

    Example::

        kernel = EntropyMCMC(model, eta=1e-3, step_size=1e-5, collect="both", init_strategy=init_to_network(model))
        mcmc = MCMC(kernel, num_samples=50, warmup_steps=500)
        mcmc.run(x_train, y_train, subsample_size=128)
        draws = local_entropy_draws(mcmc.get_samples(), "both")      # 100 draws keyed by the model's site names
        logits = Predictive(model, posterior_samples=draws)(x_test)["logits"]

    References:
        * [1] `Entropy-MCMC: Sampling from Flat Basins with Ease`, Bolian Li, Ruqi Zhang (ICLR 2024), arXiv:2310.05401
    """

    def __init__(
        self,
        model: Callable | None = None,
        potential_fn: Callable[[Params], Tensor] | None = None,
        *,
        eta: float,
        collect: Literal["theta", "anchor", "both"] = "theta",
        anchor_prior_scale: float | None = None,
        warmup_anchors: Literal["conditional", "joint"] = "conditional",
        **kwargs: Any,
    ) -> None:
        self.eta = check_positive(eta, "eta", owner="EntropyMCMC")
        if collect not in ("theta", "anchor", "both"):
            raise ValueError(f"EntropyMCMC: expected collect in 'theta', 'anchor', 'both', got {collect!r}")
        if warmup_anchors not in ("conditional", "joint"):
            raise ValueError(f"EntropyMCMC: expected warmup_anchors in 'conditional', 'joint', got {warmup_anchors!r}")
        self.collect = collect
        self.warmup_anchors = warmup_anchors
        self.anchor_warmup_steps: int | None = None
        self.base_model = model
        flat_model = None if model is None else local_entropy(model, self.eta, anchor_prior_scale=anchor_prior_scale)
        self.anchor_prior_scale = check_positive(anchor_prior_scale, "anchor_prior_scale", owner="EntropyMCMC",
                                                 allow_none=True)
        if potential_fn is not None and anchor_prior_scale is not None:
            raise ValueError("EntropyMCMC: anchor_prior_scale is only supported with a model, not with potential_fn")
        flat_potential = None if potential_fn is None else local_entropy_potential(potential_fn, self.eta)
        self._base_potential = potential_fn
        self._sites: list[str] = []
        super().__init__(flat_model, flat_potential, **kwargs)

    def _initialize_model(
        self, args: tuple, kwargs: dict
    ) -> tuple[Params, Callable[[Params], Tensor], dict[str, Transform]]:
        init, potential, transforms = initialize_sg_model(self.base_model, args, kwargs, self.init_strategy)
        params, all_transforms = {}, {}
        for name, value in init.items():  # the transformed model's site order: each site, then its anchor
            params[name], all_transforms[name] = value, transforms[name]
            params[anchor_name(name)] = value.detach().clone()  # unconstrained, like the site's
            all_transforms[anchor_name(name)] = transforms[name]  # the anchor has the site's support
        coupled = CoupledPotential(potential, self.eta, self.anchor_prior_scale)
        self._base_potential = potential
        return params, coupled, all_transforms

    def _setup_chain(self, params: Params) -> None:
        self._sites = [k for k in params if not k.endswith(ANCHOR_SUFFIX)]

    def _transition(self, params: Params) -> Params:
        t = self._state.step
        params = super()._transition(params)
        warmup = self._warmup_steps if self.anchor_warmup_steps is None else self.anchor_warmup_steps
        if self.warmup_anchors == "conditional" and self._state.num_calls <= warmup:
            temperature = self.temperature if self.schedule.injects_noise(t) else 0.0
            params = self._conditional_anchors(params, temperature)
        return params

    def _conditional_anchors(self, params: Params, temperature: float) -> Params:
        """The anchors drawn from their exact conditional given the sites (see the class docstring)."""
        params = dict(params)
        eta, scale = self.eta, self.anchor_prior_scale
        shrink = 1.0 if scale is None else scale**2 / (scale**2 + eta)
        std = math.sqrt(temperature * eta * shrink)
        for name in self._sites:
            mean = shrink * params[name]
            params[anchor_name(name)] = mean + std * torch.randn_like(mean) if std > 0 else mean
        return params

    def _gradient(self, params: Mapping[str, Tensor]) -> tuple[Params, Tensor]:
        """``(grad U_eta, U_eta)``: autograd through the model's potential only; the coupling and the anchor prior
        are added analytically (all in unconstrained coordinates), which saves passes over both copies of the
        weights."""
        eta, scale = self.eta, self.anchor_prior_scale
        leaves = {k: params[k].detach().requires_grad_(True) for k in self._sites}
        with torch.enable_grad():
            energy = self._base_potential(leaves)
            values = torch.autograd.grad(energy, list(leaves.values()), materialize_grads=True)
        grads = dict(zip(leaves, values, strict=True))
        energy = energy.detach()
        for name in self._sites:
            key = anchor_name(name)
            diff = params[name] - params[key]
            pull = diff / eta
            grads[name] = grads[name] + pull
            grads[key] = -pull
            energy = energy + diff.pow(2).sum() / (2 * eta)
            if scale is not None:
                anchor = params[key]
                grads[key] = grads[key] + anchor / scale**2
                normaliser = anchor.numel() * (math.log(scale) + 0.5 * math.log(2 * math.pi))
                energy = energy + anchor.pow(2).sum() / (2 * scale**2) + normaliser
        return grads, energy

    def _complete_initial_params(self, params: Params) -> Params:
        params = dict(params)
        for name in [k for k in params if not k.endswith(ANCHOR_SUFFIX)]:
            key = anchor_name(name)
            if key not in params:
                params[key] = params[name].detach().clone()  # unconstrained, like the site's
        return params

    def _default_save_params(self) -> list[str] | None:
        if self._initial_params is None:
            return None
        names = list(self._initial_params)
        if self.collect == "theta":
            return [k for k in names if not k.endswith(ANCHOR_SUFFIX)]
        if self.collect == "anchor":
            return [k for k in names if k.endswith(ANCHOR_SUFFIX)]
        return names
