r"""Bayesian SAM (bSAM): a closure-based :class:`torch.optim.Optimizer` that learns a diagonal Gaussian posterior.

bSAM [1] optimises the relaxed Bayes objective of "SAM as an Optimal Relaxation of Bayes" with the Bayesian learning
rule, over the family :math:`q(\theta)=\mathcal N\big(m,\ \operatorname{diag}(1/(Ns))\big)`: the parameters hold
the mean :math:`m`, the state holds the precision-like vector :math:`s` and the momentum :math:`g_m`; the target is
the posterior under the prior :math:`\mathcal N(0, \text{prior\_precision}^{-1} I)` of a model whose negative
log-likelihood is :math:`N\bar\ell(\theta)`. One step draws :math:`\theta=m+e/\sqrt{Ns}`, perturbs the *mean* by
:math:`\epsilon=\rho g/s` (:math:`g` the gradient at :math:`\theta`) and updates :math:`g_m, m, s` with the gradient
at :math:`m+\epsilon`: the equations, m-sharpness and a fixed point are in :mod:`pyro_flat.ops.bayesian_sam` (one
implementation, shared with the tests); derivation and the case :math:`\rho=0`: the *Flat Gaussians from
trajectories* page of the documentation (``docs/methods/trajectories.md``).

**Pyro-facing form.** Run bSAM on the parameters of an ``AutoDelta`` guide (in unconstrained space, which equals the
latent space for real-valued network weights); the closure returns the *mean negative log-likelihood* of a fixed
minibatch at the guide's values — no prior term, since the prior enters through ``prior_precision`` (use
:math:`1/s_0^2` for a :math:`\mathcal N(0,s_0^2)` prior) — and posterior draws come from
:meth:`BayesianSAM.sampled_params`::

    guide = AutoDelta(model, init_loc_fn=init_to_network(model))
    guide(x[:1])                                                  # create the guide's parameters
    opt = BayesianSAM(guide.parameters(), lr=0.1, num_data=N, prior_precision=1 / prior_scale**2)
    for idx in torch.randperm(N).split(B):
        nll = model_loss_fn(model, x[idx], y[idx], num_data=N)    # pyro_flat.metrics: theta -> mean NLL

        def closure():
            loss = nll(guide())                                   # guide() returns {site: value}, differentiable
            loss.backward()
            return loss

        opt.step(closure)
    posterior = opt.guide(model, guide)                           # N(m, 1/(N s)) as a Pyro guide
    Predictive(model, guide=posterior, num_samples=30)(x_test)    # or bma_predict(model, guide_draws(...), x_test)

**Cheaper steps** (``looksam_k``, ``looksam_alpha``, ``esam_gamma``, ``rst_p``; every default gives bSAM's step):
LookSAM, ESAM and RST: see :mod:`pyro_flat.ops.efficient_sam` (references there). A step without the ascent uses the
gradient at the noisy sample for the mean too, :math:`g_\epsilon\leftarrow g` (one gradient evaluation); how each
option applies to bSAM: the *Cheaper steps* page of the documentation (``docs/methods/cheaper-steps.md``).

References:
    * [1] `SAM as an Optimal Relaxation of Bayes`, Thomas Möllenhoff, Mohammad Emtiyaz Khan (ICLR 2023),
      arXiv:2210.01620
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from operator import attrgetter
from typing import Any

import torch
from pyro.infer.autoguide import AutoDelta
from torch import Tensor
from torch.distributions import biject_to, transform_to
from torch.optim import Optimizer

from ..infer.autoguide import AutoGaussianPosterior
from ..ops.bayesian_sam import (
    bsam_curvature,
    bsam_noisy_params,
    bsam_perturbed_means,
    bsam_posterior_std,
    bsam_update_,
)
from ..ops.efficient_sam import DEFAULT_LOOKSAM_ALPHA, SAM_STEP, SharpnessSchedule, check_esam_gamma
from ._common import (
    Closure,
    PerExampleClosure,
    as_closures,
    ascent_gradients,
    check_real,
    gradients_at,
    looksam_step,
    mean_loss,
    recorded_gradients_at,
)

_GROUP_BOUNDS: dict[str, dict[str, Any]] = {
    "lr": {"low": 0, "low_open": True},
    "num_data": {"low": 0, "low_open": True},
    "rho": {"low": 0},
    "prior_precision": {"low": 0},
    "damping": {"low": 0},
    "beta1": {"low": 0, "high": 1, "high_open": True},
    "beta2": {"low": 0, "high": 1, "high_open": True},
    "init_scale": {"low": 0, "low_open": True},
}
"""The accepted numbers of each option of a parameter group."""


class BayesianSAM(Optimizer):
    r"""Bayesian SAM [1]: keeps :math:`q(\theta)=\mathcal N(m, 1/(Ns))` and draws posterior samples from it.

    :param params: the parameters :math:`m` (an iterable of tensors or of parameter-group dicts; every argument
        below can be set per group).
    :param float lr: the learning rate :math:`\alpha>0`; default 0.5 (the authors' ResNet-18 CIFAR setting and
        their two-moons demo, github.com/team-approx-bayes/bayesian-sam). The step is divided by :math:`s`
        (:math:`\approx\gamma=0.1` early on), so :math:`\alpha` is large compared with SGD's; small networks
        trained without a warm-up may need less.
    :param num_data: :math:`N>0`, the (effective) number of training examples; the authors multiply it by a
        data-augmentation factor (``dafactor`` 4 on CIFAR). Required.
    :param float rho: the radius :math:`\rho\ge0` of the unnormalised perturbation :math:`\rho g/s`; default 0.05
        (the authors' two-moons demo; 0.01 for ResNet-18 on CIFAR, 5e-5 on TinyImageNet). Not comparable with
        SAM's :math:`\rho`, which divides by :math:`\|g\|`.
    :param float prior_precision: the precision of the Gaussian prior :math:`\mathcal N(0,\text{prior\_precision}
        ^{-1}I)`, :math:`\ge0`; :math:`\delta=\text{prior\_precision}/N` acts as weight decay. Default 25 (the
        authors' ``--priorprec`` default; 40 for ResNet-18 on CIFAR).
    :param float damping: :math:`\gamma\ge0`, added to :math:`s` for stability; default 0.1 (authors).
    :param float beta1: the momentum :math:`\beta_1\in[0,1)`; default 0.9 (authors).
    :param float beta2: the decay of :math:`s`, :math:`\beta_2\in[0,1)`; default 0.999 (authors).
    :param float init_scale: :math:`s_0>0`, the initial value of every :math:`s`; default 1 (authors'
        ``--custominit``).
    :param generator: the random generator of the noise :math:`e`, on the parameters' device; default the global
        one. It is not part of :meth:`state_dict`.
    :param int looksam_k: LookSAM's period :math:`k\ge1`; default 1 (a bSAM step every step).
    :param float looksam_alpha: LookSAM's :math:`\alpha\ge0`; default 0.7 (the paper's).
    :param float esam_gamma: ESAM's :math:`\gamma\in(0,1]`; default 1 (the whole minibatch). Below 1 the closure
        protocol is :class:`~pyro_flat.optim.SAM`'s per-example one.
    :param float rst_p: RST's probability :math:`p\in[0,1]` of a bSAM step; default 1.
    :param rst_seed: the seed of RST's choices (default: drawn once from torch's CPU generator).
    :raises ValueError: for a hyperparameter outside its range (negative ``rho``, ``prior_precision`` or
        ``damping``; a non-positive ``num_data``, ``lr`` or ``init_scale``; ``beta`` outside ``[0, 1)``; a bad
        cheaper-step option, or LookSAM and RST together).

    ``step(closure)`` takes a closure that evaluates the **mean** loss of a minibatch at the current parameters,
    calls ``backward()`` and returns the loss (the optimizer sets ``.grad`` to ``None`` before every call and calls
    the closure twice, the second call replaying the first: same random numbers and ``pyro.plate`` minibatch,
    BatchNorm statistics unchanged, see :mod:`pyro_flat.infer.replay`); or a sequence of :math:`M` closures, one per
    sub-batch (m-sharpness: every sub-batch gets its own noise and perturbation, and :math:`g_\epsilon`,
    :math:`\sqrt s|g|` are averaged; the authors use :math:`M=8`). It returns the mean of the losses at the noisy
    samples (a detached tensor, no host sync).

    State per parameter ``p`` (``self.state[p]``): ``"step"`` (number of steps), ``"momentum_buffer"``
    (:math:`g_m`), ``"s"`` (:math:`s`) and, with LookSAM, ``"looksam_direction"`` (:math:`g_v`);
    :meth:`state_dict` adds the schedule of LookSAM/RST (key ``"schedule"``).

    .. note:: The closure must return the *mean* loss over its (sub-)batch: :math:`N` multiplies it implicitly
        through the noise scale :math:`1/\sqrt{Ns}` and :math:`\delta`. A Pyro ``Trace_ELBO`` loss is the *sum*
        over the data set plus the prior; divide by :math:`N` and drop the prior (see the module docstring).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 0.5,
        *,
        num_data: float,
        rho: float = 0.05,
        prior_precision: float = 25.0,
        damping: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.999,
        init_scale: float = 1.0,
        generator: torch.Generator | None = None,
        looksam_k: int = 1,
        looksam_alpha: float = DEFAULT_LOOKSAM_ALPHA,
        esam_gamma: float = 1.0,
        rst_p: float = 1.0,
        rst_seed: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            num_data=num_data,
            rho=rho,
            prior_precision=prior_precision,
            damping=damping,
            beta1=beta1,
            beta2=beta2,
            init_scale=init_scale,
        )
        self._check_group(defaults)
        self.generator = generator
        self.esam_gamma = check_esam_gamma("BayesianSAM", esam_gamma)
        self.schedule = SharpnessSchedule("BayesianSAM", looksam_k, looksam_alpha, rst_p, rst_seed)
        super().__init__(params, defaults)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        """Check the group's numbers and keep them as Python floats (a one-element tensor given for one too)."""
        for key, bounds in _GROUP_BOUNDS.items():
            group[key] = check_real(group[key], key, owner="BayesianSAM", **bounds)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    # -----------------------------------------------------------------------------------------------------------------
    # state
    # -----------------------------------------------------------------------------------------------------------------

    def _group_state(self, group: Mapping[str, Any]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """The group's trainable parameters, momenta and s (created on first use)."""
        params, momenta, s = [], [], []
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["s"] = torch.full_like(p, group["init_scale"], memory_format=torch.preserve_format)
            params.append(p)
            momenta.append(state["momentum_buffer"])
            s.append(state["s"])
        return params, momenta, s

    def _noise(self, params: Sequence[Tensor]) -> list[Tensor]:
        return [torch.randn(p.shape, generator=self.generator, dtype=p.dtype, device=p.device) for p in params]

    # -----------------------------------------------------------------------------------------------------------------
    # the step
    # -----------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Closure | PerExampleClosure | Sequence[Closure | PerExampleClosure] | None = None) -> (
        Tensor | None
    ):  # type: ignore[override]
        """One bSAM step (a LookSAM reuse step or a step without the ascent when the schedule says so); see the class
        docstring for the closure protocol."""
        closures = as_closures("BayesianSAM", closure)
        groups = [(group, *self._group_state(group)) for group in self.param_groups]
        params = [p for _, ps, _, _ in groups for p in ps]
        means = [p.detach().clone() for p in params]
        group_means, start = [], 0
        for _, ps, _, _ in groups:
            group_means.append(means[start : start + len(ps)])
            start += len(ps)
        kind = self.schedule.next_step()
        per_example = self.esam_gamma < 1
        num_closures = len(closures)
        losses: list[Tensor | None] = []
        grad_sums: list[Tensor] | None = None
        curv_sums: list[Tensor] | None = None
        noisy_sums: list[Tensor] | None = None
        for c in closures:
            # noisy sample theta = m + e / sqrt(N s), gradient there
            noisy = []
            for (group, ps, _, s), m in zip(groups, group_means, strict=True):
                noisy += bsam_noisy_params(m, s, group["num_data"], self._noise(ps))
            torch._foreach_copy_(params, noisy)
            if kind == SAM_STEP:
                loss, grads, run = recorded_gradients_at(c, params, per_example=per_example)
            else:
                loss, grads = gradients_at(c, params, per_example=per_example)
            losses.append(loss.mean() if per_example else loss)
            # perturbed mean m + rho g / s, gradient there; curvature sqrt(s)|g|
            perturbed, curvature, pos = [], [], 0
            for (group, ps, _, s), m in zip(groups, group_means, strict=True):
                g = grads[pos : pos + len(ps)]
                pos += len(ps)
                perturbed += bsam_perturbed_means(m, g, s, group["rho"])
                curvature += bsam_curvature(g, s)
            if kind == SAM_STEP:
                torch._foreach_copy_(params, perturbed)
                grads_perturbed = ascent_gradients(c, params, run, loss, self.esam_gamma)
            else:  # no ascent: the gradient at the noisy sample for the mean as well
                grads_perturbed = grads
            if grad_sums is None:
                grad_sums = [g.clone() for g in grads_perturbed] if num_closures > 1 else grads_perturbed
                curv_sums = curvature
            else:
                torch._foreach_add_(grad_sums, grads_perturbed)
                torch._foreach_add_(curv_sums, curvature)
            if self.schedule.looksam:
                if noisy_sums is None:
                    noisy_sums = [g.clone() for g in grads] if num_closures > 1 else grads
                else:
                    torch._foreach_add_(noisy_sums, grads)
        torch._foreach_copy_(params, means)
        if num_closures > 1:
            torch._foreach_div_(grad_sums, float(num_closures))
            torch._foreach_div_(curv_sums, float(num_closures))
            if noisy_sums is not None:
                torch._foreach_div_(noisy_sums, float(num_closures))
        if self.schedule.looksam:
            grad_sums = looksam_step(self, kind, params, noisy_sums, grad_sums, self.schedule.looksam_alpha)
        pos = 0
        for group, ps, momenta, s in groups:
            n = len(ps)
            for p, g in zip(ps, grad_sums[pos : pos + n], strict=True):
                p.grad = g
            bsam_update_(
                ps,
                momenta,
                s,
                grad_sums[pos : pos + n],
                curv_sums[pos : pos + n],
                lr=group["lr"],
                beta1=group["beta1"],
                beta2=group["beta2"],
                delta=group["prior_precision"] / group["num_data"],
                damping=group["damping"],
            )
            torch._foreach_add_([self.state[p]["step"] for p in ps], 1.0)
            pos += n
        return mean_loss(losses)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["schedule"] = self.schedule.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        schedule = state_dict.pop("schedule", None)
        if schedule is not None:
            self.schedule.load_state_dict(schedule)
        super().load_state_dict(state_dict)

    # -----------------------------------------------------------------------------------------------------------------
    # the posterior
    # -----------------------------------------------------------------------------------------------------------------

    def posterior_std(self) -> list[Tensor]:
        r"""The standard deviations :math:`1/\sqrt{Ns}` of :math:`q`, one tensor per trainable parameter."""
        out = []
        for group in self.param_groups:
            _, _, s = self._group_state(group)
            out += bsam_posterior_std(s, group["num_data"])
        return out

    @torch.no_grad()
    def sample_params(self, generator: torch.Generator | None = None) -> list[Tensor]:
        r"""A posterior sample :math:`m + z/\sqrt{Ns}`, :math:`z\sim\mathcal N(0,I)`, one tensor per trainable
        parameter (the parameters are not changed).

        :param generator: random generator for :math:`z` (default the optimizer's).
        """
        generator = self.generator if generator is None else generator
        out = []
        for group in self.param_groups:
            ps, _, s = self._group_state(group)
            noise = [torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device) for p in ps]
            out += bsam_noisy_params([p.detach() for p in ps], s, group["num_data"], noise)
        return out

    @contextmanager
    def sampled_params(self, generator: torch.Generator | None = None) -> Iterator[list[Tensor]]:
        """Context manager: load a posterior sample (:meth:`sample_params`) into the parameters, restore the mean on
        exit. Yields the sampled tensors."""
        params = [p for group in self.param_groups for p in self._group_state(group)[0]]
        with torch.no_grad():
            means = [p.detach().clone() for p in params]
            sample = self.sample_params(generator)
            torch._foreach_copy_(params, sample)
        try:
            yield sample
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, means)

    def guide(self, model: Callable, delta_guide: AutoDelta) -> AutoGaussianPosterior:
        r"""bSAM's posterior :math:`\mathcal N(m, 1/(Ns))` as a post-hoc Pyro guide for ``Predictive``, for bSAM run
        on the parameters of ``delta_guide`` (an ``AutoDelta`` of ``model``, the documented usage).

        ``AutoDelta`` keeps each site's value as an unconstrained tensor, so :math:`m` and the variance live in each
        site's unconstrained space (for network weights, the weights themselves); the guide maps its draws into the
        supports, as :class:`~pyro_flat.infer.autoguide.AutoSWAG` does for SWAG. A snapshot: later steps do not
        change it.

        :raises ValueError: if ``delta_guide`` is not an ``AutoDelta`` that has run, or one of its sites' parameters
            is not trained by this optimizer.
        """
        if not isinstance(delta_guide, AutoDelta) or delta_guide.prototype_trace is None:
            raise ValueError("BayesianSAM.guide: `delta_guide` must be an AutoDelta that has run once")
        params = [p for group in self.param_groups for p in self._group_state(group)[0]]
        std = {id(p): sd for p, sd in zip(params, self.posterior_std(), strict=True)}
        mean, variance = {}, {}
        for name, _ in delta_guide.prototype_trace.iter_stochastic_nodes():
            leaf = attrgetter(f"{name}_unconstrained")(delta_guide)  # AutoDelta's PyroParam storage
            if id(leaf) not in std:
                raise ValueError(f"BayesianSAM.guide: the parameter of site {name!r} is not trained by this optimizer")
            support = delta_guide.prototype_trace.nodes[name]["fn"].support
            value = transform_to(support)(leaf.detach())
            if biject_to(support).inv(value).shape != leaf.shape:
                raise ValueError(
                    f"BayesianSAM.guide: AutoDelta keeps site {name!r} ({support}) in coordinates that are not the "
                    "bijective ones of a Gaussian guide (e.g. softmax logits of a simplex), so bSAM's Gaussian over "
                    "them is not a guide of the model; reparameterise the site with real-valued latents"
                )
            mean[name] = leaf.detach().clone()
            variance[name] = std[id(leaf)].square()
        return AutoGaussianPosterior(model, mean, variance)

    def sampled_draw(self, read: Callable[[], Mapping[str, Tensor]], generator: torch.Generator | None = None) -> dict[
        str, Tensor
    ]:
        """``read()`` evaluated with a posterior sample loaded (e.g. ``read=guide.median`` of the ``AutoDelta`` whose
        parameters this optimizer trains, giving one ``{site: value}`` draw for :func:`pyro_flat.infer.bma_predict`);
        the values are detached copies."""
        with self.sampled_params(generator), torch.no_grad():
            return {k: v.detach().clone() for k, v in read().items()}


__all__ = ["BayesianSAM"]
