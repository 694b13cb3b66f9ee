r"""The KL-ball adversarial ELBO of SA-BMA: perturb the *guide's parameters* inside a KL ball before the data term.

SA-BMA [1] seeks a flat posterior by minimising the worst-case expected loss over all guides within a KL ball
around the current one,

.. math:: \min_\phi\ \max_{\phi'\,:\ \mathrm{KL}(q_{\phi'}\|q_\phi)\le\gamma}\
    \mathbb E_{\theta\sim q_{\phi'}}\big[-\log p(\mathcal D\mid\theta)\big]
    \;+\; \beta\,\mathrm{KL}\big(q_\phi\,\|\,p\big),

where :math:`q_\phi` is the guide (parameters :math:`\phi`, the tensors Pyro's optimiser updates), :math:`p` the
prior, :math:`\gamma` the radius (nats) and :math:`\beta` ``kl_weight``. The inner maximum is replaced by one
linearised step (see :mod:`pyro_flat.ops.fisher`):

.. math:: \delta^* = \sqrt{2\gamma}\;\frac{F_\phi^{-1} g}{\sqrt{g^\top F_\phi^{-1} g}},\qquad
    g = \nabla_\phi\, \big[-\log p(\mathcal D_B\mid\theta)\big]_{\theta = f_\phi(\epsilon)},

with :math:`F_\phi` the Fisher of the guide with respect to its own parameters, :math:`f_\phi(\epsilon)` the
reparameterised draw and :math:`\mathcal D_B` the minibatch (log-likelihood scaled by :math:`N/B` by the model's
``pyro.plate``).

References:
    [1] `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
        Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from pyro import poutine
from pyro.distributions.transforms import Transform
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoNormal
from pyro.infer.util import is_validation_enabled, torch_item
from pyro.nn import PyroModule
from pyro.poutine.util import prune_subsample_sites, site_is_subsample
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape, warn_if_nan
from torch import Tensor, nn
from torch.distributions import transform_to

from ...distributed import all_reduce_mean, check_distributed
from ...ops.fisher import (
    diagonal_gaussian_inverse_fisher_product,
    kl_ball_step,
    low_rank_gaussian_inverse_fisher_product,
    normalized_score_step,
)
from ...ops.sam import check_radius

__all__ = ["KLBallELBO"]

SUPPORTED_GUIDES = (
    "pyro.infer.autoguide.AutoNormal, pyro.infer.autoguide.AutoDiagonalNormal and "
    "pyro.infer.autoguide.AutoLowRankMultivariateNormal (also its subclass "
    "pyro_flat.infer.autoguide.AutoLowRankPlusDiagonalNormal, which starts from SWAG)"
)
DIRECTIONS = ("fisher", "normalized_score")


@dataclass(frozen=True)
class _GaussianBlock:
    """The names of the param sites of one Gaussian of a guide: mean, scale and (low-rank guides) factor."""

    loc: str
    scale: str
    factor: str | None = None


def _check_guide(guide: object) -> None:
    if not isinstance(guide, (AutoNormal, AutoDiagonalNormal, AutoLowRankMultivariateNormal)):
        raise ValueError(
            f"KLBallELBO needs the closed-form Fisher of the guide and supports the guides {SUPPORTED_GUIDES}; got "
            f"{type(guide).__name__}"
        )


def _guide_blocks(guide: AutoNormal | AutoDiagonalNormal | AutoLowRankMultivariateNormal) -> list[_GaussianBlock]:
    prefix = guide._pyro_name
    if isinstance(guide, AutoLowRankMultivariateNormal):
        return [_GaussianBlock(f"{prefix}.loc", f"{prefix}.scale", f"{prefix}.cov_factor")]
    if isinstance(guide, AutoDiagonalNormal):
        return [_GaussianBlock(f"{prefix}.loc", f"{prefix}.scale")]
    return [
        _GaussianBlock(f"{prefix}.locs.{name}", f"{prefix}.scales.{name}")
        for name, _ in guide.prototype_trace.iter_stochastic_nodes()
    ]


def _rng_state() -> tuple[Tensor, list[Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, list[Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _unconstrained(value: Tensor) -> Tensor:
    """The tensor the optimiser updates behind a param site's value (a plain ``nn.Parameter`` is its own)."""
    unconstrained = getattr(value, "unconstrained", None)
    return value if unconstrained is None else unconstrained()


@contextmanager
def _plain_parameters_swapped(guide: PyroModule, values: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
    """Temporarily put ``values`` in place of the guide's plain ``nn.Parameter`` attributes with those names, and yield
    the remaining values (those of ``PyroParam`` s, for ``poutine.substitute``).

    Pyro routes a ``PyroParam`` through ``pyro.param``, whose value handlers may replace, but it returns a plain
    ``nn.Parameter`` attribute (e.g. ``AutoDiagonalNormal.loc``) itself, ignoring any handler; those are swapped in
    the module for the duration of the perturbed pass instead (never mutated in place, so the first pass's autograd
    graph stays valid).
    """
    swapped = []
    try:
        for module in guide.modules():
            if not isinstance(module, PyroModule):
                continue
            for name in list(module._parameters):
                if name.endswith("_unconstrained") and name[: -len("_unconstrained")] in module._pyro_params:
                    continue  # the storage of a PyroParam
                full_name = module._pyro_get_fullname(name)
                if full_name in values:
                    swapped.append((module, name, module._parameters[name], full_name))
                    module._parameters[name] = values[full_name]
        done = {full_name for *_, full_name in swapped}
        yield {name: value for name, value in values.items() if name not in done}
    finally:
        for module, name, original, _ in swapped:
            module._parameters[name] = original


@contextmanager
def _batchnorm_statistics_frozen(model: object) -> Iterator[None]:
    """The BatchNorm layers of ``model`` (when it is an ``nn.Module``) keep their running statistics during the
    perturbed pass: momentum 0 (as SAM implementations do), and ``num_batches_tracked`` restored afterwards."""
    layers = []
    if isinstance(model, nn.Module):
        layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [(m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in layers]
    try:
        for layer in layers:
            layer.momentum = 0.0
        yield
    finally:
        for layer, momentum, tracked in saved:
            layer.momentum = momentum
            if tracked is not None:
                layer.num_batches_tracked.copy_(tracked)


def _subsample_sites(trace: poutine.Trace) -> poutine.Trace:
    """A copy of ``trace`` with only its subsample sites (the minibatch indices drawn by subsampled plates)."""
    kept = trace.copy()
    for name, site in list(kept.nodes.items()):
        if not site_is_subsample(site):
            kept.remove_node(name)
    return kept


@dataclass
class _FirstPass:
    """The unperturbed pass of one particle: its terms, its parameters and what the perturbed pass must replay."""

    data_term: Tensor  # -log p(D_B | theta), scaled by the plates
    regulariser: Tensor  # log q(theta) - log p(theta)
    params: dict[str, Tensor]  # constrained values of the guide's param sites
    guide_trace: poutine.Trace
    guide_subsample: poutine.Trace
    model_subsample: poutine.Trace


class KLBallELBO(Trace_ELBO):
    r"""SA-BMA's KL-ball adversarial ELBO [1], a :class:`~pyro.infer.Trace_ELBO` subclass that ``SVI.step`` uses
    unchanged.

    The negative objective, per particle, is

    .. math:: \mathcal L(\phi) = -\log p\big(\mathcal D_B \mid f_{\phi+\delta^*}(\epsilon)\big)
        + \beta\,\big[\log q_\phi(f_\phi(\epsilon)) - \log p(f_\phi(\epsilon))\big],

    i.e. the data term at the perturbed guide :math:`\phi' = \phi + \delta^*` and the KL/prior term at the unperturbed
    :math:`\phi`, both with the **same base noise** :math:`\epsilon` and the **same minibatch**. :math:`\delta^*` is
    a constant (no gradient flows through it), so the gradient is that of the data term taken at :math:`\phi'` and
    applied at :math:`\phi`, as in SAM. One step costs two forward and two backward passes of the model.

    Directions (``direction``):

    * ``"fisher"`` (default, the paper's update): :math:`\delta^* = \sqrt{2\gamma}\,F^{-1}g/\sqrt{g^\top F^{-1}g}`
      with :math:`g` the gradient of the data term at :math:`\phi` and :math:`F` the Fisher of the guide in the
      parameters actually optimised (the unconstrained, e.g. softplus-inverse, scale). Closed form for
      ``AutoNormal`` / ``AutoDiagonalNormal`` (exact: :math:`F_m = 1/s^2`, :math:`F_u = 2T'(u)^2/s^2`), so
      :math:`\mathrm{KL}(q_{\phi'}\|q_\phi) = \gamma + O(\gamma^{3/2})`; for the low-rank-plus-diagonal guide
      (``AutoLowRankMultivariateNormal`` and its SWAG-initialised subclass
      :class:`~pyro_flat.infer.autoguide.AutoLowRankPlusDiagonalNormal`) exact in the mean (:math:`F_m^{-1} =
      \Sigma`) and the Fisher of the augmented sampling process in the scale and factor, an upper bound of the true
      Fisher, so :math:`\mathrm{KL}(q_{\phi'}\|q_\phi) \le \gamma` to second order (:mod:`pyro_flat.ops.fisher`).
    * ``"normalized_score"`` — **the variant of the authors' released code** (github.com/SungJun98/SA-BMA,
      ``SABMA_optim.first_step``), not the paper's update: :math:`\delta_k = \sqrt{2\gamma}\,s_k/\|s_k\|_2` for
      each block :math:`k` (all means, all scales, all factors) of the score :math:`s=\nabla_\phi\log
      q_\phi(\theta)` at the sampled :math:`\theta`. It ignores the loss, so it is a random rather than an
      adversarial perturbation; it is offered to reproduce the published numbers.

    Special cases [derived]: with ``radius=0`` and ``kl_weight=1`` the loss and gradients are those of
    ``Trace_ELBO`` (same seed); for a guide with fixed isotropic scale :math:`s` and only the mean learned,
    :math:`\delta^* = s\sqrt{2\gamma}\,g/\|g\|_2`, SAM's normalised gradient with radius :math:`s\sqrt{2\gamma}`.

    Parameters held fixed (``requires_grad=False`` on the unconstrained tensor, e.g. a frozen scale) are not part of
    :math:`\phi`: they are neither perturbed nor counted in the Fisher normalisation. Parameters of the *model*
    (``pyro.param`` sites outside the guide) are never perturbed.

    :param float radius: the KL radius :math:`\gamma \ge 0` in nats (required). For the ``"normalized_score"``
        direction every block moves by :math:`\rho=\sqrt{2\gamma}` in Euclidean norm (the code's ``rho``; the
        authors' README uses :math:`\rho = 0.5`, i.e. :math:`\gamma = 0.125`).
    :param str direction: ``"fisher"`` (default, the paper) or ``"normalized_score"`` (the authors' code).
    :param float kl_weight: :math:`\beta \ge 0`, the weight of :math:`\log q - \log p` (default 1, the ELBO, so
        that the guide approximates a Bayesian posterior and ``radius=0`` is ``Trace_ELBO``). The authors' code
        defaults to :math:`\beta = 0` (``kl_eta``), which drops the prior and the entropy: the scales then shrink
        towards a point mass unless training stops early.
    :param trace_elbo_kwargs: passed to :class:`~pyro.infer.Trace_ELBO` (``num_particles``, ``max_plate_nesting``,
        ``vectorize_particles``, ``retain_graph``). With ``vectorize_particles=True`` one perturbation is computed
        from the gradient summed over the vectorised particles; otherwise each particle has its own.
    :param bool distributed: data-parallel training (:mod:`pyro_flat.distributed`): the data-term gradient :math:`g`
        of the Fisher direction is averaged over the ranks before :math:`\delta^*` is formed, so every rank perturbs
        by the ascent of the combined batch; default ``False``. (The normalised score does not depend on the data:
        it is the same on every rank without communication.)
    :param process_group: the process group of ``distributed`` (default ``None``: the world).

    Supported guides: :class:`~pyro.infer.autoguide.AutoNormal`, :class:`~pyro.infer.autoguide.AutoDiagonalNormal`
    and :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`, including its subclass
    :class:`~pyro_flat.infer.autoguide.AutoLowRankPlusDiagonalNormal` (any other guide is a ``ValueError``).

    .. note:: BatchNorm layers of the model (when the model is an ``nn.Module``) do not update their running
        statistics in the perturbed pass (momentum 0 for that pass, as in SAM implementations).

    .. note:: The same base noise is obtained by replaying the random-number generator: the state before the guide's
        first pass is restored for the perturbed pass (and the state after the first pass is restored afterwards,
        so the random stream continues exactly as under ``Trace_ELBO``). The minibatch indices of subsampled plates
        are replayed explicitly from the first pass. Other randomness inside the *model* (e.g. dropout masks) is
        redrawn in the perturbed pass when the model also subsamples.

    .. warning:: Every entry point, ``loss`` (and ``SVI.evaluate_loss``) included, needs one gradient evaluation to
        find :math:`\delta^*`; the first pass therefore runs with autograd enabled even under ``torch.no_grad()``.

    Example::

        guide = AutoNormal(model, init_loc_fn=init_to_network(model))
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss=KLBallELBO(radius=0.05))
        for step in range(1000):
            svi.step(x, y, subsample_size=128)
        probs = Predictive(model, guide=guide, num_samples=30, return_sites=["logits"])(x_test)

    References:
        [1] `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
            Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
        [2] `Sharpness-Aware Minimization for Efficiently Improving Generalization`, Pierre Foret, Ariel Kleiner,
            Hossein Mobahi, Behnam Neyshabur (ICLR 2021), arXiv:2010.01412
    """

    def __init__(
        self,
        radius: float,
        *,
        direction: str = "fisher",
        kl_weight: float = 1.0,
        distributed: bool = False,
        process_group: object | None = None,
        **trace_elbo_kwargs: object,
    ) -> None:
        self.radius = check_radius(radius, "radius")
        if not isinstance(distributed, bool):
            raise ValueError(f"`distributed` must be a bool, got {distributed!r}")
        self.distributed, self.process_group = distributed, process_group
        if direction not in DIRECTIONS:
            raise ValueError(f"`direction` must be one of {DIRECTIONS}, got {direction!r}")
        if isinstance(kl_weight, bool) or not (isinstance(kl_weight, (int, float)) and 0 <= kl_weight < math.inf):
            raise ValueError(f"`kl_weight` must be a finite number >= 0, got {kl_weight!r}")
        self.direction = direction
        self.kl_weight = float(kl_weight)
        super().__init__(**trace_elbo_kwargs)

    # ---------------------------------------------------------------------------------------------------------------
    # the two passes of one particle

    def _first_pass(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> _FirstPass:
        guide_trace = poutine.trace(guide, graph_type="flat").get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace), graph_type="flat").get_trace(
            *args, **kwargs
        )
        if is_validation_enabled():
            check_model_guide_match(model_trace, guide_trace, self.max_plate_nesting)
            check_if_enumerated(guide_trace)
        guide_subsample, model_subsample = _subsample_sites(guide_trace), _subsample_sites(model_trace)
        guide_trace, model_trace = prune_subsample_sites(guide_trace), prune_subsample_sites(model_trace)
        model_trace.compute_log_prob()
        guide_trace.compute_log_prob()
        data_term, regulariser, observed = 0.0, 0.0, False
        for site in model_trace.nodes.values():
            if site["type"] != "sample":
                continue
            if is_validation_enabled():
                check_site_shape(site, self.max_plate_nesting)
            if site["is_observed"]:
                data_term, observed = data_term - site["log_prob_sum"], True
            else:
                regulariser = regulariser - site["log_prob_sum"]
        if not observed:
            raise ValueError("KLBallELBO: the model has no observed sample site, so there is no data term to perturb")
        for site in guide_trace.nodes.values():
            if site["type"] == "sample":
                regulariser = regulariser + site["log_prob_sum"]
        params = {name: site["value"] for name, site in guide_trace.nodes.items() if site["type"] == "param"}
        return _FirstPass(data_term, regulariser, params, guide_trace, guide_subsample, model_subsample)

    def _leaves(self, guide: object, first: _FirstPass) -> tuple[list[_GaussianBlock], dict[str, Tensor]]:
        """The guide's Gaussian blocks and the unconstrained tensors :math:`\\phi` that require a gradient."""
        blocks = _guide_blocks(guide)
        leaves = {}
        for block in blocks:
            for name in (block.loc, block.scale, block.factor):
                if name is None:
                    continue
                if name not in first.params:
                    raise ValueError(f"KLBallELBO: the guide did not emit the parameter {name!r}")
                leaf = _unconstrained(first.params[name])
                if leaf.requires_grad:
                    leaves[name] = leaf
        if not leaves:
            raise ValueError("KLBallELBO: no parameter of the guide requires a gradient; there is nothing to perturb")
        return blocks, leaves

    def _fisher_perturbation(
        self, blocks: list[_GaussianBlock], leaves: dict[str, Tensor], first: _FirstPass, scale_transform: Transform
    ) -> dict[str, Tensor]:
        names = list(leaves)
        grads = torch.autograd.grad(first.data_term, [leaves[n] for n in names], retain_graph=True, allow_unused=True)
        grad = {n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, grads, strict=True)}
        if self.distributed:  # the ascent of the combined batch: the same perturbation on every rank
            check_distributed("KLBallELBO")
            grad = dict(zip(names, all_reduce_mean([grad[n] for n in names], self.process_group), strict=True))
        if is_validation_enabled():
            for name in names:
                if not bool(torch.isfinite(grad[name]).all()):
                    raise FloatingPointError(
                        f"KLBallELBO: the gradient of the data term with respect to the guide parameter {name!r} is "
                        "not finite; the model's log-likelihood diverged at the current guide parameters"
                    )
        ordered_grads, ordered_directions, ordered_names = [], [], []
        for block in blocks:
            scale = first.params[block.scale].detach()
            raw_scale = _unconstrained(first.params[block.scale]).detach()
            scale_derivative = scale_transform.log_abs_det_jacobian(raw_scale, scale).exp()
            g_loc, g_scale = grad.get(block.loc), grad.get(block.scale)
            if block.factor is None:
                parts = diagonal_gaussian_inverse_fisher_product(g_loc, g_scale, scale, scale_derivative)
                block_names = (block.loc, block.scale)
            else:
                factor = first.params[block.factor].detach()
                parts = low_rank_gaussian_inverse_fisher_product(
                    g_loc, g_scale, grad.get(block.factor), scale, scale_derivative, factor
                )
                block_names = (block.loc, block.scale, block.factor)
            for name, direction in zip(block_names, parts, strict=True):
                if direction is not None:
                    ordered_names.append(name)
                    ordered_grads.append(grad[name])
                    ordered_directions.append(direction)
        steps = kl_ball_step(ordered_grads, ordered_directions, self.radius)
        return dict(zip(ordered_names, steps, strict=True))

    def _score_perturbation(
        self, blocks: list[_GaussianBlock], leaves: dict[str, Tensor], first: _FirstPass
    ) -> dict[str, Tensor]:
        log_q = sum(
            site["fn"].log_prob(site["value"].detach()).sum()
            for site in first.guide_trace.nodes.values()
            if site["type"] == "sample" and site["infer"].get("is_auxiliary", False)
        )
        names = list(leaves)
        scores = torch.autograd.grad(log_q, [leaves[n] for n in names], retain_graph=True, allow_unused=True)
        score = {n: torch.zeros_like(leaves[n]) if s is None else s for n, s in zip(names, scores, strict=True)}
        roles = [[getattr(b, role) for b in blocks] for role in ("loc", "scale", "factor")]
        roles = [[n for n in members if n in leaves] for members in roles]
        roles = [members for members in roles if members]
        steps = normalized_score_step([[score[n] for n in members] for members in roles], self.radius)
        return {n: s for members, block in zip(roles, steps, strict=True) for n, s in zip(members, block, strict=True)}

    def _perturbation(self, guide: object, first: _FirstPass) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        blocks, leaves = self._leaves(guide, first)
        if self.direction == "fisher":
            delta = self._fisher_perturbation(blocks, leaves, first, transform_to(guide.scale_constraint))
        else:
            delta = self._score_perturbation(blocks, leaves, first)
        return leaves, delta

    def _perturbed_values(self, guide: object, leaves: dict[str, Tensor], delta: dict[str, Tensor]) -> dict:
        """Constrained values of the perturbed parameters, differentiable in the unconstrained tensors."""
        scale_names = {block.scale for block in _guide_blocks(guide)}
        scale_transform = transform_to(guide.scale_constraint)
        values = {}
        for name, leaf in leaves.items():
            shifted = leaf + delta[name]
            value = scale_transform(shifted) if name in scale_names else shifted
            value.unconstrained = weakref.ref(leaf)  # what SVI.step reads from the param sites it captures
            values[name] = value
        return values

    def _particle_loss(
        self, model: Callable, guide: Callable, model_object: object, guide_object: object, args: tuple, kwargs: dict
    ) -> Tensor:
        """The differentiable loss of one particle (its value is the loss; all supported guides are reparameterised)."""
        state_before = _rng_state()
        with torch.enable_grad():  # delta* needs a gradient even under torch.no_grad() (SVI.evaluate_loss)
            first = self._first_pass(model, guide, args, kwargs)
            leaves, delta = self._perturbation(guide_object, first)
        state_after = _rng_state()
        _set_rng_state(state_before)  # the same base noise for the perturbed guide
        try:
            values = self._perturbed_values(guide_object, leaves, delta)
            with _plain_parameters_swapped(guide_object, values) as param_values:
                perturbed_guide = poutine.substitute(guide, data=param_values)
                perturbed_guide = poutine.replay(perturbed_guide, trace=first.guide_subsample)
                guide_trace = poutine.trace(perturbed_guide, graph_type="flat").get_trace(*args, **kwargs)
            replayed_model = poutine.replay(poutine.replay(model, trace=first.model_subsample), trace=guide_trace)
            with _batchnorm_statistics_frozen(model_object):
                model_trace = poutine.trace(replayed_model, graph_type="flat").get_trace(*args, **kwargs)
        finally:
            _set_rng_state(state_after)
        model_trace = prune_subsample_sites(model_trace)
        model_trace.compute_log_prob(site_filter=lambda _, site: site["is_observed"])
        data_term = -sum(
            site["log_prob_sum"]
            for site in model_trace.nodes.values()
            if site["type"] == "sample" and site["is_observed"]
        )
        return data_term + self.kl_weight * first.regulariser

    def _particle_losses(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> Iterator[Tensor]:
        _check_guide(guide)
        if self.vectorize_particles:
            if self.max_plate_nesting == float("inf"):
                self._guess_max_plate_nesting(model, guide, args, kwargs)
            vectorized = self._vectorized_num_particles(model), self._vectorized_num_particles(guide)
            yield self._particle_loss(*vectorized, model, guide, args, kwargs)
        else:
            for _ in range(self.num_particles):
                yield self._particle_loss(model, guide, model, guide, args, kwargs)

    # ---------------------------------------------------------------------------------------------------------------
    # Pyro's ELBO interface: one code path for all three entry points

    def loss(self, model: Callable, guide: Callable, *args: object, **kwargs: object) -> float:
        """The adversarial negative ELBO estimate (a float), averaged over ``num_particles``."""
        loss = 0.0
        for particle in self._particle_losses(model, guide, args, kwargs):
            loss += torch_item(particle) / self.num_particles
        warn_if_nan(loss, "loss")
        return loss

    def differentiable_loss(self, model: Callable, guide: Callable, *args: object, **kwargs: object) -> Tensor:
        """The adversarial negative ELBO as a differentiable tensor (for ``ELBOModule`` and torch optimisers)."""
        loss = sum(self._particle_losses(model, guide, args, kwargs)) / self.num_particles
        warn_if_nan(loss, "loss")
        return loss

    def loss_and_grads(self, model: Callable, guide: Callable, *args: object, **kwargs: object) -> float:
        """The loss (a float); backpropagates the gradient of each particle into the parameters."""
        loss = 0.0
        for particle in self._particle_losses(model, guide, args, kwargs):
            if particle.requires_grad:
                (particle / self.num_particles).backward(retain_graph=self.retain_graph)
            loss += torch_item(particle) / self.num_particles
        warn_if_nan(loss, "loss")
        return loss

    def perturbation(self, model: Callable, guide: Callable, *args: object, **kwargs: object) -> dict[str, Tensor]:
        """:math:`\\delta^*` for one draw of the guide, as ``{param name: perturbation of its unconstrained tensor}``
        (a diagnostic: the loss methods compute it the same way, once per particle)."""
        _check_guide(guide)
        with torch.enable_grad():
            first = self._first_pass(model, guide, args, kwargs)
            _, delta = self._perturbation(guide, first)
        return delta
