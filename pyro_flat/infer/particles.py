r"""Batched particles: K independent SG-MCMC chains or deep-ensemble members as one vectorised computation.

K particles :math:`\theta_1,\dots,\theta_K` of one Pyro model are stacked along a leading dimension
(``{site: [K, *site_shape]}``, unconstrained coordinates as in :func:`~pyro_flat.infer.mcmc.initialize_sg_model`) and
the potential

.. math:: U(\theta_k) = -\log p(\theta_k) - \log p(\mathcal D_B \mid \theta_k) \;(+\ \text{log-Jacobians}),
    \qquad k = 1..K,

is evaluated for all of them at once by :func:`torch.func.vmap` over the model run conditioned on
:math:`\theta_k` (:class:`~pyro_flat.infer.mcmc.base.ModelPotential`), with its gradient from
:func:`torch.func.grad_and_value`. On a small network, where a step is dominated by per-call overhead (Python,
Pyro's tracing, small kernels), K particles cost much less than K separate steps; on a large network the gain
shrinks to what batching the matrix products gives.

* :class:`BatchedSGLD` — K independent SGLD chains, :math:`\theta_k' = \theta_k - \varepsilon\nabla U(\theta_k) +
  \sqrt{2\varepsilon T}\,\xi_k` (the update of :class:`~pyro_flat.infer.mcmc.SGLD`, :mod:`pyro_flat.ops.diffusions`);
* :class:`BatchedMAP` — K MAP estimates (deep-ensemble members) trained by Adam on :math:`U`, optionally with the SAM
  step (``rho > 0``: each member ascends along its own gradient, one global norm per member), i.e. an F-ensemble.

What the model must allow (``vmap`` traces one Python run for all particles): no data-dependent Python control flow
on the latent values; no random operation inside the model — pass minibatches from outside with ``num_data=N`` (the
model's ``pyro.plate(subsample_size=...)`` draws indices at random, which ``vmap`` refuses), the same minibatch for all
particles at a step; no BatchNorm updates or dropout. Pyro's validation checks (which read values on the host) are
switched off inside the vmapped call. A model that breaks these rules raises a ``ValueError`` saying so; use the
Python loop (``MCMC(num_chains=K)``, or K separate fits) for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pyro
import torch
from torch import Tensor
from torch.distributions.transforms import Transform

from .._validation import check_int, check_real
from ..ops.diffusions import langevin_step
from ..ops.sam import check_radius, sam_perturbation
from .mcmc.base import ModelPotential, initialize_sg_model
from .mcmc.diagnostics import check_mixing

__all__ = ["BatchedMAP", "BatchedPotential", "BatchedSGLD", "init_particles"]

Particles = dict[str, Tensor]


def init_particles(
    models: Sequence[Callable], *args: object, init_strategy: Callable | Sequence[Callable], **kwargs: object
) -> tuple[Particles, dict[str, Transform]]:
    """Stack the initial values of K model instances (e.g. K networks with their own torch initialisation).

    :param models: K instances of one model structure; particle k starts where ``init_strategy[k]`` puts ``models[k]``.
    :param args: the model's positional arguments (one minibatch is enough).
    :param init_strategy: one per-site initialisation function, or one per model (e.g.
        ``[init_to_network(m) for m in models]``).
    :param kwargs: the model's keyword arguments (e.g. ``num_data=N``).
    :returns: ``({site: [K, ...]}`` in unconstrained coordinates, ``{site: transform}``).
    """
    if not models:
        raise ValueError("`models` must hold at least one model instance")
    strategies = list(init_strategy) if isinstance(init_strategy, Sequence) else [init_strategy] * len(models)
    if len(strategies) != len(models):
        raise ValueError(f"got {len(strategies)} init strategies for {len(models)} models")
    inits, transforms = [], {}
    for model, strategy in zip(models, strategies, strict=True):
        params, _, transforms = initialize_sg_model(model, args, kwargs, strategy)
        inits.append(params)
    return {name: torch.stack([p[name] for p in inits]) for name in inits[0]}, transforms


def _check_particles(particles: Mapping[str, Tensor]) -> int:
    if not isinstance(particles, Mapping) or not particles:
        raise ValueError("`particles` must be a non-empty dict {site: tensor [K, ...]}")
    sizes = {v.shape[0] if isinstance(v, Tensor) and v.dim() > 0 else None for v in particles.values()}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every site of `particles` needs the same leading particle dimension K, got {sizes}")
    return sizes.pop()


class BatchedPotential:
    r"""The potential :math:`U(\theta_k)` of a Pyro model for K stacked particles, vectorised with ``torch.func``.

    :param model: the Pyro model (see the module docstring for what ``vmap`` needs).
    :param transforms: ``{site: t}`` to unconstrained coordinates, as returned by :func:`init_particles` (real-valued
        sites may be omitted: identity).
    """

    def __init__(self, model: Callable, transforms: Mapping[str, Transform] | None = None) -> None:
        if not callable(model):
            raise ValueError(f"`model` must be a callable Pyro model, got {type(model).__name__}")
        self.model = model
        self.transforms = dict(transforms or {})

    def _vmapped(self, fn: Callable, particles: Mapping[str, Tensor], args: tuple, kwargs: dict) -> object:
        _check_particles(particles)
        missing = sorted(set(self.transforms) - set(particles))
        if missing:
            raise ValueError(f"`particles` lacks the sites {missing} of the transforms")
        single = ModelPotential(self.model, args, kwargs, self.transforms)
        try:
            with pyro.validation_enabled(False):
                return torch.func.vmap(fn(single))(dict(particles))
        except RuntimeError as error:
            raise ValueError(
                "the model cannot be vectorised over particles with torch.func.vmap "
                f"({str(error).splitlines()[0]}). Requirements: no random operation inside the model (pass "
                "minibatches from outside with num_data=N instead of pyro.plate(subsample_size=...)), no Python "
                "control flow on latent values, no BatchNorm updates or dropout; otherwise use MCMC(num_chains=K) "
                "or a Python loop over members"
            ) from error

    def __call__(self, particles: Mapping[str, Tensor], *args: object, **kwargs: object) -> Tensor:
        """:math:`U(\\theta_k)` for every particle, shape ``[K]``."""
        return self._vmapped(lambda u: u, particles, args, kwargs)

    def value_and_grad(
        self, particles: Mapping[str, Tensor], *args: object, **kwargs: object
    ) -> tuple[Tensor, Particles]:
        """``(U [K], {site: dU/dθ [K, ...]})`` for every particle, one vectorised forward and backward."""
        grads, values = self._vmapped(torch.func.grad_and_value, particles, args, kwargs)
        return values, grads

    def constrained(self, particles: Mapping[str, Tensor]) -> Particles:
        """The particles in the model's (constrained) coordinates."""
        return {n: self.transforms[n].inv(v) if n in self.transforms else v for n, v in particles.items()}


class BatchedSGLD:
    r"""K independent SGLD chains of one Pyro model advanced together:
    :math:`\theta_k' = \theta_k - \varepsilon\,\nabla U(\theta_k) + \sqrt{2\varepsilon T}\,\xi_k`.

    The same update as :class:`~pyro_flat.infer.mcmc.SGLD` (:func:`pyro_flat.ops.diffusions.langevin_step`), with
    independent noise per chain; at a step all chains see the same minibatch (the model's arguments of
    :meth:`step`). Start the chains apart (:func:`init_particles`) for an ensemble of chains.

    :param model: the Pyro model (vmappable, see the module docstring).
    :param particles: the initial values ``{site: [K, ...]}`` in unconstrained coordinates (copied).
    :param float step_size: :math:`\varepsilon > 0` on the full-data potential (a mean-loss learning rate
        :math:`\alpha` is :math:`\varepsilon=\alpha/N`).
    :param float temperature: :math:`T \ge 0` (default 1: the posterior).
    :param transforms: the unconstrained transforms of :func:`init_particles` (default: all sites real-valued).
    :param generator: the random generator of the noise (default: torch's global one).
    """

    def __init__(
        self,
        model: Callable,
        particles: Mapping[str, Tensor],
        step_size: float,
        *,
        temperature: float = 1.0,
        transforms: Mapping[str, Transform] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        check_real(step_size, "step_size", low=0, low_open=True)
        check_real(temperature, "temperature", low=0)
        self.num_chains = _check_particles(particles)
        self.potential = BatchedPotential(model, transforms)
        self.particles = {n: v.detach().clone() for n, v in particles.items()}
        self.step_size, self.temperature, self.generator = float(step_size), float(temperature), generator
        self.last_potential: Tensor | None = None

    def step(self, *args: object, **kwargs: object) -> Particles:
        """One step of every chain on the model's arguments (this step's minibatch); returns the new particles."""
        potential, grads = self.potential.value_and_grad(self.particles, *args, **kwargs)
        for name, value in self.particles.items():
            noise = None
            if self.temperature > 0:
                noise = torch.randn(value.shape, generator=self.generator, dtype=value.dtype, device=value.device)
            self.particles[name] = langevin_step(value, grads[name], self.step_size, self.temperature, noise)
        self.last_potential = potential.detach()
        return self.particles

    def run(
        self,
        num_samples: int,
        batches: Callable[[], tuple[tuple, dict]],
        *,
        warmup_steps: int = 0,
        thinning: int = 1,
    ) -> Particles:
        r"""Run ``warmup_steps`` steps, then keep every ``thinning``-th state ``num_samples`` times.

        :param batches: called once per step, returns the model's ``(args, kwargs)`` (e.g. a random minibatch with
            ``num_data=N``).
        :returns: the draws in constrained coordinates, ``{site: [K, num_samples, ...]}`` (the layout of
            ``MCMC.get_samples(group_by_chain=True)``; flatten the first two dimensions for ``Predictive``). With
            :math:`K\ge2` chains of at least 4 draws, :func:`~pyro_flat.infer.mcmc.check_mixing` warns if their split
            :math:`\hat R` shows that they have clearly not mixed (chains started apart in different modes of a
            network never do: the warning then says that they sample those modes separately).
        """
        for name, value, minimum in (("num_samples", num_samples, 1), ("warmup_steps", warmup_steps, 0),
                                     ("thinning", thinning, 1)):
            check_int(value, name, minimum=minimum)
        for _ in range(warmup_steps):
            args, kwargs = batches()
            self.step(*args, **kwargs)
        draws: list[Particles] = []
        for i in range(num_samples * thinning):
            args, kwargs = batches()
            self.step(*args, **kwargs)
            if (i + 1) % thinning == 0:
                draws.append(self.potential.constrained(self.particles))
        out = {name: torch.stack([d[name] for d in draws], dim=1) for name in draws[0]}
        if self.num_chains >= 2 and num_samples >= 4:
            check_mixing(out)
        return out


class BatchedMAP:
    r"""K MAP estimates (deep-ensemble members) of one Pyro model trained together by Adam on :math:`U(\theta_k)`.

    With ``rho > 0`` each member takes SAM's step [1] on its own potential: the gradient at
    :math:`\theta_k+\rho\,g_k/\|g_k\|_2`, :math:`g_k=\nabla U(\theta_k)`, one global norm over the sites *per member*
    (the whole MAP loss, prior included, as :class:`~pyro_flat.optim.SAM` with a MAP closure), i.e. an F-ensemble.
    Adam acts elementwise, so the members evolve exactly as K separate Adam runs.

    :param model: the Pyro model (vmappable, see the module docstring).
    :param particles: the members' initial values ``{site: [K, ...]}`` in unconstrained coordinates (copied).
    :param float lr: Adam's learning rate on the summed potential (default 1e-3).
    :param float rho: the SAM radius :math:`\rho\ge0` (default 0: plain MAP).
    :param transforms: the unconstrained transforms of :func:`init_particles` (default: all sites real-valued).
    :param optim_kwargs: further ``torch.optim.Adam`` options (``betas``, ``eps``, ``weight_decay``).

    References:
        * [1] `Sharpness-Aware Minimization for Efficiently Improving Generalization`, Pierre Foret, Ariel Kleiner,
          Hossein Mobahi, Behnam Neyshabur (ICLR 2021), arXiv:2010.01412
    """

    def __init__(
        self,
        model: Callable,
        particles: Mapping[str, Tensor],
        lr: float = 1e-3,
        *,
        rho: float = 0.0,
        transforms: Mapping[str, Transform] | None = None,
        **optim_kwargs: object,
    ) -> None:
        self.num_members = _check_particles(particles)
        self.rho = check_radius(rho, "rho")
        self.potential = BatchedPotential(model, transforms)
        self.particles = {n: v.detach().clone().requires_grad_() for n, v in particles.items()}
        self.optimizer = torch.optim.Adam(list(self.particles.values()), lr=lr, **optim_kwargs)

    def step(self, *args: object, **kwargs: object) -> Tensor:
        """One Adam (or SAM-Adam) step of every member on the model's arguments; returns the potentials ``[K]``."""
        current = {n: v.detach() for n, v in self.particles.items()}
        potential, grads = self.potential.value_and_grad(current, *args, **kwargs)
        if self.rho > 0:
            names = list(current)

            def ascent(gs: list[Tensor]) -> list[Tensor]:
                return sam_perturbation(gs, self.rho)

            eps = torch.func.vmap(ascent)([grads[n] for n in names])
            perturbed = {n: current[n] + e for n, e in zip(names, eps, strict=True)}
            _, grads = self.potential.value_and_grad(perturbed, *args, **kwargs)
        for name, value in self.particles.items():
            value.grad = grads[name]
        self.optimizer.step()
        return potential.detach()

    def members(self) -> list[Particles]:
        """The K members as a list of ``{site: value}`` in constrained coordinates (e.g. for
        :func:`pyro_flat.infer.bma_predict`)."""
        constrained = self.potential.constrained({n: v.detach() for n, v in self.particles.items()})
        return [{n: v[k] for n, v in constrained.items()} for k in range(self.num_members)]
