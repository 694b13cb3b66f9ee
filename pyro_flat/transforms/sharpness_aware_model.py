r"""The sharpness-aware posterior of Flat Seeking BNNs [1] as a Pyro model transform.

For a Pyro model with latent values :math:`\theta` (every latent sample site together), prior :math:`p(\theta)` and
minibatch log-likelihood :math:`\ell_B(\theta)=\sum_{o}\log p(o\mid\theta)` (every observed site :math:`o` of one
model run, with its plate scale :math:`N/B`, so that :math:`\ell_B` estimates the full-data log-likelihood),
:func:`sharpness_aware` returns the Pyro model with the unnormalised density

.. math::

    \tilde p_{\mathrm{SA}}(\theta, \mathcal D_B) = p(\theta)\; \exp\!\big(\ell_B(\theta + \hat\epsilon(\theta))\big),
    \qquad
    \hat\epsilon(\theta) = \rho\, \frac{\hat g}{\|\hat g\|_2},\quad
    \hat g = \operatorname{sg}\!\big[\nabla_\theta\, (-\ell_B(\theta))\big],

where :math:`\rho` is the SAM radius, :math:`\|\cdot\|_2` the *global* L2 norm over all latent sites together (SAM's
ascent, and ASAM's with ``adaptive=True``: :mod:`pyro_flat.ops.sam`, references there), :math:`\mathcal D_B` the
minibatch drawn by the model's own ``pyro.plate(..., subsample_size=B)`` and :math:`\operatorname{sg}` a
stop-gradient. With one SAM step for the inner maximum this is the sharpness-aware posterior
:math:`q_{\mathrm{SA}}(\theta\mid S)\propto\exp(-N\max_{\theta'\in B_\rho(\theta)}L_S(\theta'))\,p(\theta)` of
[1]: SVI with any guide on it is the SA-ELBO, ``AutoDelta`` is SAM (the prior as weight decay), SGLD is F-SGLD.

One call costs two forward and two backward passes, like a SAM step: a **recording pass** in the caller's context
(:math:`\theta` from the enclosing handlers, which record the prior; the observed sites hidden from them;
:math:`\hat g` by autograd through a zero shift of each latent value), then a **perturbed pass** at
:math:`\theta+\hat\epsilon` that replays the first (:mod:`pyro_flat.infer.replay`) and enters the model as the factor
site ``"sharpness_aware_log_likelihood"``. The ascent is taken in each site's unconstrained space. An outer
``pyro.condition`` observes, as if applied inside; latent values are set with
:func:`~pyro_flat.infer.at_latent_values`. A run without an observed or a continuous latent site has nothing to
perturb: the model's own density, with a :class:`~pyro_flat.infer.NothingToPerturbWarning`. LookSAM and RST
(``looksam_k``, ``rst_p``): :mod:`pyro_flat.ops.efficient_sam` (references there). Derivation, the rules for every
outer handler and the cheaper steps' semantics: the *Sharpness-aware posteriors* and *Cheaper steps* pages of the
documentation (``docs/methods/sharpness-aware.md``, ``docs/methods/cheaper-steps.md``).

References:
    * [1] `Flat Seeking Bayesian Neural Networks`, Van-Anh Nguyen, Tung-Long Vuong, Hoang Phan, Thanh-Toan Do,
      Dinh Phung, Trung Le (NeurIPS 2023), arXiv:2302.02713
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import pyro
import torch
from pyro import poutine
from pyro.infer.util import is_validation_enabled
from pyro.poutine.indep_messenger import CondIndepStackFrame
from pyro.poutine.runtime import get_plates
from pyro.poutine.util import site_is_subsample
from torch import Tensor, nn
from torch.distributions import biject_to
from torch.distributions.transforms import Transform

from .._validation import all_true
from ..distributed import all_reduce_mean, check_distributed
from ..ops.efficient_sam import (
    BASE_STEP,
    DEFAULT_LOOKSAM_ALPHA,
    REUSE_STEP,
    SAM_STEP,
    SharpnessSchedule,
    looksam_direction,
    looksam_gradient,
)
from ..ops.sam import check_radius, sam_perturbation
from ..runtime.capture import CaptureError, is_capturing
from ..runtime.replay import RunRecorder
from ..runtime.sites import is_deterministic_site, is_latent_site, is_real_support, warn_nothing_to_perturb
from ._outer import hidden_outside

LOG_LIKELIHOOD_SITE = "sharpness_aware_log_likelihood"
"""Name of the factor site through which the perturbed log-likelihood enters the transformed model."""


def is_likelihood_site(msg: Mapping) -> bool:
    """An observed sample site that is part of the likelihood: not a ``pyro.deterministic`` record or a
    ``poutine.reparam`` site (:func:`~pyro_flat.infer.util.is_deterministic_site`) and not a plate's subsample
    indices (``pyro.factor`` statements count as likelihood)."""
    return (
        msg["type"] == "sample"
        and msg["is_observed"]
        and not site_is_subsample(msg)
        and not is_deterministic_site(msg)
    )


class _RecordingPass(RunRecorder):
    r"""The recording pass (a :class:`~pyro_flat.infer.replay.RunRecorder`) of the transformed model.

    It sorts the model's sample sites: **likelihood** sites, observed by the model itself (hidden from the enclosing
    handlers: they are scored at the perturbed values instead); **latent** sites, sampled by the model and left
    unobserved by the enclosing handlers; and **outer-conditioned** sites, sampled by the model but observed by an
    enclosing ``pyro.condition``: observations too, scored by the enclosing handlers at :math:`\theta` (the
    transform adds the difference to :math:`\theta+\hat\epsilon`). With ``shift`` the model computes with
    :math:`\theta + \delta`, :math:`\delta` a zero leaf per continuous latent site (so that :math:`\nabla_\delta`
    is the gradient in :math:`\theta`),
    while the enclosing handlers record :math:`\theta` (their ``_postprocess_message`` runs before this innermost
    one). Sites hidden by a selective block outside the transform are ignored, as if blocked inside it."""

    def __init__(self, shift: bool, collect_params: bool = False) -> None:
        super().__init__()
        self.shift = shift
        self.collect_params = collect_params
        self.params: dict[int, Tensor] = {}
        self.latents: dict[str, tuple[Tensor, object]] = {}
        self.conditioned: dict[str, dict] = {}
        self.deltas: dict[str, Tensor] = {}
        self.likelihood: dict[str, dict] = {}
        self.discrete: list[str] = []
        self.hidden_observations = False
        self._sampled: set[str] = set()
        self._likelihood_names: set[str] = set()

    def _process_message(self, msg: dict) -> None:
        # runs before the enclosing handlers, which may still observe (condition) or hide (block) the site
        if msg["type"] == "sample" and not site_is_subsample(msg):
            if hidden_outside(self, msg, "sharpness_aware"):  # invisible to the transform, as if blocked inside it
                self.hidden_observations |= is_likelihood_site(msg)  # (e.g. by an autoguide's prototype run)
            elif is_likelihood_site(msg):
                msg["stop"] = True  # the enclosing handlers never see it; it is scored at the perturbed values instead
                self._likelihood_names.add(msg["name"])
            elif is_latent_site(msg):
                self._sampled.add(msg["name"])
        super()._process_message(msg)

    def _postprocess_message(self, msg: dict) -> None:
        super()._postprocess_message(msg)
        name = msg["name"]
        if msg["type"] == "param" and self.collect_params:
            _keep_trainable(self.params, msg["value"])
        if msg["type"] != "sample" or site_is_subsample(msg):
            return
        if name in self._likelihood_names:
            self.likelihood[name] = msg
            return
        if name not in self._sampled:
            return
        value, fn = msg["value"], msg["fn"]
        if msg["is_observed"]:  # by an enclosing condition: an observation, as if conditioned inside
            self.conditioned[name] = {**msg, "value": value}
            return
        if fn.support.is_discrete:
            self.discrete.append(name)
            return
        self.latents[name] = (value, fn)
        if self.shift:
            delta = torch.zeros_like(value, requires_grad=True)
            self.deltas[name] = delta
            msg["value"] = value + delta


def _keep_trainable(params: dict[int, Tensor], value: object) -> None:
    """Keep a parameter's value (by identity) if gradients flow to it."""
    if isinstance(value, Tensor) and value.requires_grad:
        params.setdefault(id(value), value)


def check_options(rho: float, adaptive: bool, freeze_batchnorm: bool, distributed: bool = False) -> float:
    """Validate the options of the sharpness-aware transform and ELBOs; returns ``rho`` as a float."""
    rho = check_radius(rho, "rho")
    for name, flag in (("adaptive", adaptive), ("freeze_batchnorm", freeze_batchnorm), ("distributed", distributed)):
        if not isinstance(flag, bool):
            raise ValueError(f"`{name}` must be a bool, got {flag!r}")
    return rho


def _plate_positions(value: Tensor, event_dim: int, frames: Sequence[CondIndepStackFrame]) -> list[int]:
    batch_dim = value.dim() - event_dim
    positions = [batch_dim + f.dim for f in frames]
    if any(p < 0 for p in positions):
        raise ValueError(
            f"sharpness_aware: a latent value of shape {tuple(value.shape)} lacks the dimensions of the enclosing "
            f"plates {[f.name for f in frames]}"
        )
    return positions


def _per_plate_element(
    fn: Callable[[list[Tensor], list[Tensor]], list[Tensor]],
    grads: list[Tensor],
    params: list[Tensor],
    event_dims: list[int],
    frames: Sequence[CondIndepStackFrame],
) -> list[Tensor]:
    """Apply ``fn`` independently to every element of the enclosing (vectorised) plates, e.g. to every particle of
    ``vectorize_particles=True``: the plate dimensions are moved to the front, flattened, and ``fn`` is vmapped."""
    if not frames:
        return fn(grads, params)
    sizes = [f.size for f in frames]
    count = math.prod(sizes)
    flat_g, flat_p, layouts = [], [], []
    for g, p, event_dim in zip(grads, params, event_dims, strict=True):
        positions = _plate_positions(g, event_dim, frames)
        shape = list(g.shape)
        for pos, size in zip(positions, sizes, strict=True):
            shape[pos] = size
        front = list(range(len(frames)))
        moved_g = g.expand(shape).movedim(positions, front)
        moved_p = p.expand(shape).movedim(positions, front)
        layouts.append((positions, front, moved_g.shape))
        flat_g.append(moved_g.reshape(count, -1))
        flat_p.append(moved_p.reshape(count, -1))
    flat_out = torch.func.vmap(fn)(flat_g, flat_p)
    return [
        out.reshape(moved_shape).movedim(front, positions)
        for out, (positions, front, moved_shape) in zip(flat_out, layouts, strict=True)
    ]


def _sum_to_plates(log_prob: Tensor, frames: Sequence[CondIndepStackFrame]) -> Tensor:
    """Sum ``log_prob`` over every dimension but those of ``frames``, keeping the plates' layout (so that the factor
    site has a valid batch shape inside them)."""
    if not frames:
        return log_prob.sum()
    nesting = max(-f.dim for f in frames)
    if log_prob.dim() < nesting:
        log_prob = log_prob.reshape((1,) * (nesting - log_prob.dim()) + log_prob.shape)
    keep = {log_prob.dim() + f.dim for f in frames}
    summed = [d for d in range(log_prob.dim()) if d not in keep]
    out = log_prob.sum(summed, keepdim=True) if summed else log_prob
    return out.reshape(out.shape[out.dim() - nesting :])


class SharpnessAwareModel(nn.Module):
    r"""The transformed model returned by :func:`sharpness_aware` (see there and the module docstring).

    An ``nn.Module`` wrapping ``model`` (so ``train()``/``eval()`` and ``parameters()`` reach it), called with the
    model's own signature. Its trace holds the model's latent sites at :math:`\theta` (prior at :math:`\theta`), its
    subsample and ``pyro.deterministic`` sites (computed at :math:`\theta`), and the factor site
    :data:`LOG_LIKELIHOOD_SITE` carrying :math:`\ell_B(\theta+\hat\epsilon(\theta))`, in place of the observed sites.
    It returns what the model returns at :math:`\theta`.

    :param model: the Pyro model.
    :param float rho: the SAM radius :math:`\rho\ge0`.
    :param bool adaptive: ASAM scaling of the ascent step.
    :param bool freeze_batchnorm: do not update BatchNorm running statistics in the extra passes.
    :param bool distributed: average :math:`\hat g` over the ranks of ``process_group`` before its norm is taken
        (see :mod:`pyro_flat.distributed`).
    :param process_group: the :mod:`torch.distributed` group of ``distributed`` (default: the world).
    :param schedule: which calls take the ascent (LookSAM, RST: a
        :class:`~pyro_flat.ops.efficient_sam.SharpnessSchedule`), shared with its owner (the SA-ELBOs pass theirs);
        default ``None``: every call. It also keeps LookSAM's directions :math:`g_v`, by site.
    """

    def __init__(
        self,
        model: Callable,
        rho: float,
        *,
        adaptive: bool = False,
        freeze_batchnorm: bool = True,
        distributed: bool = False,
        process_group: object | None = None,
        schedule: SharpnessSchedule | None = None,
    ) -> None:
        super().__init__()
        if not callable(model):
            raise ValueError(f"`model` must be a callable Pyro model, got {type(model).__name__}")
        self.model = model
        self.rho = check_options(rho, adaptive, freeze_batchnorm, distributed)
        self.adaptive = adaptive
        self.freeze_batchnorm = freeze_batchnorm
        self.distributed = distributed
        self.process_group = process_group
        self.schedule = SharpnessSchedule("sharpness_aware") if schedule is None else schedule
        if not isinstance(self.schedule, SharpnessSchedule):
            raise ValueError(f"`schedule` must be a SharpnessSchedule or None, got {type(schedule).__name__}")
        if distributed and self.schedule.active:
            raise ValueError("sharpness_aware: LookSAM and RST (looksam_k > 1, rst_p < 1) are not supported with "
                             "distributed=True")
        self._fixed_kind: str | None = None
        self._checked_kinds: set[str] = set()

    def extra_repr(self) -> str:
        return (
            f"rho={self.rho}, adaptive={self.adaptive}, freeze_batchnorm={self.freeze_batchnorm}, "
            f"distributed={self.distributed}, schedule={self.schedule}"
        )

    @contextlib.contextmanager
    def step_kind(self, kind: str) -> Iterator[None]:
        """Within the block every call computes a step of ``kind`` (:data:`~pyro_flat.ops.efficient_sam.SAM_STEP`,
        ``REUSE_STEP`` or ``BASE_STEP``) and leaves the schedule alone: an SA-ELBO decides once per step for all its
        particles, and its compiled twin captures each kind once."""
        if kind not in (SAM_STEP, REUSE_STEP, BASE_STEP):
            raise ValueError(f"sharpness_aware: unknown step kind {kind!r}")
        previous, self._fixed_kind = self._fixed_kind, kind
        try:
            yield
        finally:
            self._fixed_kind = previous

    def _scheduled(self, grad_enabled: bool) -> bool:
        """Whether this call's kind comes from (and advances) the schedule."""
        return grad_enabled and self._fixed_kind is None and self.schedule.active

    def _next_kind(self, grad_enabled: bool) -> str:
        """The kind of this call's step: the ascent without gradients (an evaluation), the kind fixed by
        :meth:`step_kind`, else the schedule's next (not taken yet: a call with nothing to perturb, e.g. an autoguide's
        prototype run, leaves the schedule alone)."""
        if not grad_enabled:
            return SAM_STEP
        if self._fixed_kind is not None:
            return self._fixed_kind
        if not self.schedule.active:
            return SAM_STEP
        if is_capturing():
            raise CaptureError("sharpness_aware with LookSAM or RST decides at every call which passes to run, so one "
                               "capture cannot stand for its steps")
        return self.schedule.peek_step()

    def _log_likelihood(self, sites: Mapping[str, dict], frames: Sequence[CondIndepStackFrame]) -> Tensor:
        r""":math:`\ell_B`: the scaled and masked log-likelihood of ``sites``, summed to the vectorised ``frames``
        (computed by Pyro's trace, so that an error names its site)."""
        trace = poutine.Trace()
        for name, site in sites.items():
            trace.add_node(name, **site)
        trace.compute_log_prob()
        total = 0.0
        for site in trace.nodes.values():
            total = total + _sum_to_plates(site["log_prob"], frames)
        return total

    def _replayed_log_likelihood(
        self, values: Mapping[str, Tensor], likelihood: Mapping[str, dict], record: _RecordingPass,
        frames: Sequence[CondIndepStackFrame], args: tuple, kwargs: dict, params: dict[int, Tensor] | None = None,
    ) -> Tensor:
        r""":math:`\ell_B` at ``values``: the recorded run replayed (same minibatch, observations and random numbers,
        blocked from the enclosing handlers, BatchNorm statistics frozen if asked); the trainable parameters it reads
        are added to ``params`` if given."""
        with record.replay(values, freeze_batchnorm=self.freeze_batchnorm):
            trace = poutine.trace(self.model).get_trace(*args, **kwargs)
        if params is not None:
            for site in trace.nodes.values():
                if site["type"] == "param":
                    _keep_trainable(params, site["value"])
        missing = sorted(set(likelihood) - set(trace.nodes))
        if missing:
            raise ValueError(
                f"sharpness_aware: the observed sites {missing} of the recording pass are absent from the perturbed "
                "pass; the model's structure must not depend on the latent values"
            )
        return self._log_likelihood({name: trace.nodes[name] for name in likelihood}, frames)

    def _perturbed_values(
        self, record: _RecordingPass, grads: Sequence[Tensor | None], frames: Sequence[CondIndepStackFrame]
    ) -> dict[str, Tensor]:
        r""":math:`\theta+\hat\epsilon(\theta)`, the ascent taken in each site's unconstrained space (the values
        themselves for real-valued sites), with one global norm over all sites per element of the enclosing plates."""
        values, unconstrained_grads, unconstrained, transforms, event_dims = {}, [], [], [], []
        for (name, (value, fn)), grad in zip(record.latents.items(), grads, strict=True):
            grad = torch.zeros_like(value) if grad is None else grad
            transform: Transform | None = None if is_real_support(fn.support) else biject_to(fn.support)
            if transform is None:
                u = value.detach()
            else:  # chain rule to the unconstrained coordinates: g_u = J^T g (through a zero leaf, as the shifts)
                u = transform.inv(value.detach())
                with torch.enable_grad():
                    zero = torch.zeros_like(u, requires_grad=True)
                    (grad,) = torch.autograd.grad(transform(u + zero), zero, grad)
            values[name] = value
            transforms.append(transform)
            unconstrained_grads.append(grad)
            unconstrained.append(u)
            event_dims.append(fn.event_dim)

        def ascent(gs: list[Tensor], ps: list[Tensor]) -> list[Tensor]:
            return sam_perturbation(gs, self.rho, adaptive=self.adaptive, params=ps)

        eps = _per_plate_element(ascent, unconstrained_grads, unconstrained, event_dims, frames)
        perturbed = {}
        for (name, value), transform, e in zip(values.items(), transforms, eps, strict=True):
            perturbed[name] = value + e if transform is None else transform(transform.inv(value) + e)
        return perturbed

    # -------------------------------------------------------------------------------------------------------------
    # LookSAM and RST steps

    def _directions(self, record: _RecordingPass) -> list[Tensor]:
        """LookSAM's :math:`g_v` of every latent site (kept in the schedule; zeros before the first refresh)."""
        directions = self.schedule.directions
        for name, (value, _) in record.latents.items():
            if name not in directions or directions[name].shape != value.shape:
                directions[name] = torch.zeros_like(value, memory_format=torch.contiguous_format).detach()
        return [directions[name] for name in record.latents]

    def _explicit_factor(
        self, log_lik: Tensor, values: Sequence[Tensor], value_grads: Sequence[Tensor], params: Sequence[Tensor],
        param_grads: Sequence[Tensor | None], record: _RecordingPass, frames: Sequence[CondIndepStackFrame],
    ) -> Tensor:
        r"""A factor with the value of ``log_lik`` whose gradient is :math:`-` ``value_grads`` with respect to the
        latent tensors ``values`` (through their graphs) and :math:`-` ``param_grads`` with respect to ``params``
        (``value_grads``, ``param_grads``: gradients of :math:`-\ell_B`, computed already): the likelihood's graph is
        not differentiated again."""
        factor = log_lik.detach()
        for value, grad, (_, fn) in zip(values, value_grads, record.latents.values(), strict=True):
            term = grad.detach() * (value - value.detach())
            if fn.event_dim:
                term = term.sum(tuple(range(-fn.event_dim, 0)))
            factor = factor - _sum_to_plates(term, frames)
        param_term = sum((g.detach() * (p - p.detach())).sum() for p, g in zip(params, param_grads, strict=True)
                         if g is not None)
        if isinstance(param_term, Tensor):  # spread over the plate elements, whose factors are summed
            factor = factor - param_term / factor.numel()
        return factor

    def _check_leaves(self, kind: str, log_lik: Tensor, inputs: Sequence[Tensor]) -> None:
        """Refuse, once per kind of step, a likelihood that reads a trainable tensor other than ``inputs`` (its
        gradient would be lost by :meth:`_explicit_factor`): a walk of the autograd graph, no host read."""
        if kind in self._checked_kinds or log_lik.grad_fn is None:
            return
        known = {id(t) for t in inputs}
        stops = {t.grad_fn for t in inputs if t.grad_fn is not None}
        seen, stack = set(), [log_lik.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in stops:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) not in known:
                raise ValueError(
                    f"sharpness_aware with LookSAM (looksam_k={self.schedule.looksam_k}): the likelihood reads a "
                    f"trainable tensor of shape {tuple(variable.shape)} that is neither a latent value nor a Pyro "
                    "parameter (pyro.param, a PyroModule parameter, pyro.module), so its gradient would be lost; "
                    "register it with Pyro or use looksam_k=1"
                )
            stack.extend(next_node for next_node, _ in node.next_functions)
        self._checked_kinds.add(kind)

    def _event_dims(self, record: _RecordingPass) -> list[int]:
        return [fn.event_dim for _, fn in record.latents.values()]

    def _reuse_factor(self, record: _RecordingPass, log_lik: Tensor, frames: Sequence[CondIndepStackFrame]) -> Tensor:
        r"""A LookSAM step between refreshes: :math:`\ell_B(\theta)` with the gradient
        :math:`-(g+\alpha\|g\|g_v/\|g_v\|)` in the latent values, :math:`g=-\nabla\ell_B(\theta)`."""
        deltas = [record.deltas[name] for name in record.latents]
        values = [value for value, _ in record.latents.values()]
        params = list(record.params.values())
        self._check_leaves(REUSE_STEP, log_lik, [*deltas, *params, *values])
        grads = torch.autograd.grad(-log_lik.sum(), [*deltas, *params], allow_unused=True)
        n = len(deltas)
        g = [torch.zeros_like(d) if x is None else x for x, d in zip(grads[:n], deltas, strict=True)]
        alpha = self.schedule.looksam_alpha

        def corrected(gs: list[Tensor], vs: list[Tensor]) -> list[Tensor]:
            return looksam_gradient(gs, vs, alpha)

        g = _per_plate_element(corrected, g, self._directions(record), self._event_dims(record), frames)
        return self._explicit_factor(log_lik, values, g, params, grads[n:], record, frames)

    def _refresh_factor(
        self, record: _RecordingPass, grads: Sequence[Tensor | None], perturbed: Mapping[str, Tensor],
        likelihood: Mapping[str, dict], frames: Sequence[CondIndepStackFrame], args: tuple, kwargs: dict,
    ) -> Tensor:
        r"""A LookSAM refresh: the SAM step's factor :math:`\ell_B(\theta')`, its gradient
        :math:`g_s=-\nabla\ell_B(\theta')` taken explicitly, and :math:`g_v` of :math:`g_s` against ``grads`` kept."""
        leaves = {name: value.detach().requires_grad_() for name, value in perturbed.items()}
        params: dict[int, Tensor] = {}
        with torch.enable_grad():
            log_lik = self._replayed_log_likelihood(leaves, likelihood, record, frames, args, kwargs, params=params)
            self._check_leaves(SAM_STEP, log_lik, [*leaves.values(), *params.values()])
            all_grads = torch.autograd.grad(-log_lik.sum(), [*leaves.values(), *params.values()], allow_unused=True)
        n = len(leaves)
        sam_grads = [torch.zeros_like(v) if x is None else x for x, v in zip(all_grads[:n], leaves.values(),
                                                                                strict=True)]
        first = [torch.zeros_like(v) if x is None else x.detach() for x, (v, _) in zip(grads, record.latents.values(),
                                                                                      strict=True)]
        directions = _per_plate_element(looksam_direction, first, sam_grads, self._event_dims(record), frames)
        for kept, new in zip(self._directions(record), directions, strict=True):  # in place: a capture reads them
            kept.copy_(new)
        return self._explicit_factor(log_lik, list(perturbed.values()), sam_grads, list(params.values()),
                                     all_grads[n:], record, frames)

    def _check_perturbed(self, record: _RecordingPass, perturbed: Mapping[str, Tensor]) -> None:
        """A clear error if a perturbed value overflowed out of its site's support (one host read; under validation
        or on the error path only)."""
        valid = {
            name: torch.isfinite(perturbed[name]).all() & fn.support.check(perturbed[name]).all()
            for name, (_, fn) in record.latents.items()
        }
        if not all_true(list(valid.values())):
            degenerate = [name for name, ok in valid.items() if not bool(ok)]
            raise ValueError(
                f"sharpness_aware (rho={self.rho}): the perturbed values of the sites {degenerate} are not finite or "
                "left their support (the SAM step overflowed the site's transform); lower rho"
            )

    def _check_sites(self, record: _RecordingPass) -> None:
        if record.discrete and (record.latents or record.likelihood):  # (else: e.g. Predictive drawing a class)
            raise ValueError(
                f"sharpness_aware: latent sites {record.discrete} have discrete support; the SAM perturbation needs "
                "continuous latent values"
            )

    def forward(self, *args: object, **kwargs: object) -> object:
        if torch.jit.is_tracing():
            raise NotImplementedError(
                "sharpness_aware cannot be compiled with torch.jit.trace (e.g. by JitTrace_ELBO): its SAM ascent takes "
                "a gradient inside the model run, which tracing would freeze. For a compiled SA-ELBO use "
                "pyro_flat.infer.JitSharpnessAwareELBO (on the original model); else SharpnessAwareELBO or Trace_ELBO"
            )
        frames = [f for f in get_plates() if f.vectorized]
        grad_enabled = torch.is_grad_enabled()
        kind = self._next_kind(grad_enabled)
        with _RecordingPass(shift=grad_enabled and kind != BASE_STEP, collect_params=kind == REUSE_STEP) as record:
            result = self.model(*args, **kwargs)
        # the model's own observations (scored here) and those of enclosing conditions (scored by the enclosing
        # handlers at theta, here only the difference to theta + eps): one likelihood, as if all were inside
        likelihood = {**record.likelihood, **record.conditioned}
        if not likelihood:  # e.g. Predictive with y=None: nothing to perturb
            if grad_enabled and not record.hidden_observations:
                warn_nothing_to_perturb(self, "no observation", (
                    "sharpness_aware: the model observes nothing in this run (no observed sample site: were the "
                    "observations, e.g. `y`, passed?), so there is no likelihood to perturb: the density is the "
                    "model's own"))
            return result
        self._check_sites(record)
        if record.latents and self._scheduled(grad_enabled):
            self.schedule.next_step()  # the step is taken
        if not record.latents:  # the SA posterior of no latent is the model's own
            if grad_enabled:
                self._warn_no_latent(record)
            if record.likelihood:
                pyro.factor(LOG_LIKELIHOOD_SITE, self._log_likelihood(record.likelihood, frames))
            return result
        if kind == BASE_STEP:  # RST without the ascent: the model's own likelihood at theta
            if record.likelihood:
                pyro.factor(LOG_LIKELIHOOD_SITE, self._log_likelihood(record.likelihood, frames))
            return result
        looksam = self.schedule.looksam and grad_enabled
        if looksam and record.conditioned:
            raise ValueError(
                f"sharpness_aware with LookSAM (looksam_k={self.schedule.looksam_k}): the sites "
                f"{sorted(record.conditioned)} are conditioned outside the transformed model; condition them inside "
                "(sharpness_aware(pyro.condition(model, data))) or use looksam_k=1"
            )
        if kind == REUSE_STEP:
            with torch.enable_grad():
                log_lik = self._log_likelihood(record.likelihood, frames)
                pyro.factor(LOG_LIKELIHOOD_SITE, self._reuse_factor(record, log_lik, frames))
            return result
        outer_log_lik = self._log_likelihood(record.conditioned, frames) if record.conditioned else 0.0
        with torch.enable_grad():
            if grad_enabled:
                deltas = [record.deltas[name] for name in record.latents]
                inner_log_lik = self._log_likelihood(record.likelihood, frames) if record.likelihood else 0.0
                log_lik = inner_log_lik + outer_log_lik
            else:  # no graph from the recording pass: one extra replayed pass at theta + 0
                deltas = [torch.zeros_like(v, requires_grad=True) for v, _ in record.latents.values()]
                shifted = {name: v + d for (name, (v, _)), d in zip(record.latents.items(), deltas, strict=True)}
                log_lik = self._replayed_log_likelihood(shifted, likelihood, record, frames, args, kwargs)
            if isinstance(log_lik, Tensor) and log_lik.requires_grad:
                grads = torch.autograd.grad(-log_lik.sum(), deltas, allow_unused=True, retain_graph=True)
            else:
                grads = [None] * len(deltas)
        if self.distributed:  # the ascent of the combined batch: the same perturbation on every rank
            check_distributed("sharpness_aware")
            grads = all_reduce_mean(
                [torch.zeros_like(d) if g is None else g for g, d in zip(grads, deltas, strict=True)],
                self.process_group,
            )
        perturbed = self._perturbed_values(record, grads, frames)
        if is_validation_enabled():
            self._check_perturbed(record, perturbed)
        try:
            if looksam:
                perturbed_log_lik = self._refresh_factor(record, grads, perturbed, likelihood, frames, args, kwargs)
            else:
                perturbed_log_lik = self._replayed_log_likelihood(perturbed, likelihood, record, frames, args, kwargs)
        except ValueError as error:
            self._check_perturbed(record, perturbed)
            raise ValueError(
                f"sharpness_aware (rho={self.rho}): the likelihood at the perturbed latent values failed: {error}"
            ) from error
        pyro.factor(LOG_LIKELIHOOD_SITE, perturbed_log_lik - outer_log_lik)
        return result

    def _warn_no_latent(self, record: _RecordingPass) -> None:
        conditioned = sorted(record.conditioned)
        if conditioned:
            why = (
                f"the sites {conditioned} are conditioned outside the transformed model, and an outer condition "
                "observes, exactly as one inside. Pyro's HMC/NUTS and Predictive set latent values that way and so "
                "see the model's own density: evaluate the sharpness-aware density at latent values with "
                "pyro_flat.infer.at_latent_values and sample it with pyro_flat.infer.mcmc.SGLD (F-SGLD)"
            )
        else:
            why = "the model has no latent site"
        warn_nothing_to_perturb(self, f"no latent {conditioned}", (
            f"sharpness_aware: no latent site is left to perturb: {why}. The density is the model's own"))


def sharpness_aware(
    model: Callable,
    rho: float = 0.05,
    *,
    adaptive: bool = False,
    freeze_batchnorm: bool = True,
    distributed: bool = False,
    process_group: object | None = None,
    looksam_k: int = 1,
    looksam_alpha: float = DEFAULT_LOOKSAM_ALPHA,
    rst_p: float = 1.0,
    rst_seed: int | None = None,
) -> SharpnessAwareModel:
    r"""Transform a Pyro model into its sharpness-aware posterior model: prior at :math:`\theta`, likelihood at the
    SAM point :math:`\theta+\rho\hat g/\|\hat g\|_2` (the density and its terms are in the module docstring).

    Any Pyro inference on the result targets the sharpness-aware posterior: ``Trace_ELBO`` with any reparameterised
    guide is the SA-ELBO (:class:`~pyro_flat.infer.SharpnessAwareELBO` *is* that), ``AutoDelta`` + ``Trace_ELBO`` is
    SAM with the prior as weight decay, and SGLD on it (:class:`~pyro_flat.infer.mcmc.SGLD`) is F-SGLD.
    ``Predictive(sharpness_aware(model), guide=guide)`` returns the model's sites at the unperturbed :math:`\theta`.

    :param model: a Pyro model (e.g. :class:`~pyro_flat.nn.BayesianMLP`) whose structure does not depend on the latent
        values; minibatches are drawn inside it by ``pyro.plate(..., subsample_size=B)`` or passed with ``num_data``.
    :param float rho: the SAM radius :math:`\rho\ge0`; default 0.05, the F-BNN code's value for CIFAR-10 and
        ImageNet fine-tuning [1] (0.1 for CIFAR-100). :math:`\rho=0` gives the model's own density.
    :param bool adaptive: ASAM scaling :math:`\hat\epsilon=\rho\,T_\theta^2\hat g/\|T_\theta\hat g\|_2`,
        :math:`T_\theta=|\theta|` (:mod:`pyro_flat.ops.sam`); default ``False``.
    :param bool freeze_batchnorm: BatchNorm running statistics are not updated by the extra passes (the F-BNN code's
        ``disable_running_stats``); default ``True``.
    :param bool distributed: average :math:`\hat g` over the ranks before its norm is taken (one ``all_reduce``,
        :mod:`pyro_flat.distributed`); default ``False``.
    :param process_group: the process group of ``distributed`` (default ``None``: the world).
    :param int looksam_k: LookSAM's period :math:`k\ge1`: the ascent every :math:`k`-th gradient evaluation, the
        reused direction in between; default 1 (every evaluation; the paper uses 5).
    :param float looksam_alpha: LookSAM's :math:`\alpha\ge0`; default 0.7 (the paper's).
    :param float rst_p: RST's probability :math:`p\in[0,1]` that a gradient evaluation takes the ascent; default
        1 (every one; the paper's constant schedule uses 0.5).
    :param rst_seed: the seed of RST's choices; default ``None``: drawn once from torch's CPU generator here.
    :returns: the transformed model, a :class:`SharpnessAwareModel`.
    :raises ValueError: for a bad ``rho`` or cheaper-step option (LookSAM and RST together, either with
        ``distributed``); when called, for a discrete latent site, an outer ``poutine.do`` or ``poutine.reparam``, a
        SAM step that leaves a site's support, or with LookSAM a site conditioned outside or a trainable tensor that
        Pyro does not know. (A run without a latent site or an
        observation has nothing to perturb: its density is the model's, with a
        :class:`~pyro_flat.infer.NothingToPerturbWarning` when gradients are on.)

    .. warning:: :math:`\hat g` is the gradient of the *minibatch* log-likelihood: like SAM a stochastic objective,
        and SGLD on it is F-SGLD, not an exact sampler of :math:`q_{\mathrm{SA}}`.

    Example::

        sa_model = sharpness_aware(model, rho=0.05)
        svi = SVI(sa_model, AutoDelta(model), pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())  # SAM
        svi.step(x, y, subsample_size=128)
    """
    return SharpnessAwareModel(
        model, rho, adaptive=adaptive, freeze_batchnorm=freeze_batchnorm, distributed=distributed,
        process_group=process_group,
        schedule=SharpnessSchedule("sharpness_aware", looksam_k, looksam_alpha, rst_p, rst_seed),
    )


__all__ = ["LOG_LIKELIHOOD_SITE", "SharpnessAwareModel", "is_likelihood_site", "sharpness_aware"]
