r"""Step-size schedules for the stochastic-gradient kernels, indexed by the gradient step :math:`t = 0, 1, \dots`.

A schedule is a picklable object with three methods:

* ``schedule(t) -> float``: the step size :math:`\varepsilon_t` of gradient step :math:`t`;
* ``schedule.injects_noise(t) -> bool``: whether step :math:`t` adds the Langevin noise (``False`` in the
  exploration stage of cyclical SG-MCMC, which is then plain gradient descent);
* ``schedule.collects(t) -> bool | None``: whether the position after step :math:`t` is a posterior draw, or
  ``None`` to let the kernel thin its chain by ``thinning``.

:class:`ConstantStepSize` and :class:`PolynomialDecay` collect by thinning; :class:`CyclicalStepSize` collects at
the end of every cycle. Steps are counted from the first warm-up step on; a kernel turns a plain number into a
:class:`ConstantStepSize`.

References:
    * [1] `Bayesian Learning via Stochastic Gradient Langevin Dynamics`, Max Welling, Yee Whye Teh (ICML 2011)
    * [2] `Cyclical Stochastic Gradient MCMC for Bayesian Deep Learning`, Ruqi Zhang, Chunyuan Li, Jianyi Zhang,
      Changyou Chen, Andrew Gordon Wilson (ICLR 2020), arXiv:1902.03932
"""

from __future__ import annotations

import math

from ..._validation import check_int, check_positive, check_real, is_real

__all__ = ["StepSizeSchedule", "ConstantStepSize", "PolynomialDecay", "CyclicalStepSize", "as_schedule"]


class StepSizeSchedule:
    """The base of the schedules: noise at every step, collection by thinning. Subclasses define ``__call__``."""

    def __call__(self, t: int) -> float:
        raise NotImplementedError

    def injects_noise(self, t: int) -> bool:
        """Whether step ``t`` adds Langevin noise (always, by default)."""
        return True

    def collects(self, t: int) -> bool | None:
        """``None``: the kernel collects every ``thinning``-th transition after warm-up."""
        return None


class ConstantStepSize(StepSizeSchedule):
    r""":math:`\varepsilon_t = \varepsilon`.

    :param float step_size: :math:`\varepsilon > 0`.
    """

    def __init__(self, step_size: float) -> None:
        self.step_size = check_positive(step_size, "step_size", owner="ConstantStepSize")

    def __call__(self, t: int) -> float:
        return self.step_size

    def __repr__(self) -> str:
        return f"ConstantStepSize({self.step_size:g})"


class PolynomialDecay(StepSizeSchedule):
    r"""The decay of Welling & Teh [1], :math:`\varepsilon_t = a\,(b + t)^{-\gamma}`; with
    :math:`\gamma \in (0.5, 1]` it satisfies :math:`\sum_t \varepsilon_t = \infty`,
    :math:`\sum_t \varepsilon_t^2 < \infty`, under which SGLD is asymptotically unbiased.

    :param float a: :math:`a > 0`.
    :param float b: :math:`b > 0` (default 1).
    :param float gamma: :math:`\gamma \ge 0` (default 0.55, as in [1]).
    """

    def __init__(self, a: float, b: float = 1.0, gamma: float = 0.55) -> None:
        owner = "PolynomialDecay"
        self.a = check_positive(a, "a", owner=owner)
        self.b = check_positive(b, "b", owner=owner)
        self.gamma = check_positive(gamma, "gamma", owner=owner, allow_zero=True)

    def __call__(self, t: int) -> float:
        return self.a * (self.b + t) ** -self.gamma

    def __repr__(self) -> str:
        return f"PolynomialDecay(a={self.a:g}, b={self.b:g}, gamma={self.gamma:g})"


class CyclicalStepSize(StepSizeSchedule):
    r"""The cyclical cosine schedule of cSG-MCMC [2] (also Entropy-MCMC's CIFAR schedule): with cycle length
    :math:`C` and :math:`r_t = (t \bmod C)/C`,

    .. math:: \varepsilon_t = \varepsilon_{\min} + \frac{\varepsilon_0 - \varepsilon_{\min}}{2}\,
        \big(\cos(\pi r_t) + 1\big).

    Steps with :math:`r_t < \beta` (the *exploration* stage) are noiseless gradient steps; the rest (the *sampling*
    stage) are Langevin steps. ``samples_per_cycle`` draws are collected per cycle, evenly spaced within the
    sampling stage and ending with the cycle's last step.

    :param float initial_step_size: :math:`\varepsilon_0 > 0`.
    :param int cycle_length: :math:`C \ge 1` gradient steps.
    :param float final_step_size: :math:`\varepsilon_{\min} \in [0, \varepsilon_0]` (default 0).
    :param float exploration_fraction: :math:`\beta \in [0, 1)` (default 0: noise at every step, as in the
        Entropy-MCMC code's cSGLD baseline; [2] uses e.g. 0.8 on CIFAR-10).
    :param int samples_per_cycle: draws per cycle (default 1), at most the sampling stage's length.
    """

    def __init__(
        self,
        initial_step_size: float,
        cycle_length: int,
        *,
        final_step_size: float = 0.0,
        exploration_fraction: float = 0.0,
        samples_per_cycle: int = 1,
    ) -> None:
        owner = "CyclicalStepSize"
        self.initial_step_size = check_positive(initial_step_size, "initial_step_size", owner=owner)
        self.cycle_length = check_int(cycle_length, "cycle_length", owner=owner)
        self.final_step_size = check_positive(final_step_size, "final_step_size", owner=owner, allow_zero=True)
        if self.final_step_size > self.initial_step_size:
            raise ValueError(f"{owner}: expected final_step_size <= initial_step_size, got {final_step_size!r}")
        self.exploration_fraction = check_real(exploration_fraction, "exploration_fraction", low=0, high=1,
                                               high_open=True, owner=owner)
        self.samples_per_cycle = check_int(samples_per_cycle, "samples_per_cycle", owner=owner)
        first_sampling = math.ceil(self.exploration_fraction * self.cycle_length)
        stage = self.cycle_length - first_sampling
        if self.samples_per_cycle > stage:
            raise ValueError(
                f"{owner}: samples_per_cycle={samples_per_cycle} exceeds the {stage} steps of the sampling stage "
                f"(cycle_length={cycle_length}, exploration_fraction={exploration_fraction})"
            )
        spacing = stage // self.samples_per_cycle
        last = self.cycle_length - 1
        self._collected = frozenset(last - k * spacing for k in range(self.samples_per_cycle))
        self._first_sampling = first_sampling

    def __call__(self, t: int) -> float:
        r = (t % self.cycle_length) / self.cycle_length
        amplitude = 0.5 * (self.initial_step_size - self.final_step_size)
        return self.final_step_size + amplitude * (math.cos(math.pi * r) + 1)

    def injects_noise(self, t: int) -> bool:
        return t % self.cycle_length >= self._first_sampling

    def collects(self, t: int) -> bool:
        return t % self.cycle_length in self._collected

    def __repr__(self) -> str:
        return (
            f"CyclicalStepSize({self.initial_step_size:g}, cycle_length={self.cycle_length}, "
            f"final_step_size={self.final_step_size:g}, exploration_fraction={self.exploration_fraction:g}, "
            f"samples_per_cycle={self.samples_per_cycle})"
        )


def as_schedule(step_size: float | StepSizeSchedule, name: str = "step_size") -> StepSizeSchedule:
    """A schedule from a number (:class:`ConstantStepSize`; a one-element tensor counts as the number it holds) or a
    schedule (returned as is).

    :param step_size: a finite number > 0 or a :class:`StepSizeSchedule`.
    :param str name: the argument's name in error messages.
    :raises ValueError: if ``step_size`` is neither a finite number > 0 nor a :class:`StepSizeSchedule`.
    """
    if isinstance(step_size, StepSizeSchedule):
        return step_size
    if not is_real(step_size, 0, low_open=True):
        raise ValueError(f"`{name}` must be a finite number > 0 or a StepSizeSchedule, got {step_size!r}")
    return ConstantStepSize(step_size)
