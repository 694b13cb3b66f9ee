r"""The sharpness-aware ELBO (SA-ELBO) of Flat Seeking BNNs [1]: a :class:`~pyro.infer.Trace_ELBO` whose likelihood
term is evaluated at the SAM-perturbed sample.

For a guide :math:`q_\phi` reparameterised as :math:`\theta=f_\phi(\varepsilon)`, the SA-ELBO is

.. math::

    \mathrm{SA\text{-}ELBO}(\phi) = \mathbb E_{\varepsilon}\Big[\ell_B\big(\theta + \hat\epsilon(\theta)\big)
        + \log p(\theta) - \log q_\phi(\theta)\Big]_{\theta = f_\phi(\varepsilon)},

with the minibatch log-likelihood :math:`\ell_B` and the SAM ascent :math:`\hat\epsilon` of the sharpness-aware
density (symbols in :mod:`pyro_flat.transforms.sharpness_aware_model`): per particle, the likelihood at the perturbed
sample with the same minibatch and random numbers, the prior and the guide at the sample, gradients reaching
:math:`\phi` through :math:`\theta` only. Derivation and gradients: the *Sharpness-aware posteriors* page of the
documentation (``docs/methods/sharpness-aware.md``).

Both ELBOs are :class:`~pyro.infer.Trace_ELBO` (resp. :class:`~pyro.infer.TraceMeanField_ELBO`) run on
:func:`pyro_flat.transforms.sharpness_aware` of the model: the whole two-pass logic sits in the transformed model,
which every particle trace (``loss``, ``differentiable_loss``, ``loss_and_grads``, vectorised or not) goes through,
so the three entry points are one code path and agree.

**Cheaper steps** (LookSAM and RST: see :mod:`pyro_flat.ops.efficient_sam`, references there; the defaults take the
ascent at every step). The ELBO decides once per step — one call of ``loss_and_grads`` or ``differentiable_loss``
with gradients enabled — for all its particles; on a step without the ascent the loss is the plain ELBO's value.
``loss`` (``SVI.evaluate_loss``) always evaluates the SA-ELBO and leaves the schedule alone.
:meth:`SharpnessAwareELBO.state_dict` holds the schedule for an exact resume (the *Cheaper steps* page,
``docs/methods/cheaper-steps.md``).

References:
    * [1] `Flat Seeking Bayesian Neural Networks`, Van-Anh Nguyen, Tung-Long Vuong, Hoang Phan, Thanh-Toan Do,
      Dinh Phung, Trung Le (NeurIPS 2023), arXiv:2302.02713
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from pyro.distributions import Delta
from pyro.poutine import Trace

from ...ops.efficient_sam import DEFAULT_LOOKSAM_ALPHA, SAM_STEP, SharpnessSchedule
from ...runtime.sites import is_latent_site, is_real_support
from ...transforms.sharpness_aware_model import SharpnessAwareModel, check_options
from .trace_elbo import TensorTrace_ELBO, TensorTraceMeanField_ELBO


class _SharpnessAware:
    """Shared by the two SA-ELBOs: runs every particle trace on the sharpness-aware transform of the model."""

    def __init__(
        self,
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
        **kwargs: object,
    ) -> None:
        self.rho = check_options(rho, adaptive, freeze_batchnorm, distributed)
        self.adaptive, self.freeze_batchnorm = adaptive, freeze_batchnorm
        self.distributed, self.process_group = distributed, process_group
        self.schedule = SharpnessSchedule(type(self).__name__, looksam_k, looksam_alpha, rst_p, rst_seed)
        if distributed and self.schedule.active:
            raise ValueError(f"{type(self).__name__}: LookSAM and RST (looksam_k > 1, rst_p < 1) are not supported "
                             "with distributed=True")
        self._transformed: tuple[tuple, SharpnessAwareModel] | None = None
        self._step_kind: str | None = None
        super().__init__(**kwargs)

    def _sharpness_aware(self, model: Callable) -> SharpnessAwareModel:
        """The transformed model, made again when the model or an option changed since the last step (LookSAM's
        directions of another model are then dropped)."""
        key = (model, self.rho, self.adaptive, self.freeze_batchnorm, self.distributed, self.process_group)
        if self._transformed is None or key[0] is not self._transformed[0][0] or key[1:] != self._transformed[0][1:]:
            check_options(self.rho, self.adaptive, self.freeze_batchnorm, self.distributed)
            if self._transformed is not None and key[0] is not self._transformed[0][0]:
                self.schedule.directions.clear()
            sa_model = SharpnessAwareModel(
                model, self.rho, adaptive=self.adaptive, freeze_batchnorm=self.freeze_batchnorm,
                distributed=self.distributed, process_group=self.process_group, schedule=self.schedule,
            )
            self._transformed = (key, sa_model)
        return self._transformed[1]

    @contextlib.contextmanager
    def _scheduled_step(self) -> Iterator[tuple[str]]:
        """Decide the kind of this step (advancing the schedule when gradients are on), for every particle trace run
        inside; yields ``(kind,)`` (a compiled twin keys its captures on it)."""
        if self._step_kind is not None:  # already decided by an enclosing call
            yield (self._step_kind,)
            return
        active = torch.is_grad_enabled() and self.schedule.active
        self._step_kind = self.schedule.next_step() if active else SAM_STEP
        try:
            yield (self._step_kind,)
        finally:
            self._step_kind = None

    def _get_traces(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> Iterator[tuple[Trace, Trace]]:
        # the transform sits inside Pyro's particle plate (vectorize_particles), so the norm is per particle
        sa_model = self._sharpness_aware(model)
        with self._scheduled_step() as (kind,), sa_model.step_kind(kind):
            yield from super()._get_traces(sa_model, guide, args, kwargs)

    def loss(self, model: Callable, guide: Callable, *args: object, **kwargs: object) -> float:
        """The SA-ELBO's loss as a Python float (the ascent taken whatever the schedule, which is left alone)."""
        previous, self._step_kind = self._step_kind, SAM_STEP
        try:
            return super().loss(model, guide, *args, **kwargs)
        finally:
            self._step_kind = previous

    def state_dict(self) -> dict[str, Any]:
        """The schedule of LookSAM/RST (steps taken, RST's random state, LookSAM's directions)."""
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])

    def _get_trace(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> tuple[Trace, Trace]:
        model_trace, guide_trace = super()._get_trace(model, guide, args, kwargs)
        for name, site in guide_trace.nodes.items():
            if is_latent_site(site) and not site["fn"].has_rsample:
                raise ValueError(
                    f"{type(self).__name__}: guide site {name!r} ({type(site['fn']).__name__}) is not "
                    "reparameterisable; the SAM step moves the sampled latent values, so every latent site of the "
                    "guide must have rsample"
                )
        return model_trace, guide_trace


class SharpnessAwareELBO(_SharpnessAware, TensorTrace_ELBO):
    r"""The sharpness-aware ELBO (SA-ELBO) of Flat Seeking BNNs [1], a :class:`~pyro.infer.Trace_ELBO` for
    :class:`~pyro.infer.SVI` with any reparameterised guide and any ``PyroOptim``.

    Each particle draws :math:`\theta=f_\phi(\varepsilon)` from the guide, takes one SAM ascent step
    :math:`\theta'=\theta+\rho\,\hat g/\|\hat g\|_2` (:math:`\hat g` the gradient of the minibatch negative
    log-likelihood at :math:`\theta`, global norm over all latent sites, treated as a constant), and returns

    .. math:: -\big[\ell_B(\theta') + \log p(\theta) - \log q_\phi(\theta)\big]

    (symbols in :mod:`pyro_flat.transforms.sharpness_aware_model`): the likelihood at :math:`\theta'` with the same
    minibatch (the model's ``pyro.plate`` subsample indices are replayed) and the same random numbers (dropout masks),
    the prior and the guide at :math:`\theta`. It is exactly ``Trace_ELBO`` on
    :func:`~pyro_flat.transforms.sharpness_aware` of the model; ``loss``, ``differentiable_loss`` (usable through Pyro's
    ``ELBOModule`` by native torch optimisers) and ``loss_and_grads`` agree; ``num_particles > 1`` and
    ``vectorize_particles=True`` (one norm per particle) work. With :math:`\rho=0` the loss and gradients are those of
    ``Trace_ELBO`` under the same seed. With ``AutoDelta`` it is SAM with the prior as weight decay; with ``AutoNormal``
    it is F-BBB / F-VI.

    :param float rho: the SAM radius :math:`\rho\ge0`; default 0.05, the F-BNN code's value for CIFAR-10 and ImageNet
        fine-tuning [1] (0.1 for CIFAR-100).
    :param bool adaptive: ASAM scaling :math:`\hat\epsilon=\rho\,T^2_\theta\hat g/\|T_\theta\hat g\|_2`,
        :math:`T_\theta=|\theta|` (:mod:`pyro_flat.ops.sam`); default ``False``.
    :param bool freeze_batchnorm: BatchNorm running statistics are not updated by the perturbed pass (the F-BNN
        code's ``disable_running_stats``); default ``True``.
    :param bool distributed: data-parallel training (:mod:`pyro_flat.distributed`): :math:`\hat g` is averaged over
        the ranks before its norm is taken (the ascent of the combined batch); default ``False``.
    :param process_group: the process group of ``distributed`` (default ``None``: the world).
    :param int looksam_k: LookSAM's period :math:`k\ge1`: the ascent every :math:`k`-th step, the reused
        direction in between; default 1 (every step; the paper uses 5).
    :param float looksam_alpha: LookSAM's :math:`\alpha\ge0`; default 0.7 (the paper's).
    :param float rst_p: RST's probability :math:`p\in[0,1]` that a step takes the ascent; default 1 (every step;
        the paper's constant schedule uses 0.5).
    :param rst_seed: the seed of RST's choices; default ``None``: drawn once from torch's CPU generator here.
    :param kwargs: :class:`~pyro.infer.Trace_ELBO` options (``num_particles``, ``vectorize_particles``,
        ``max_plate_nesting``, ...).
    :raises ValueError: for a negative, NaN or infinite ``rho`` or a bad cheaper-step option (LookSAM and RST
        together, either with ``distributed``); at the first step, for a model without latent sites, a discrete latent
        site, or a guide site without ``rsample``.

    .. note:: A step costs two forward and two backward passes of the network (the SAM floor) plus the tracing of
        two model runs; the ascent uses the model's own minibatch (``pyro.plate(..., subsample_size=B)``).

    .. warning:: The SA-ELBO is not a bound on the log evidence of the original model; it is the (one-step SAM)
        ELBO of the sharpness-aware posterior, whose likelihood term is at the worst case in a ρ-ball.

    Example::

        >>> guide = AutoNormal(model)                                               # doctest: +SKIP
        >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), SharpnessAwareELBO(rho=0.05))  # doctest: +SKIP
        >>> svi.step(x_train, y_train, subsample_size=128)                          # doctest: +SKIP
    """


class SharpnessAwareMeanFieldELBO(_SharpnessAware, TensorTraceMeanField_ELBO):
    r"""The SA-ELBO with Pyro's analytic KL divergence, like :class:`~pyro.infer.TraceMeanField_ELBO`:

    .. math:: -\Big[\ell_B(\theta') - \sum_z \mathrm{KL}\big(q_\phi(z)\,\|\,p(z)\big)\Big],
        \qquad \theta'=\theta+\rho\,\hat g/\|\hat g\|_2,\ \theta\sim q_\phi.

    The KL term is analytic only for latent sites that the guide samples **directly** from a distribution with a
    registered KL divergence to the prior — a hand-written mean-field guide (e.g. ``Normal`` against a ``Normal``
    prior) on a model whose priors do not depend on other latent sites; there its gradient has less variance than
    :class:`SharpnessAwareELBO`'s, with the same expectation. Pyro's autoguides do not sample the model's sites
    directly: ``AutoNormal`` draws an auxiliary ``"{site}_unconstrained"`` and maps it through a ``Delta``, so for it
    this ELBO computes the *sampled* estimator — for real-valued latents exactly :class:`SharpnessAwareELBO`'s value and
    gradient. For a constrained latent behind such a ``Delta`` Pyro's ``TraceMeanField_ELBO`` drops the Jacobian that
    the ``Delta`` carries (a biased gradient), so this ELBO refuses it with a ``ValueError`` naming the site: use
    :class:`SharpnessAwareELBO` there.

    :param float rho: the SAM radius :math:`\rho\ge0`; default 0.05 (see :class:`SharpnessAwareELBO`).
    :param bool adaptive: ASAM scaling; default ``False``.
    :param bool freeze_batchnorm: BatchNorm statistics not updated by the perturbed pass; default ``True``.
    :param looksam_k, looksam_alpha, rst_p, rst_seed: LookSAM and RST, as for :class:`SharpnessAwareELBO`.
    :param kwargs: :class:`~pyro.infer.TraceMeanField_ELBO` options.
    :raises ValueError: as :class:`SharpnessAwareELBO`, and for a guide site that is a ``Delta`` with a Jacobian.

    .. warning:: As for ``TraceMeanField_ELBO``, the result is wrong if the guide is not mean-field with respect to
        the model's dependency structure.
    """

    def _get_trace(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> tuple[Trace, Trace]:
        model_trace, guide_trace = super()._get_trace(model, guide, args, kwargs)
        # a latent drawn through an auxiliary site and a Delta (AutoNormal, AutoContinuous guides) carries the
        # Jacobian of its constraint in the Delta; AutoDelta's Delta (a MAP in constrained space) carries none
        if not any(s["type"] == "sample" and s["infer"].get("is_auxiliary") for s in guide_trace.nodes.values()):
            return model_trace, guide_trace
        for name, site in model_trace.nodes.items():
            if not is_latent_site(site) or name not in guide_trace.nodes:
                continue
            fn = guide_trace.nodes[name]["fn"]
            while hasattr(fn, "base_dist"):
                fn = fn.base_dist
            if isinstance(fn, Delta) and not is_real_support(site["fn"].support):
                raise ValueError(
                    f"SharpnessAwareMeanFieldELBO: the guide maps site {name!r} through a Delta with a Jacobian (an "
                    "autoguide on a constrained latent); Pyro's mean-field KL for it ignores that Jacobian, which "
                    "biases the gradient. Use SharpnessAwareELBO"
                )
        return model_trace, guide_trace


__all__ = ["SharpnessAwareELBO", "SharpnessAwareMeanFieldELBO"]
