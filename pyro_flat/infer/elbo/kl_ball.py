r"""The KL-ball adversarial ELBO of SA-BMA: perturb the *guide's parameters* inside a KL ball before the data term.

SA-BMA [1] seeks a flat posterior by minimising the worst-case expected loss over all guides within a KL ball
around the current one,

.. math:: \min_\phi\ \max_{\phi'\,:\ \mathrm{KL}(q_{\phi'}\|q_\phi)\le\gamma}\
    \mathbb E_{\theta\sim q_{\phi'}}\big[-\log p(\mathcal D\mid\theta)\big]
    \;+\; \beta\,\mathrm{KL}\big(q_\phi\,\|\,p\big),

where :math:`q_\phi` is the guide (parameters :math:`\phi`: every ``pyro.param`` of the guide, i.e. the tensors
Pyro's optimiser updates, in their unconstrained form), :math:`p` the prior, :math:`\gamma` the radius (nats) and
:math:`\beta` ``kl_weight``. The inner maximum is replaced by one Fisher-preconditioned step
:math:`\delta^*=\sqrt{2\gamma}\,F_\phi^{-1}g/\sqrt{g^\top F_\phi^{-1}g}` along the gradient :math:`g` of the
minibatch negative log-likelihood (log-likelihood scaled by :math:`N/B` by the model's ``pyro.plate``) at the
reparameterised draw :math:`\theta=f_\phi(\epsilon)` (:mod:`pyro_flat.ops.fisher`, where :math:`F_\phi` and
:math:`\delta^*` are written out). :math:`F^{-1}g` is in closed form for Pyro's Gaussian autoguides and found by
conjugate gradients on Fisher-vector products (automatic differentiation of the analytic KL divergence of every guide
site, at the sampled values of its parents) for any other reparameterised guide. Derivation and the guides each
direction accepts: the *SA-BMA* page of the documentation (``docs/methods/kl-ball.md``).

References:
    * [1] `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
      Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoNormal
from pyro.infer.util import is_validation_enabled
from pyro.poutine.guide import GuideMessenger
from pyro.poutine.util import site_is_subsample
from torch import Tensor, nn
from torch.distributions import TransformedDistribution, kl_divergence, transform_to
from torch.distributions.transforms import Transform

from ..._internals import unconstrained_of
from ..._validation import all_true, check_int, check_real
from ...distributed import all_reduce_mean, check_distributed
from ...ops.fisher import (
    conjugate_gradient,
    diagonal_gaussian_inverse_fisher_product,
    kl_ball_step,
    low_rank_gaussian_inverse_fisher_product,
    normalized_score_step,
)
from ...ops.sam import check_radius
from ...runtime.replay import RunRecorder, substituted_tensors
from ...runtime.sites import warn_nothing_to_perturb
from ...transforms.sharpness_aware_model import is_likelihood_site
from .trace_elbo import TensorTrace_ELBO

__all__ = ["KLBallELBO"]

DIRECTIONS = ("fisher", "normalized_score")
FISHER = ("auto", "autodiff")


@dataclass(frozen=True)
class _GaussianBlock:
    """The unconstrained tensors of one Gaussian of a Pyro autoguide: mean, scale and (low-rank guides) factor."""

    loc: Tensor
    scale: Tensor
    factor: Tensor | None = None


def _closed_form_blocks(guide: object) -> list[_GaussianBlock] | None:
    """The Gaussian blocks of the autoguides whose Fisher is known in closed form, else ``None``."""
    if isinstance(guide, AutoLowRankMultivariateNormal):
        return [_GaussianBlock(guide.loc, guide.scale_unconstrained, guide.cov_factor)]
    if isinstance(guide, AutoDiagonalNormal):
        return [_GaussianBlock(guide.loc, guide.scale_unconstrained)]
    if isinstance(guide, AutoNormal) and guide.prototype_trace is not None:
        return [
            _GaussianBlock(
                attrgetter(f"{name}_unconstrained")(guide.locs), attrgetter(f"{name}_unconstrained")(guide.scales)
            )
            for name, _ in guide.prototype_trace.iter_stochastic_nodes()
        ]
    return None


def _point_mass(fn: dist.Distribution) -> dist.Delta | None:
    """The ``Delta`` inside ``fn`` (through ``Independent``/``Masked``/``Expanded`` wrappers), or ``None``."""
    while hasattr(fn, "base_dist"):
        fn = fn.base_dist
    return fn if isinstance(fn, dist.Delta) else None


def _guide_name(guide: object) -> str:
    return getattr(guide, "__name__", type(guide).__name__)


def _flow_transforms(fn: dist.Distribution) -> list[str]:
    """The names of the transforms that carry the guide's parameters (tensors requiring a gradient) in the
    ``TransformedDistribution`` inside ``fn`` (a normalising flow), or ``[]``."""
    while not isinstance(fn, TransformedDistribution) and hasattr(fn, "base_dist"):
        fn = fn.base_dist
    if not isinstance(fn, TransformedDistribution):
        return []
    return [type(t).__name__ for t in fn.transforms if _carries_parameters(t, set())]


def _carries_parameters(transform: object, seen: set[int]) -> bool:
    if id(transform) in seen:
        return False
    seen.add(id(transform))
    if isinstance(transform, nn.Module):
        return any(p.requires_grad for p in transform.parameters())
    for value in vars(transform).values():
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, Tensor) and v.requires_grad or isinstance(v, Transform) and _carries_parameters(v, seen):
                return True
    return False


def _moving_point_mass(name: str, point: dist.Delta, guide: object) -> ValueError:
    """The refusal of a guide site that is a ``Delta`` moving with the guide's parameters (its parents fixed)."""
    if isinstance(point.log_density, Tensor) and point.log_density.requires_grad:
        return ValueError(
            f"KLBallELBO: guide site {name!r} of {_guide_name(guide)} is a Delta that carries the guide's density: its "
            "value and log-density are functions of the guide's parameters and of parameter-free auxiliary noise "
            "(a map of that noise, as AutoStructured builds). The guide's log-density at a given value, which its KL "
            "divergence and its score need, would take the inverse of that map, which the guide does not provide. "
            "Use a guide whose sites are distributions of the parameters (AutoNormal, AutoMultivariateNormal, "
            "AutoLowRankMultivariateNormal, a hand-written guide)"
        )
    return ValueError(
        f"KLBallELBO: guide site {name!r} is a point mass (Delta) that moves with the guide's parameters; a point "
        "mass has no KL ball"
    )


def _guide_parameters(guide_trace: poutine.Trace) -> dict[str, Tensor]:
    """:math:`\\phi`: the unconstrained tensors behind the guide's param sites that require a gradient."""
    leaves = {}
    for name, site in guide_trace.nodes.items():
        if site["type"] == "param":
            value = site["value"]
            unconstrained = unconstrained_of(value)
            leaf = value if unconstrained is None else unconstrained
            if leaf is not None and leaf.requires_grad:
                leaves[name] = leaf
    return leaves


@dataclass
class _FirstPass:
    r"""One particle's first pass, from which a direction computes :math:`\delta^*`: the guide's parameters
    :math:`\phi` (``leaves``), the two traces, their recording (for replays), the guide as it ran (vectorised
    particles wrap it) and as it was given (its class decides the closed forms; errors name it), and the model's
    arguments."""

    leaves: dict[str, Tensor]
    model_trace: poutine.Trace
    guide_trace: poutine.Trace
    run: RunRecorder
    guide: Callable
    given: object
    args: tuple
    kwargs: dict

    def guide_at_sample(self, constants: dict[str, Tensor] | None = None) -> poutine.Trace:
        r"""The guide run again with every latent value fixed at the first pass's (detached) sample and the subsample
        indices replayed: its sites' distributions are :math:`q_\phi(\cdot\mid\text{parents})` at those values,
        functions of :math:`\phi` only — or constants, with ``constants`` (the parameters, detached, in their
        place)."""
        fixed = {name: site["value"].detach() for name, site in _latent_guide_sites(self.guide_trace)}
        detached = [] if constants is None else [(leaf, leaf.detach()) for leaf in constants.values()]
        with self.run.replay(values=fixed), substituted_tensors(detached):
            return poutine.trace(self.guide).get_trace(*self.args, **self.kwargs)


def _latent_guide_sites(trace: poutine.Trace) -> Iterator[tuple[str, dict]]:
    for name, site in trace.nodes.items():
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site):
            yield name, site


class KLBallELBO(TensorTrace_ELBO):
    r"""SA-BMA's KL-ball adversarial ELBO [1], a :class:`~pyro.infer.Trace_ELBO` that ``SVI.step`` uses unchanged,
    for any reparameterised guide.

    The negative objective, per particle, is

    .. math:: \mathcal L(\phi) = -\log p\big(\mathcal D_B \mid f_{\phi+\delta^*}(\epsilon)\big)
        + \beta\,\big[\log q_\phi(f_\phi(\epsilon)) - \log p(f_\phi(\epsilon))\big]

    (symbols in the module docstring): the data term at the perturbed guide :math:`\phi+\delta^*`, the KL/prior term
    at :math:`\phi`, with the same base noise, minibatch and dropout masks (the perturbed pass replays the first).
    ``radius=0`` with ``kl_weight=1`` is ``Trace_ELBO``, draw for draw; a step costs two model passes.
    ``direction="fisher"`` (default) is the paper's :math:`F^{-1}g` step: exact for ``AutoNormal`` and
    ``AutoDiagonalNormal``, exact in the mean and a dominating Fisher in the scale and factor for the low-rank guides,
    conjugate gradients on Fisher-vector products for any other guide (``fisher="autodiff"`` forces this).
    ``direction="normalized_score"`` is the variant of the authors' released code: a per-block normalised score of
    the guide, which ignores the loss. The SA-BMA page of the documentation has the maths.

    :param float radius: :math:`\gamma\ge0` in nats (required). With ``"normalized_score"`` every block moves by
        :math:`\sqrt{2\gamma}` in Euclidean norm (the code's ``rho``; its README uses 0.5, i.e. :math:`\gamma=0.125`).
    :param str direction: ``"fisher"`` (default) or ``"normalized_score"``.
    :param float kl_weight: :math:`\beta\ge0` (default 1, the ELBO). The authors' code uses 0, which drops the prior
        and the entropy: the scales then shrink towards a point mass unless training stops early.
    :param str fisher: ``"auto"`` (closed form where known, default) or ``"autodiff"`` (always conjugate gradients).
    :param int cg_iterations: conjugate-gradient iterations of the autodiff path (default 20).
    :param float cg_damping: relative damping :math:`\ge0` of the autodiff path (default :math:`10^{-6}`).
    :param bool distributed: data-parallel training (:mod:`pyro_flat.distributed`): :math:`g` is averaged over the
        ranks before :math:`\delta^*` is formed; default ``False``.
    :param process_group: the process group of ``distributed`` (default ``None``: the world).
    :param trace_elbo_kwargs: :class:`~pyro.infer.Trace_ELBO` options. With ``vectorize_particles=True`` one
        perturbation is computed from the gradient summed over the vectorised particles.
    :raises ValueError: for bad options; at the first step, for ``AutoDelta`` (a point mass has no KL ball), a
        guide site without ``rsample``, an enumerated site, or a guide site whose KL divergence has no closed form
        (``"fisher"``; use ``"normalized_score"``). A guide without parameters or a model without observations
        leaves nothing to perturb: the objective is then ``Trace_ELBO``'s, with a
        :class:`~pyro_flat.infer.NothingToPerturbWarning` (once per objective and cause). A model reparameterised by
        ``poutine.reparam`` is perturbed through its new latent sites (the reparameterised site is a deterministic
        record, not data).

    .. note:: Every entry point, ``loss`` (and ``SVI.evaluate_loss``) included, needs one gradient evaluation to find
        :math:`\delta^*`; the first pass runs with autograd enabled even under ``torch.no_grad()``.

    Example::

        guide = AutoNormal(model, init_loc_fn=init_to_network(model))
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss=KLBallELBO(radius=0.05))
        svi.step(x, y, subsample_size=128)
    """

    def __init__(
        self,
        radius: float,
        *,
        direction: str = "fisher",
        kl_weight: float = 1.0,
        fisher: str = "auto",
        cg_iterations: int = 20,
        cg_damping: float = 1e-6,
        distributed: bool = False,
        process_group: object | None = None,
        **trace_elbo_kwargs: object,
    ) -> None:
        self.radius = check_radius(radius, "radius")
        if direction not in DIRECTIONS:
            raise ValueError(f"KLBallELBO: `direction` must be one of {DIRECTIONS}, got {direction!r}")
        if fisher not in FISHER:
            raise ValueError(f"KLBallELBO: `fisher` must be one of {FISHER}, got {fisher!r}")
        check_real(kl_weight, "kl_weight", low=0, owner="KLBallELBO")
        check_int(cg_iterations, "cg_iterations", owner="KLBallELBO")
        check_real(cg_damping, "cg_damping", low=0, owner="KLBallELBO")
        if not isinstance(distributed, bool):
            raise ValueError(f"KLBallELBO: `distributed` must be a bool, got {distributed!r}")
        self.direction, self.fisher = direction, fisher
        self.kl_weight = float(kl_weight)
        self.cg_iterations, self.cg_damping = cg_iterations, float(cg_damping)
        self.distributed, self.process_group = distributed, process_group
        self._guide: object = None
        super().__init__(**trace_elbo_kwargs)

    # ---------------------------------------------------------------------------------------------------------------
    # Trace_ELBO's machinery, with the perturbed data term swapped into the model trace

    def _get_traces(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> Iterator:
        self._check_guide(guide)
        return super()._get_traces(model, guide, args, kwargs)

    def _check_guide(self, guide: Callable) -> None:
        if isinstance(guide, AutoDelta):
            raise ValueError(
                "KLBallELBO: AutoDelta is a point mass, and a point mass has no KL ball (KL(q'||q) is infinite for any "
                "move). Use SharpnessAwareELBO with AutoDelta (that is SAM), or a Gaussian guide with KLBallELBO"
            )
        if isinstance(poutine.unwrap(guide), GuideMessenger):
            raise ValueError(
                f"KLBallELBO: guides that are effect handlers ({type(guide).__name__}) are not supported; use the "
                "equivalent AutoGuide (e.g. AutoNormal for AutoNormalMessenger)"
            )
        self._guide = guide  # the vectorised path wraps the guide; keep the object for the closed-form Fisher

    def _get_trace(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> tuple:
        with torch.enable_grad():  # delta* needs a gradient even under torch.no_grad() (SVI.evaluate_loss)
            first = self._first_pass(model, guide, args, kwargs)
            leaves, model_trace, guide_trace = first.leaves, first.model_trace, first.guide_trace
            observed = any(is_likelihood_site(site) for site in model_trace.nodes.values())
            # no guide parameter, or no data term: the KL ball is a point or nothing depends on it, delta* = 0
            delta = _STEPS[self.direction](self, first) if leaves and observed else {}
        if not (leaves and observed):
            self._warn_nothing_to_perturb(guide, bool(leaves), observed)
        if delta:
            moved = [(leaf, leaf + delta[name]) for name, leaf in leaves.items() if name in delta]
            perturbed = self._perturbed_data_term(model, guide, args, kwargs, first.run, moved)
            for name, site in model_trace.nodes.items():
                if is_likelihood_site(site):
                    model_trace.nodes[name] = perturbed.nodes[name]
        for site in model_trace.nodes.values():  # the prior term: every sample site but the likelihood
            if site["type"] == "sample" and not is_likelihood_site(site) and self.kl_weight != 1.0:
                _scale_site(site, self.kl_weight)
        if self.kl_weight != 1.0:
            for _, site in _latent_guide_sites(guide_trace):
                _scale_site(site, self.kl_weight)
        return model_trace, guide_trace

    def _warn_nothing_to_perturb(self, guide: Callable, parameters: bool, observed: bool) -> None:
        if not observed:
            warn_nothing_to_perturb(self, "no observation", (
                "KLBallELBO: the model observes nothing in this step (no observed sample site: were the "
                "observations, e.g. `y`, passed?), so there is no data term to perturb: the objective is "
                "Trace_ELBO's"))
        else:
            warn_nothing_to_perturb(self, "no parameter", (
                f"KLBallELBO: the guide {getattr(guide, '__name__', type(guide).__name__)} has no parameter that "
                "requires a gradient, so its KL "
                "ball is a single point: the objective is Trace_ELBO's"))

    def _first_pass(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> _FirstPass:
        """``Trace_ELBO``'s traces (with Pyro's own validation first), recorded for the replay, then this ELBO's
        checks."""
        with RunRecorder() as run:
            model_trace, guide_trace = super()._get_trace(model, guide, args, kwargs)
        self._check_traces(model_trace, guide_trace)
        return _FirstPass(_guide_parameters(guide_trace), model_trace, guide_trace, run, guide, self._guide, args,
                          kwargs)

    @staticmethod
    def _perturbed_data_term(
        model: Callable, guide: Callable, args: tuple, kwargs: dict, run: RunRecorder, moved: list
    ) -> poutine.Trace:
        r"""The model run against the guide at :math:`\phi+\delta^*` (``moved``) with the first pass's random numbers
        and subsample indices (Pyro's importance trace, as in ``Trace_ELBO``), only its observed sites scored: the
        prior and guide terms of the loss are the first pass's, at :math:`\phi`."""
        with run.replay(), substituted_tensors(moved):
            guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
            perturbed = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
            perturbed.compute_log_prob(site_filter=lambda _, site: is_likelihood_site(site))
        return perturbed

    def _check_traces(self, model_trace: poutine.Trace, guide_trace: poutine.Trace) -> None:
        for name, site in _latent_guide_sites(guide_trace):
            if not site["fn"].has_rsample:
                raise ValueError(
                    f"KLBallELBO: guide site {name!r} ({type(site['fn']).__name__}) is not reparameterisable; the "
                    "perturbed pass must move the sampled value with the guide's parameters, so every latent site "
                    "of the guide must have rsample (discrete latents must be marginalised or conditioned)"
                )
        for name, site in model_trace.nodes.items():
            if site["type"] == "sample" and site["infer"].get("enumerate"):
                raise ValueError(
                    f"KLBallELBO: model site {name!r} is marked for enumeration ({site['infer']['enumerate']!r}); "
                    "KLBallELBO does not enumerate discrete sites (it is a Trace_ELBO): marginalise it in the model"
                )

    def perturbation(self, model: Callable, guide: Callable, *args: object, **kwargs: object) -> dict[str, Tensor]:
        """:math:`\\delta^*` for one draw of the guide, as ``{param site name: perturbation of its unconstrained
        tensor}`` (a diagnostic: the loss methods compute it the same way, once per particle)."""
        self._check_guide(guide)
        with torch.enable_grad():
            return _STEPS[self.direction](self, self._first_pass(model, guide, args, kwargs))


class _FisherDirection:
    r"""``direction="fisher"``, the paper's :math:`\delta^*` along :math:`F^{-1}g` (:math:`g` the gradient of the
    data term in :math:`\phi`, :math:`F` the guide's Fisher information): in closed form for Pyro's Gaussian
    autoguides (``fisher="auto"``, :mod:`pyro_flat.ops.fisher`), else by conjugate gradient on Fisher-vector
    products of the guide's KL divergence."""

    def __call__(self, elbo: KLBallELBO, first: _FirstPass) -> dict[str, Tensor]:
        names = list(first.leaves)
        data_term = -sum(site["log_prob_sum"] for site in first.model_trace.nodes.values() if is_likelihood_site(site))
        grads = _grads(data_term, [first.leaves[n] for n in names], retain_graph=True)
        if elbo.distributed:  # the ascent of the combined batch: the same perturbation on every rank
            check_distributed("KLBallELBO")
            grads = all_reduce_mean(grads, elbo.process_group)
        if is_validation_enabled():
            finite = [torch.isfinite(g).all() for g in grads]
            if not all_true(finite):
                name = next(n for n, ok in zip(names, finite, strict=True) if not bool(ok))
                raise FloatingPointError(
                    f"KLBallELBO: the gradient of the data term with respect to the guide parameter {name!r} is "
                    "not finite; the model's log-likelihood diverged at the current guide parameters"
                )
        grad = dict(zip(names, grads, strict=True))
        blocks = _closed_form_blocks(first.given) if elbo.fisher == "auto" else None
        if blocks is not None:
            directions = self.closed_form(blocks, first.leaves, grad, first.given)
        else:
            solution = conjugate_gradient(self.fisher_product(first), grads, iterations=elbo.cg_iterations,
                                          damping=elbo.cg_damping)
            directions = dict(zip(names, solution, strict=True))
        ordered = [n for n in names if n in directions]
        steps = kl_ball_step([grad[n] for n in ordered], [directions[n] for n in ordered], elbo.radius)
        return dict(zip(ordered, steps, strict=True))

    @staticmethod
    def closed_form(
        blocks: list[_GaussianBlock], leaves: dict[str, Tensor], grad: dict[str, Tensor], guide: object
    ) -> dict[str, Tensor]:
        """:math:`F^{-1}g` for Pyro's Gaussian autoguides (:mod:`pyro_flat.ops.fisher`)."""
        by_id = {id(leaf): name for name, leaf in leaves.items()}
        scale_transform = transform_to(guide.scale_constraint)
        directions = {}
        for block in blocks:
            loc_name, scale_name = by_id.get(id(block.loc)), by_id.get(id(block.scale))
            factor_name = None if block.factor is None else by_id.get(id(block.factor))
            raw_scale = block.scale.detach()
            scale = scale_transform(raw_scale)
            scale_derivative = scale_transform.log_abs_det_jacobian(raw_scale, scale).exp()
            g_loc, g_scale = grad.get(loc_name), grad.get(scale_name)
            if block.factor is None:
                parts = diagonal_gaussian_inverse_fisher_product(g_loc, g_scale, scale, scale_derivative)
                block_names = (loc_name, scale_name)
            else:
                parts = low_rank_gaussian_inverse_fisher_product(
                    g_loc, g_scale, grad.get(factor_name), scale, scale_derivative, block.factor.detach()
                )
                block_names = (loc_name, scale_name, factor_name)
            for name, direction in zip(block_names, parts, strict=True):
                if name is not None and direction is not None:
                    directions[name] = direction
        return directions

    @staticmethod
    def fisher_product(first: _FirstPass) -> Callable[[list[Tensor]], list[Tensor]]:
        r""":math:`v\mapsto F v`, :math:`F` the Hessian of :math:`\phi'\mapsto\sum_{\text{sites}}
        \mathrm{KL}(q_{\phi'}(z\mid\text{parents})\,\|\,q_\phi(z\mid\text{parents}))` at :math:`\phi'=\phi`, with
        the parents at their sampled values (the guide's Fisher information, by the chain rule of the KL
        divergence)."""
        moved = first.guide_at_sample()
        reference = first.guide_at_sample(constants=first.leaves)
        kl = 0.0
        for name, site in _latent_guide_sites(moved):
            fn = site["fn"]
            point = _point_mass(fn)
            if point is not None:
                if point.v.requires_grad:
                    raise _moving_point_mass(name, point, first.given)
                continue  # a deterministic function of its (fixed) parents: no KL
            flow = _flow_transforms(fn)
            if flow:  # torch's KL of two TransformedDistributions sharing the transforms is their bases' KL: 0 here
                raise ValueError(
                    f"KLBallELBO: guide site {name!r} of {_guide_name(first.given)} is a normalising flow (a "
                    f"TransformedDistribution whose transforms {flow} carry the guide's parameters). The Fisher "
                    "direction needs the KL divergence between two such flows, which has no closed form (torch's "
                    "kl_divergence compares only their base distributions: a zero Fisher, no perturbation). Use "
                    "direction='normalized_score' (it needs the flow's inverse) or a Gaussian guide (AutoNormal, "
                    "AutoMultivariateNormal, AutoLowRankMultivariateNormal)"
                )
            try:
                kl = kl + kl_divergence(fn, reference.nodes[name]["fn"]).sum()
            except NotImplementedError:
                raise ValueError(
                    f"KLBallELBO: guide site {name!r} ({type(fn).__name__}) has no closed-form KL divergence, which "
                    "the Fisher direction needs; use direction='normalized_score'"
                ) from None
        params = list(first.leaves.values())
        gradient = _grads(kl, params, create_graph=True)

        def product(vector: list[Tensor]) -> list[Tensor]:
            inner = sum((f * v).sum() for f, v in zip(gradient, vector, strict=True) if f.requires_grad)
            return _grads(inner, params, retain_graph=True)

        return product


class _NormalizedScoreDirection:
    """``direction="normalized_score"``, the variant of the authors' released code: a per-block normalised score of
    the guide's log-density at its sample (:func:`~pyro_flat.ops.fisher.normalized_score_step`)."""

    def __call__(self, elbo: KLBallELBO, first: _FirstPass) -> dict[str, Tensor]:
        names = list(first.leaves)
        blocks = _closed_form_blocks(first.given) if elbo.fisher == "auto" else None
        # a factorised autoguide's distributions are functions of phi alone: score the first pass's (keeping its
        # graph for the loss); any other guide runs again with its sites' parents at the sampled values
        factorised = _closed_form_blocks(first.given) is not None
        at_sample = first.guide_trace if factorised else first.guide_at_sample()
        log_q = sum(self.log_density_at_sample(name, site, factorised, first.given) for name, site in
                    _latent_guide_sites(at_sample))
        scores = dict(zip(names, _grads(log_q, [first.leaves[n] for n in names], retain_graph=factorised),
                          strict=True))
        roles = self.roles(blocks, first.leaves)
        steps = normalized_score_step([[scores[n] for n in role] for role in roles], elbo.radius)
        return {n: s for role, step in zip(roles, steps, strict=True) for n, s in zip(role, step, strict=True)}

    @staticmethod
    def log_density_at_sample(name: str, site: dict, factorised: bool, guide: object) -> Tensor | float:
        r""":math:`\log q_\phi` of a guide site at its (fixed) sampled value, for the score."""
        fn = site["fn"]
        point = _point_mass(fn)
        if point is not None:
            if not factorised and point.v.requires_grad:
                raise _moving_point_mass(name, point, guide)
            return 0.0  # a deterministic function of its (fixed) parents
        try:
            return fn.log_prob(site["value"].detach()).sum()
        except (KeyError, NotImplementedError):  # e.g. BlockAutoregressive: no inverse outside its cache
            transforms = ", ".join(_flow_transforms(fn)) or type(fn).__name__
            raise ValueError(
                f"KLBallELBO: direction='normalized_score' needs the log-density of guide site {name!r} of "
                f"{_guide_name(guide)} at its sampled value, i.e. the inverse of its transform ({transforms}), "
                "which it does not provide. Use an invertible flow (e.g. AutoIAFNormal) or a Gaussian guide"
            ) from None

    @staticmethod
    def roles(blocks: list[_GaussianBlock] | None, leaves: dict[str, Tensor]) -> list[list[str]]:
        """The blocks of the normalised score: per role (means, scales, factors) for the Gaussian autoguides, else
        one per parameter."""
        if blocks is None:
            return [[name] for name in leaves]
        by_id = {id(leaf): name for name, leaf in leaves.items()}
        roles = [[by_id.get(id(getattr(b, role))) for b in blocks] for role in ("loc", "scale", "factor")]
        return [[n for n in role if n is not None] for role in roles if any(n is not None for n in role)]


_STEPS: dict[str, Callable[[KLBallELBO, _FirstPass], dict[str, Tensor]]] = {
    "fisher": _FisherDirection(),
    "normalized_score": _NormalizedScoreDirection(),
}
r"""How each ``direction`` computes :math:`\delta^*` (its keys are ``DIRECTIONS``)."""


def _grads(output: Tensor | float, inputs: list[Tensor], **kwargs: bool) -> list[Tensor]:
    """``torch.autograd.grad`` with zeros for inputs that do not reach ``output``."""
    if not isinstance(output, Tensor) or not output.requires_grad:
        return [torch.zeros_like(t) for t in inputs]
    grads = torch.autograd.grad(output, inputs, allow_unused=True, **kwargs)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)]


def _scale_site(site: dict, weight: float) -> None:
    """Multiply a traced sample site's log-density terms by ``weight`` (:math:`\\beta`)."""
    site["log_prob"] = site["log_prob"] * weight
    site["log_prob_sum"] = site["log_prob_sum"] * weight
    if "unscaled_log_prob" in site:
        site["unscaled_log_prob"] = site["unscaled_log_prob"] * weight
    if "score_parts" in site:
        site["score_parts"] = site["score_parts"].scale_and_mask(weight)
