r"""HWA: averaging the variational parameters of an SVI guide along a cyclical-learning-rate trajectory.

HWA ("Hyperparameters Weight Averaging", Karimi & Li [1]) is SWA/SWAG applied to the *variational parameters* of a
mean-field Gaussian guide :math:`q(\theta)=\mathcal N(\mu,\operatorname{diag}\sigma^2)` trained by SVI. Starting
from pretrained :math:`(\hat\mu,\hat\sigma)`, SVI continues with the cyclical learning rate of SWA [2] (cycle
length :math:`c`, from :math:`\gamma_1` down to :math:`\gamma_2` within each cycle)

.. math:: \gamma(k) = (1-t_k)\gamma_1 + t_k\gamma_2,\qquad t_k = \frac{\operatorname{mod}(k-1, c)+1}{c},

and at the end of each cycle (after step :math:`k` with :math:`\operatorname{mod}(k,c)=0`, i.e. after the step at
the lowest rate :math:`\gamma_2`) the guide's means :math:`\mu^{(n)}` are averaged:

.. math::
    \mu_{\mathrm{HWA}} = \frac1n\sum_{i\le n}\mu^{(i)},\qquad
    m_2 = \frac1n\sum_{i\le n}\big(\mu^{(i)}\big)^2,

which is the draft's Algorithm 1 with its variance read as a running second moment minus the squared mean. The
averaged posterior is :math:`\mathcal N(\mu_{\mathrm{HWA}}, \operatorname{diag} v)` with, selectable by
``variance``:

* ``"means"`` (the draft's rule, default): :math:`v = \max(m_2-\mu_{\mathrm{HWA}}^2,\ 10^{-30})`, the SWAG-Diagonal
  variance of the mean iterates. With few cycles it is tiny: :meth:`HWA.num_clamped` reports how many coordinates hit
  the clamp.
* ``"total"``: :math:`v = \overline{\sigma^2} + \max(m_2-\mu_{\mathrm{HWA}}^2, 10^{-30})`, the variance of the
  equally weighted mixture of the collected Gaussians (law of total variance), which keeps the SVI scales.
* ``"scales"``: :math:`v = \bar\sigma^2`, SWA of *both* variational parameters (average :math:`\mu` and
  :math:`\sigma`).

The averaged guide is an :class:`~pyro_flat.infer.autoguide.AutoSWAG` (optionally with the rank-:math:`K` term of the
mean iterates, as the draft suggests following SWAG), usable by ``Predictive``. All averaging happens in the guide's
unconstrained space (``AutoNormal``'s ``locs``/``scales``, or an ``AutoContinuous`` guide's ``_loc_scale``).

Usage (after a pretraining SVI run of ``guide``)::

    scheduler = cyclical_lr_scheduler(torch.optim.Adam, {"lr": 1e-3}, cycle_length=c, lr_low=1e-5)
    svi = SVI(model, guide, scheduler, Trace_ELBO())
    hwa = HWA(guide)
    callback = hwa.callback(c, scheduler=scheduler)
    for k in range(num_steps):
        svi.step(x, y, subsample_size=128)
        callback(k)                                   # steps the schedule, collects when mod(k, c) == 0
    averaged = hwa.averaged_guide(model, variance="means")
    Predictive(model, guide=averaged, num_samples=30)(x_test)

References:
    * [1] `Hyperparameters Weight Averaging in Bayesian Neural Networks`, Belhal Karimi, Ping Li (AABI 2020),
      OpenReview QkMt2L5Uon6, HAL hal-03087352
    * [2] `Averaging Weights Leads to Wider Optima and Better Generalization`, Pavel Izmailov, Dmitrii Podoprikhin,
      Timur Garipov, Dmitry Vetrov, Andrew Gordon Wilson (UAI 2018), arXiv:1803.05407
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import attrgetter
from typing import Any

import pyro.optim
import torch
from pyro.infer.autoguide import AutoContinuous, AutoNormal
from torch import Tensor

from ..._internals import autocontinuous_loc_scale
from ..._validation import check_int, check_real, is_real
from ...ops.moments import update_running_moments
from ..autoguide import AutoSWAG, SWAGCollector

VARIANCE_RULES = ("means", "total", "scales")


def cyclical_lr(step: int, cycle_length: int, lr_high: float, lr_low: float) -> float:
    r"""SWA's cyclical rate :math:`\gamma(k)=(1-t)\gamma_1+t\gamma_2`, :math:`t=(\operatorname{mod}(k-1,c)+1)/c`.

    :param int step: :math:`k\ge0`, the 0-based step index (step 0 and every multiple of :math:`c` run at
        :math:`\gamma_2`, the end of a cycle).
    :param int cycle_length: :math:`c\ge1`.
    :param float lr_high: :math:`\gamma_1`, the rate at the start of a cycle.
    :param float lr_low: :math:`\gamma_2`, the rate at its end.
    """
    t = ((step - 1) % cycle_length + 1) / cycle_length
    return (1 - t) * lr_high + t * lr_low


class CyclicalLR:
    r"""The multiplier :math:`\gamma(k)/\gamma_1` of :func:`cyclical_lr`, as the ``lr_lambda`` of
    :class:`torch.optim.lr_scheduler.LambdaLR` (a class, so that it pickles).

    :param int cycle_length: :math:`c\ge1` (steps).
    :param float low_ratio: :math:`\gamma_2/\gamma_1\in(0, 1]`.
    """

    def __init__(self, cycle_length: int, low_ratio: float) -> None:
        self.cycle_length = check_int(cycle_length, "cycle_length", owner="CyclicalLR")
        self.low_ratio = check_real(low_ratio, "low_ratio", low=0, high=1, low_open=True, owner="CyclicalLR")

    def __call__(self, step: int) -> float:
        return cyclical_lr(step, self.cycle_length, 1.0, self.low_ratio)


def cyclical_lr_scheduler(
    optimizer: type[torch.optim.Optimizer], optim_args: Mapping[str, Any], *, cycle_length: int, lr_low: float
) -> pyro.optim.PyroLRScheduler:
    r"""A Pyro optimizer whose rate follows :func:`cyclical_lr` from ``optim_args["lr"]`` (:math:`\gamma_1`) down
    to ``lr_low`` (:math:`\gamma_2`) in every cycle of ``cycle_length`` steps. Call ``scheduler.step()`` after every
    SVI step (:meth:`HWA.callback` does); step :math:`k` then runs at :math:`\gamma(k)`.

    :param optimizer: a torch optimizer class, e.g. ``torch.optim.Adam`` or ``torch.optim.SGD``.
    :param optim_args: its arguments, including ``lr`` (:math:`\gamma_1>0`).
    :param int cycle_length: :math:`c\ge1` steps (SWA: one epoch).
    :param float lr_low: :math:`0<\gamma_2\le\gamma_1`.
    """
    lr_high = optim_args.get("lr") if isinstance(optim_args, Mapping) else None
    if not is_real(lr_high, 0, low_open=True):
        raise ValueError(f"cyclical_lr_scheduler: `optim_args` must contain a learning rate 'lr' > 0, got {lr_high!r}")
    check_real(lr_low, "lr_low", low=0, high=lr_high, low_open=True, owner="cyclical_lr_scheduler")
    schedule = CyclicalLR(cycle_length, lr_low / lr_high)
    return pyro.optim.LambdaLR({"optimizer": optimizer, "optim_args": dict(optim_args), "lr_lambda": schedule})


def guide_loc_scale(guide: Callable) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    r"""The unconstrained means and standard deviations of a Gaussian guide, per latent site (detached copies).

    Supports :class:`~pyro.infer.autoguide.AutoNormal` (its ``locs``/``scales``) and every
    :class:`~pyro.infer.autoguide.AutoContinuous` guide with a ``_loc_scale`` (``AutoDiagonalNormal``; for
    ``AutoLowRankMultivariateNormal``/``AutoMultivariateNormal`` the *marginal* standard deviations). The guide must
    have been run once.
    """
    if getattr(guide, "prototype_trace", None) is None:
        raise ValueError("guide_loc_scale: run the guide once (e.g. one SVI step) so that its parameters exist")
    with torch.no_grad():
        if isinstance(guide, AutoNormal):
            locs, scales = {}, {}
            for name, _ in guide.prototype_trace.iter_stochastic_nodes():
                loc, scale = attrgetter(name)(guide.locs), attrgetter(name)(guide.scales)  # a dotted name too
                locs[name], scales[name] = loc.detach().clone(), scale.detach().clone()
            return locs, scales
        if isinstance(guide, AutoContinuous):
            try:
                parts = autocontinuous_loc_scale(guide)
            except NotImplementedError:
                raise ValueError(f"guide_loc_scale: {type(guide).__name__} has no Gaussian loc/scale") from None
            locs = {name: loc.detach().clone() for name, loc, _ in parts}
            scales = {name: scale.detach().clone() for name, _, scale in parts}
            return locs, scales
    raise ValueError(
        f"guide_loc_scale: expected an AutoNormal or AutoContinuous Gaussian guide, got {type(guide).__name__}"
    )


class HWA:
    r"""Averages the means (and scales) of a Gaussian SVI guide at the end of every learning-rate cycle.

    :param guide: the SVI guide being trained (``AutoNormal``, ``AutoDiagonalNormal``, ...; see
        :func:`guide_loc_scale`), already run once.
    :param int max_rank: the number of deviation columns of the mean iterates kept for the optional low-rank term of
        :meth:`averaged_guide`; default 20 (as SWAG).

    The mean iterates go to a :class:`~pyro_flat.infer.autoguide.SWAGCollector` (``self.means``), so
    :math:`\mu_{\mathrm{HWA}}` = ``self.means.mean()`` and the draft's variance = ``self.means.variance()``;
    :math:`\overline{\sigma}` and :math:`\overline{\sigma^2}` are running means in the same flat order.
    """

    def __init__(self, guide: Callable, *, max_rank: int = 20) -> None:
        guide_loc_scale(guide)  # validates the guide
        self.guide = guide
        self.means = SWAGCollector(max_rank)
        self._scale_mean: Tensor | None = None
        self._scale_sq_mean: Tensor | None = None

    @property
    def num_collected(self) -> int:
        """How many snapshots have been averaged."""
        return self.means.num_collected

    @torch.no_grad()
    def collect(self) -> None:
        """Average the guide's current means and scales into the running moments (no host sync)."""
        locs, scales = guide_loc_scale(self.guide)
        n = self.means.num_collected
        self.means.collect_unconstrained(locs)
        flat_scale = self.means.to_flat(torch.cat([scales[k].reshape(-1) for k in self.means.sites]))
        if self._scale_mean is None:
            self._scale_mean = torch.zeros_like(flat_scale)
            self._scale_sq_mean = torch.zeros_like(flat_scale)
        update_running_moments(self._scale_mean, self._scale_sq_mean, flat_scale, n)

    def callback(
        self, cycle_length: int, *, start: int = 0, scheduler: pyro.optim.PyroLRScheduler | None = None
    ) -> Callable[[int], None]:
        """A ``callback(step)`` to call after every SVI step ``step`` (0-based): steps ``scheduler`` (if given) and
        collects when ``step >= start`` and ``mod(step - start, cycle_length) == 0`` (Algorithm 1)."""
        check_int(cycle_length, "cycle_length", owner="HWA.callback")
        check_int(start, "start", minimum=0, owner="HWA.callback")

        def callback(step: int) -> None:
            if scheduler is not None:
                scheduler.step()
            k = step - start
            if k >= 0 and k % cycle_length == 0:
                self.collect()

        return callback

    def _check_collected(self, what: str) -> None:
        if self.num_collected == 0:
            raise ValueError(f"HWA.{what}: nothing has been collected yet")

    def mean(self) -> dict[str, Tensor]:
        r""":math:`\mu_{\mathrm{HWA}}` per site (unconstrained)."""
        return self.means.mean()

    def num_clamped(self) -> Tensor:
        r"""How many coordinates of the draft's variance :math:`m_2-\mu_{\mathrm{HWA}}^2` were clamped (0-d tensor)."""
        return self.means.num_clamped()

    def variance(self, rule: str = "means") -> dict[str, Tensor]:
        """The averaged posterior's variance per site under ``rule`` (``"means"``, ``"total"`` or ``"scales"``)."""
        self._check_collected("variance")
        if rule not in VARIANCE_RULES:
            raise ValueError(f"HWA: `variance` must be one of {VARIANCE_RULES}, got {rule!r}")
        if rule == "scales":
            flat = self._scale_mean.square()
        elif rule == "total":
            flat = self.means.flat_variance() + self._scale_sq_mean
        else:
            flat = self.means.flat_variance()
        return self.means.unflatten(flat)

    def averaged_guide(
        self, model: Callable, variance: str = "means", *, scale: float = 1.0, diagonal_only: bool = True
    ) -> AutoSWAG:
        r"""The averaged posterior as a post-hoc guide (an :class:`~pyro_flat.infer.autoguide.AutoSWAG`).

        :param model: the model the guide was trained on.
        :param str variance: ``"means"`` (draft, default), ``"total"`` or ``"scales"`` (module docstring).
        :param float scale: multiplies the covariance, :math:`>0`; default 1.
        :param bool diagonal_only: drop the rank-:math:`K` term of the mean iterates; default ``True`` (the draft's
            Algorithm 1 is diagonal). Must be ``True`` for ``"scales"``, which has no mean-spread term.
        """
        per_site = self.variance(variance)
        if variance == "scales" and not diagonal_only:
            raise ValueError("HWA.averaged_guide: variance='scales' is diagonal; use diagonal_only=True")
        return AutoSWAG(model, self.means, scale=scale, diagonal_only=diagonal_only, variance=per_site)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume averaging (not the guide itself: save it with its own ``state_dict``)."""
        return {
            "means": self.means.state_dict(),
            "scale_mean": None if self._scale_mean is None else self._scale_mean.clone(),
            "scale_sq_mean": None if self._scale_sq_mean is None else self._scale_sq_mean.clone(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        self.means.load_state_dict(state["means"])
        self._scale_mean = None if state["scale_mean"] is None else state["scale_mean"].clone()
        self._scale_sq_mean = None if state["scale_sq_mean"] is None else state["scale_sq_mean"].clone()


__all__ = ["HWA", "CyclicalLR", "cyclical_lr", "cyclical_lr_scheduler", "guide_loc_scale"]
