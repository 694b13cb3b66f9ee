r"""SWAG: a Gaussian posterior (diagonal plus rank :math:`K`) from the iterates of any trajectory, as a Pyro guide.

SWAG [1] collects iterates :math:`\theta_i` of a trajectory — usually once per epoch after ``swa_start`` — and keeps
their running mean :math:`\bar\theta` (that alone is SWA [2]), their running mean of squares :math:`m_2` and the last
:math:`K` deviations :math:`D_{:,i}=\theta_i-\bar\theta` (from the *updated* mean). The posterior at scale
:math:`\lambda` is

.. math::
    q(\theta) = \mathcal N\Big(\bar\theta,\ \lambda\big(\Sigma_{\mathrm{diag}} + \tfrac{1}{K-1}DD^\top\big)\Big),
    \qquad \Sigma_{\mathrm{diag}} = \max(m_2-\bar\theta^2,\ 10^{-30}),

sampled as :math:`\tilde\theta=\bar\theta+\sqrt\lambda(\Sigma_{\mathrm{diag}}^{1/2}z_1+Dz_2/\sqrt{K-1})`
(:mod:`pyro_flat.ops.moments`). :math:`\lambda=\tfrac12` is the paper's SWAG; SWAG-Diagonal drops :math:`D` and uses
:math:`\lambda=1`; the F-BNN code evaluates F-SWAG at 0.1 and F-SWAG-Diagonal at 0.2 [3].

Two objects:

* :class:`SWAGCollector` — collects ``{site: value}`` dicts from any trajectory (pure bookkeeping, no Pyro state).
* :class:`AutoSWAG` — the post-hoc Pyro guide built from a collector (:meth:`SWAGCollector.guide`), an
  :class:`~pyro.infer.autoguide.AutoContinuous` whose parameters are **buffers** (like the guide
  :class:`~pyro.infer.autoguide.AutoLaplaceApproximation` returns): usable by ``Predictive(model, guide=swag)``,
  :func:`~pyro_flat.infer.guide_draws` and :func:`~pyro_flat.infer.bma_predict` (which recomputes BatchNorm statistics
  for every draw when given ``batchnorm_inputs``).

**Spaces.** The moments are kept in the *unconstrained* space of each site (``biject_to(support).inv``; for the
real-valued weights of a network it is the latent space itself), where a Gaussian is a sensible family.
:meth:`SWAGCollector.collect` takes values in the **model's space** (constrained, as Pyro returns them everywhere)
and maps them with the sites' supports given to the collector (``supports=``, e.g. :func:`latent_supports`);
:meth:`SWAGCollector.collect_unconstrained` takes unconstrained values (a kernel's state, a guide's unconstrained
locations). A guide built for a constrained site whose space the collector cannot know (model-space values without
the site's support) is refused with an error naming the site. Collecting from any trajectory:

* SGD/Adam MAP with ``AutoDelta`` through Pyro's ``SVI``, or the means of an SVI guide: ``collector =
  SWAGCollector(supports=latent_supports(guide))`` then ``callback = collector.callback(guide.median,
  every=steps_per_epoch, start=swa_start_step)``, called as ``callback(step)`` after every step;
* SAM / bSAM / any torch optimizer on a dict of tensors ``theta``: ``collector.collect(theta)`` once per epoch
  (SWAG from SAM iterates **is F-SWAG** [3]);
* SG-MCMC (SGLD) through Pyro's ``MCMC``: ``MCMC(kernel, ..., hook_fn=collector.mcmc_hook(every=10))`` (Pyro
  passes the kernel's unconstrained state), or afterwards ``collector.collect_samples(mcmc.get_samples())`` (model
  space).

**Flattening order.** The flat vectors (:meth:`SWAGCollector.flat_mean`, :meth:`~SWAGCollector.flat_variance`,
:meth:`~SWAGCollector.deviation_matrix`) concatenate the sites in the order of the first collected dict. Collected from
``guide.median()`` of an ``AutoDelta``/``AutoNormal`` or from :func:`pyro_flat.infer.latent_sites` of a model trace,
that order *is* the model's trace order, which is also the packing order of Pyro's
:class:`~pyro.infer.autoguide.AutoContinuous` guides; :class:`AutoSWAG` checks the sites against the model and
reorders if a collector was filled in another order (e.g. from ``mcmc.get_samples()``).

References:
    * [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov, Pavel Izmailov,
      Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019), arXiv:1902.02476
    * [2] `Averaging Weights Leads to Wider Optima and Better Generalization`, Pavel Izmailov, Dmitrii Podoprikhin,
      Timur Garipov, Dmitry Vetrov, Andrew Gordon Wilson (UAI 2018), arXiv:1803.05407
    * [3] `Flat Seeking Bayesian Neural Networks`, Van-Anh Nguyen, Tung-Long Vuong, Hoang Phan, Thanh-Toan Do,
      Dinh Phung, Trung Le (NeurIPS 2023), arXiv:2302.02713
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.guides import prototype_hide_fn
from pyro.infer.autoguide.initialization import init_to_sample
from torch import Tensor
from torch.distributions import biject_to

from ..._validation import check_int
from ...ops.low_rank import low_rank_log_prob, low_rank_rsample, low_rank_variance
from ...ops.moments import VARIANCE_CLAMP, DeviationBuffer, diagonal_variance, update_running_moments
from ..util import is_real_support, latent_supports


def _check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"`scale` must be a finite number > 0, got {scale!r}")
    return float(scale)


class SWAGCollector:
    r"""Running SWAG moments of the iterates of a trajectory: :math:`\bar\theta`, :math:`m_2` and the last
    :math:`K` deviations.

    :param int max_rank: :math:`K_{\max}\ge1`, the number of deviation columns kept; default 20 (``max_num_models``
        of [1] and of the F-BNN code).
    :param float var_clamp: the lower clamp of the diagonal variance; default :math:`10^{-30}` (reference code).
    :param dtype: the dtype the moments are accumulated in; default ``None``, the dtype of the first collected
        values (as the reference code). ``torch.float64`` avoids the cancellation in :math:`m_2-\bar\theta^2` for
        float32 weights whose variance is below about :math:`10^{-7}|\bar\theta|^2`. The guide casts back to the
        values' dtype.
    :param supports: ``{site: constraint}`` of the collected sites (e.g. :func:`latent_supports`), so that
        :meth:`collect` maps model-space values of constrained sites to unconstrained space; default ``None`` (every
        site real-valued, as a network's weights).

    Call :meth:`collect` (model space) or :meth:`collect_unconstrained` with a dict ``{site: tensor}`` of the current
    iterate — one of the two for the collector's whole life. The first call fixes the sites, their order (see the
    module docstring), unconstrained shapes, dtype and device. ``num_collected`` counts the iterates; ``rank`` is
    :math:`K=\min(\text{num\_collected}, K_{\max})`.
    """

    def __init__(
        self,
        max_rank: int = 20,
        *,
        var_clamp: float = VARIANCE_CLAMP,
        dtype: torch.dtype | None = None,
        supports: Mapping[str, constraints.Constraint] | None = None,
    ) -> None:
        check_int(max_rank, "max_rank", owner="SWAGCollector")
        if isinstance(var_clamp, bool) or not isinstance(var_clamp, (int, float)) or not var_clamp > 0:
            raise ValueError(f"SWAGCollector: `var_clamp` must be a number > 0, got {var_clamp!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"SWAGCollector: `dtype` must be a floating torch.dtype or None, got {dtype!r}")
        if supports is not None and not (
            isinstance(supports, Mapping) and all(isinstance(c, constraints.Constraint) for c in supports.values())
        ):
            raise ValueError(f"SWAGCollector: `supports` must be a dict {{site: constraint}} or None, got {supports!r}")
        self.max_rank = max_rank
        self.var_clamp = float(var_clamp)
        self.dtype = dtype
        self.supports: dict[str, constraints.Constraint] = dict(supports or {})
        self.space: str | None = None  # "model" or "unconstrained", fixed by the first collection
        self.values_dtype: torch.dtype | None = None
        self.num_collected = 0
        self._shapes: dict[str, torch.Size] = {}
        self._mean: Tensor | None = None
        self._sq_mean: Tensor | None = None
        self._deviations: DeviationBuffer | None = None
        self._flat: Tensor | None = None  # the current iterate, flattened (reused by every collection)

    # -----------------------------------------------------------------------------------------------------------------
    # collection
    # -----------------------------------------------------------------------------------------------------------------

    def _flatten(self, values: Mapping[str, Tensor]) -> Tensor:
        if not isinstance(values, Mapping) or not values:
            raise ValueError(f"SWAGCollector.collect: expected a non-empty dict {{site: tensor}}, got {values!r}")
        if set(values) != set(self._shapes):
            raise ValueError(
                f"SWAGCollector.collect: the sites changed; collected so far {list(self._shapes)}, got {list(values)}"
            )
        parts = []
        for name, shape in self._shapes.items():
            value = values[name]
            if value.shape != shape:
                raise ValueError(
                    f"SWAGCollector.collect: site {name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}"
                )
            parts.append(value.detach().reshape(-1).to(dtype=self._mean.dtype, device=self._mean.device))
        if self._flat is None:
            self._flat = torch.empty_like(self._mean)
        return torch.cat(parts, out=self._flat)  # reused: no fresh (page-faulting) copy of the weights per call

    def _allocate(self, values: Mapping[str, Tensor]) -> None:
        if not isinstance(values, Mapping) or not values:
            raise ValueError(f"SWAGCollector.collect: expected a non-empty dict {{site: tensor}}, got {values!r}")
        for name, value in values.items():
            if not isinstance(value, Tensor) or not value.is_floating_point():
                raise ValueError(f"SWAGCollector.collect: site {name!r} must be a floating-point tensor")
        first = next(iter(values.values()))
        self._shapes = {name: value.shape for name, value in values.items()}
        size = sum(v.numel() for v in values.values())
        self.values_dtype = first.dtype
        dtype = first.dtype if self.dtype is None else self.dtype
        self._mean = torch.zeros(size, dtype=dtype, device=first.device)
        self._sq_mean = torch.zeros_like(self._mean)
        self._deviations = DeviationBuffer(self.max_rank, size, dtype=dtype, device=first.device)

    @torch.no_grad()
    def collect(self, values: Mapping[str, Tensor]) -> None:
        r"""Add one iterate ``{site: value}`` given in the **model's space** (constrained, e.g. ``guide.median()``):
        map it to unconstrained space with the collector's ``supports``, then update :math:`\bar\theta`, :math:`m_2`
        and append :math:`\theta-\bar\theta` (new mean) to the deviations. No host synchronisation."""
        self._use_space("model")
        self._collect({name: self._unconstrain(name, value) for name, value in values.items()}
                      if isinstance(values, Mapping) else values)

    @torch.no_grad()
    def collect_unconstrained(self, values: Mapping[str, Tensor]) -> None:
        """Add one iterate ``{site: value}`` already in unconstrained space (a kernel's state, an ``AutoNormal``'s
        unconstrained locations)."""
        self._use_space("unconstrained")
        self._collect(values)

    def _use_space(self, space: str) -> None:
        if self.space is None:
            self.space = space
        elif self.space != space:
            raise ValueError(
                f"SWAGCollector: this collector holds values given in {self.space} space; collect every iterate the "
                f"same way ({'collect' if self.space == 'model' else 'collect_unconstrained'})"
            )

    def _unconstrain(self, name: str, value: Tensor) -> Tensor:
        support = self.supports.get(name)
        if support is None or is_real_support(support):
            return value
        return biject_to(support).inv(value)

    def space_known(self, name: str) -> bool:
        """Whether the collected values of site ``name`` are known to be unconstrained (collected unconstrained, or
        mapped with the site's support); a real-valued site's spaces coincide anyway."""
        return self.space == "unconstrained" or name in self.supports

    def _collect(self, values: Mapping[str, Tensor]) -> None:
        if self._mean is None:
            self._allocate(values)
        theta = self._flatten(values)
        update_running_moments(self._mean, self._sq_mean, theta, self.num_collected)
        self._deviations.append(theta, minus=self._mean)
        self.num_collected += 1

    def collect_samples(self, samples: Mapping[str, Tensor]) -> None:
        """Collect every draw of stacked samples ``{site: [S, ...]}`` in the model's space (e.g.
        ``mcmc.get_samples()``), in order (see :meth:`collect`)."""
        if not samples:
            raise ValueError("SWAGCollector.collect_samples: `samples` is empty")
        sizes = {v.shape[0] for v in samples.values()}
        if len(sizes) != 1:
            raise ValueError(f"SWAGCollector.collect_samples: sites hold different numbers of draws {sizes}")
        for i in range(sizes.pop()):
            self.collect({k: v[i] for k, v in samples.items()})

    def callback(
        self, source: Callable[[], Mapping[str, Tensor]], *, every: int, start: int = 0
    ) -> Callable[[int], None]:
        """A ``callback(step)`` (0-based step index, called after each step) collecting ``source()`` after every
        ``every``-th step past ``start``: after steps ``start + every - 1``, ``start + 2 every - 1``, ...

        :param source: returns the current iterate in the model's space (:meth:`collect`), e.g. ``guide.median``
            (``AutoDelta``, or the medians of an ``AutoNormal``).
        :param int every: steps between collections (``steps_per_epoch`` for once per epoch), >= 1.
        :param int start: the number of steps before collection starts (``swa_start`` epochs x steps per epoch).
        """
        check_int(every, "every", owner="SWAGCollector.callback")
        check_int(start, "start", minimum=0, owner="SWAGCollector.callback")

        def callback(step: int) -> None:
            done = step + 1 - start
            if done > 0 and done % every == 0:
                self.collect(source())

        return callback

    def mcmc_hook(self, every: int = 1) -> Callable[[object, Mapping[str, Tensor], str, int], None]:
        """A ``hook_fn`` for :class:`pyro.infer.MCMC` collecting every ``every``-th sample of the sampling phase
        (not warm-up) from the kernel's unconstrained state (:meth:`collect_unconstrained`)."""
        check_int(every, "every", owner="SWAGCollector.mcmc_hook")

        def hook(kernel: object, params: Mapping[str, Tensor], stage: str, i: int) -> None:
            if stage.startswith("Sample") and i % every == 0:
                self.collect_unconstrained(params)

        return hook

    # -----------------------------------------------------------------------------------------------------------------
    # the moments
    # -----------------------------------------------------------------------------------------------------------------

    def _check_collected(self, what: str) -> None:
        if self.num_collected == 0:
            raise ValueError(f"SWAGCollector.{what}: nothing has been collected yet")

    @property
    def rank(self) -> int:
        """:math:`K`, the number of deviation columns held."""
        return 0 if self._deviations is None else self._deviations.rank

    @property
    def sites(self) -> dict[str, torch.Size]:
        """The collected sites and their unconstrained shapes, in flattening order."""
        return dict(self._shapes)

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """A flat vector ``[P]`` in the collector's order (that of :meth:`flat_mean`) split per site."""
        return self._unflatten(flat)

    def to_flat(self, tensor: Tensor) -> Tensor:
        """``tensor`` in the dtype and on the device of the collector's flat vectors (after a collection)."""
        self._check_collected("to_flat")
        return tensor.to(self._mean)

    def _unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        out, pos = {}, 0
        for name, shape in self._shapes.items():
            n = math.prod(shape)
            out[name] = flat[pos : pos + n].reshape(shape)
            pos += n
        return out

    def _unflatten_columns(self, flat: Tensor) -> dict[str, Tensor]:
        """Split the rows of a ``[P, K]`` matrix per site, shaped ``[*site_shape, K]``."""
        out, pos = {}, 0
        for name, shape in self._shapes.items():
            n = math.prod(shape)
            out[name] = flat[pos : pos + n].reshape(*shape, flat.shape[-1])
            pos += n
        return out

    def flat_mean(self) -> Tensor:
        r""":math:`\bar\theta` (SWA), shape ``[P]``."""
        self._check_collected("flat_mean")
        return self._mean.clone()

    def flat_second_moment(self) -> Tensor:
        r""":math:`m_2`, the running mean of squares, shape ``[P]``."""
        self._check_collected("flat_second_moment")
        return self._sq_mean.clone()

    def flat_variance(self) -> Tensor:
        r""":math:`\Sigma_{\mathrm{diag}}=\max(m_2-\bar\theta^2, \text{var\_clamp})`, shape ``[P]``."""
        self._check_collected("flat_variance")
        return diagonal_variance(self._mean, self._sq_mean, self.var_clamp)

    def deviation_matrix(self) -> Tensor:
        r""":math:`D`, shape ``[P, K]``, oldest column first."""
        self._check_collected("deviation_matrix")
        return self._deviations.matrix()

    def num_clamped(self) -> Tensor:
        r"""How many coordinates have :math:`m_2-\bar\theta^2\le` ``var_clamp`` (their variance is the clamp), as a
        0-d tensor (no host sync); with few iterates or a converged trajectory this can be most of them."""
        self._check_collected("num_clamped")
        return ((self._sq_mean - self._mean.square()) <= self.var_clamp).sum()

    def mean(self) -> dict[str, Tensor]:
        """:meth:`flat_mean` per site (the SWA solution), in unconstrained space."""
        return self._unflatten(self.flat_mean())

    def variance(self) -> dict[str, Tensor]:
        """:meth:`flat_variance` per site."""
        return self._unflatten(self.flat_variance())

    def second_moment(self) -> dict[str, Tensor]:
        """:meth:`flat_second_moment` per site."""
        return self._unflatten(self.flat_second_moment())

    # -----------------------------------------------------------------------------------------------------------------
    # persistence and the guide
    # -----------------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume collection (tensors are copies)."""
        state: dict[str, Any] = {
            "max_rank": self.max_rank,
            "var_clamp": self.var_clamp,
            "num_collected": self.num_collected,
            "sites": {k: tuple(v) for k, v in self._shapes.items()},
            "values_dtype": self.values_dtype,
            "space": self.space,
            "supports": dict(self.supports),
        }
        if self._mean is not None:
            state["mean"] = self._mean.clone()
            state["sq_mean"] = self._sq_mean.clone()
            state["deviation_rows"] = self._deviations.rows.clone()
            state["num_appended"] = self._deviations.num_appended
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the ``max_rank`` must match)."""
        if state["max_rank"] != self.max_rank:
            raise ValueError(f"SWAGCollector.load_state_dict: max_rank {state['max_rank']} != {self.max_rank}")
        self.var_clamp = float(state["var_clamp"])
        self.num_collected = int(state["num_collected"])
        self._shapes = {k: torch.Size(v) for k, v in state["sites"].items()}
        self.values_dtype = state.get("values_dtype")
        self.space = state.get("space")
        self.supports = dict(state.get("supports", {}))
        if "mean" not in state:
            self._mean = self._sq_mean = self._deviations = None
            return
        mean = state["mean"]
        self._mean = mean.clone()
        self._sq_mean = state["sq_mean"].clone()
        self._deviations = DeviationBuffer(self.max_rank, mean.numel(), dtype=mean.dtype, device=mean.device)
        self._deviations.rows.copy_(state["deviation_rows"])
        self._deviations.num_appended = int(state["num_appended"])

    def guide(self, model: Callable, scale: float = 0.5, diagonal_only: bool = False) -> AutoSWAG:
        """The :class:`AutoSWAG` guide of the current moments (a snapshot: later collection does not change it)."""
        return AutoSWAG(model, self, scale=scale, diagonal_only=diagonal_only)


class LowRankPlusDiagonalNormal(dist.TorchDistribution):
    r"""The Gaussian :math:`\mathcal N(\mu,\ \operatorname{diag}(d) + WW^\top)` sampled as
    :math:`\mu + d^{1/2}\odot z_1 + Wz_2` (SWAG's sampler).

    Unlike :class:`~pyro.distributions.LowRankMultivariateNormal`, nothing is factorised at construction (the
    capacitance matrix of that class can fail to factorise when SWAG clamps variances to :math:`10^{-30}`): sampling
    costs :math:`O(PK)`, and :meth:`log_prob` builds the low-rank factorisation only when called. Neither makes a
    :math:`P\times K` temporary, nor do their gradients (:mod:`pyro_flat.ops.low_rank`). Leading dimensions
    of the parameters are batch dimensions, and :meth:`expand` adds them (Pyro's vectorised plates:
    ``Predictive(parallel=True)``, vectorised particles): a batch of draws is the same as as many draws.

    :param loc: :math:`\mu`, shape ``[..., P]``.
    :param cov_diag: :math:`d > 0`, shape ``[..., P]``.
    :param cov_factor: :math:`W`, shape ``[..., P, K]`` (``K = 0`` gives a diagonal Gaussian).
    :param validate_args: as for every torch distribution (default: Pyro's validation setting).
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "cov_diag": constraints.independent(constraints.positive, 1),
        "cov_factor": constraints.independent(constraints.real, 2),
    }
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc: Tensor, cov_diag: Tensor, cov_factor: Tensor, validate_args: bool | None = None) -> None:
        if (loc.dim() < 1 or cov_diag.dim() < 1 or cov_factor.dim() < 2 or cov_diag.shape[-1] != loc.shape[-1]
                or cov_factor.shape[-2] != loc.shape[-1]):
            raise ValueError(
                f"expected loc [..., P], cov_diag [..., P], cov_factor [..., P, K]; got {tuple(loc.shape)}, "
                f"{tuple(cov_diag.shape)}, {tuple(cov_factor.shape)}"
            )
        batch_shape = torch.broadcast_shapes(loc.shape[:-1], cov_diag.shape[:-1], cov_factor.shape[:-2])
        self._set(loc, cov_diag, cov_factor, batch_shape)
        super().__init__(batch_shape, loc.shape[-1:], validate_args=validate_args)

    def _set(self, loc: Tensor, cov_diag: Tensor, cov_factor: Tensor, batch_shape: torch.Size) -> None:
        self._params = (loc, cov_diag, cov_factor)  # unbroadcast: the arithmetic never expands the factor
        self.loc = loc.expand(batch_shape + loc.shape[-1:])
        self.cov_diag = cov_diag.expand(batch_shape + loc.shape[-1:])
        self.cov_factor = cov_factor.expand(batch_shape + cov_factor.shape[-2:])

    @property
    def mean(self) -> Tensor:
        return self.loc

    @property
    def variance(self) -> Tensor:
        _, cov_diag, cov_factor = self._params
        return low_rank_variance(cov_diag, cov_factor, relative=False).expand(self.loc.shape)

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:  # noqa: B008
        loc, cov_diag, cov_factor = self._params
        shape = self._extended_shape(sample_shape)
        z1 = torch.randn(shape, dtype=loc.dtype, device=loc.device)
        rank = cov_factor.shape[-1]
        if rank == 0:
            return loc + cov_diag.sqrt() * z1
        z2 = torch.randn(shape[:-1] + (rank,), dtype=loc.dtype, device=loc.device)
        return low_rank_rsample(loc, cov_diag, cov_factor, z1, z2, relative=False)

    def log_prob(self, value: Tensor) -> Tensor:
        if self._validate_args:
            self._validate_sample(value)
        loc, cov_diag, cov_factor = self._params
        if cov_factor.shape[-1] == 0:
            log_prob = dist.Normal(loc, cov_diag.sqrt()).log_prob(value).sum(-1)
        else:
            log_prob = low_rank_log_prob(value, loc, cov_diag, cov_factor, relative=False)
        return log_prob.expand(torch.broadcast_shapes(value.shape[:-1], self.batch_shape))

    def expand(self, batch_shape: torch.Size, _instance: object = None) -> LowRankPlusDiagonalNormal:
        new = self._get_checked_instance(LowRankPlusDiagonalNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        new._set(*self._params, batch_shape)
        super(LowRankPlusDiagonalNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new


def _flat(values: Mapping[str, Tensor], names: list[str]) -> Tensor:
    return torch.cat([values[n].detach().reshape(-1) for n in names])


class AutoGaussianPosterior(AutoContinuous):
    r"""A fixed Gaussian over the model's latent sites in unconstrained space, given by its moments, as a post-hoc
    Pyro guide (every parameter a **buffer**: nothing to train, like the guide ``AutoLaplaceApproximation``
    returns). SWAG (:class:`AutoSWAG`), HWA and Bayesian SAM (:meth:`pyro_flat.optim.BayesianSAM.guide`) all end in
    one, so that ``Predictive(model, guide=...)``, :func:`~pyro_flat.infer.guide_draws` and
    :func:`~pyro_flat.infer.bma_predict` use them the same way.

    .. math:: q(z) = \mathcal N\big(\mu,\ \operatorname{diag}(v) + WW^\top\big),\qquad \theta = t^{-1}(z),

    :math:`z` the unconstrained values of the sites (``biject_to(support).inv``; the values themselves for real
    sites) and :math:`\theta` what the guide returns, in each site's support (Pyro's ``AutoContinuous`` adds the
    Jacobian). ``median()`` is :math:`t^{-1}(\mu)`.

    :param model: the Pyro model whose latent sites the moments describe (same names, unconstrained shapes).
    :param mean: :math:`\mu` per site, unconstrained.
    :param variance: :math:`v>0` per site.
    :param factor: :math:`W` per site, shaped ``[*site_shape, K]`` (default ``None``: diagonal).
    :raises ValueError: for a non-positive variance or inconsistent shapes; at the first call, if the model's latent
        sites differ from the given ones.
    """

    def __init__(
        self,
        model: Callable,
        mean: Mapping[str, Tensor],
        variance: Mapping[str, Tensor],
        factor: Mapping[str, Tensor] | None = None,
    ) -> None:
        owner = type(self).__name__
        if not isinstance(mean, Mapping) or not mean:
            raise ValueError(f"{owner}: `mean` must be a non-empty dict {{site: tensor}}")
        names = list(mean)
        self._shapes = {n: mean[n].shape for n in names}
        for what, moments in (("variance", variance), ("factor", factor)):
            if moments is not None and (not isinstance(moments, Mapping) or set(moments) != set(names)):
                raise ValueError(f"{owner}: `{what}` must be a dict over the sites {names}")
        for n in names:
            if variance[n].shape != self._shapes[n]:
                raise ValueError(f"{owner}: `variance[{n!r}]` must have shape {tuple(self._shapes[n])}")
            if factor is not None and factor[n].shape[:-1] != self._shapes[n]:
                raise ValueError(f"{owner}: `factor[{n!r}]` must have shape {tuple(self._shapes[n])} + (K,)")
        flat_mean, flat_variance = _flat(mean, names), _flat(variance, names)
        if not bool((flat_variance > 0).all()):
            raise ValueError(f"{owner}: `variance` must be > 0 everywhere")
        rank = 0 if factor is None else next(iter(factor.values())).shape[-1]
        flat_factor = flat_mean.new_zeros(len(flat_mean), 0) if factor is None else torch.cat(
            [factor[n].detach().reshape(-1, rank) for n in names]
        )
        super().__init__(model, init_loc_fn=self._init_at_mean)
        self.register_buffer("posterior_mean", flat_mean)
        self.register_buffer("posterior_variance", flat_variance.to(flat_mean))
        self.register_buffer("posterior_factor", flat_factor.to(flat_mean))

    def _init_at_mean(self, site: dict) -> Tensor:
        """The prototype's values: the mean mapped into each site's support (so that validation holds and a network
        is run at the mean, e.g. the SWA weights); other sites from their prior."""
        name = site["name"]
        if name not in self._shapes:
            return init_to_sample(site)
        self._check_site(name, site["fn"].support)  # a value in the support's space has another shape: say so first
        subsampled = [f.name for f in site["cond_indep_stack"] if f.size != f.full_size]
        if subsampled:
            raise ValueError(
                f"{type(self).__name__}: site {name!r} is a local latent of the subsampled plate {subsampled[0]!r}; a "
                "Gaussian over the packed latent vector cannot follow a minibatch. Call the guide (e.g. Predictive) "
                "on the full data, without subsampling"
            )
        to_support = biject_to(site["fn"].support)
        expected = to_support.inverse_shape(site["fn"].shape())
        if expected != self._shapes[name]:
            raise ValueError(
                f"{type(self).__name__}: site {name!r} has unconstrained shape {tuple(expected)} in the model, "
                f"{tuple(self._shapes[name])} in the moments (values of a local latent collected from minibatches, "
                "e.g. the median() of a guide whose plate subsamples, hold only one minibatch's rows)"
            )
        offset = 0
        for n, shape in self._shapes.items():
            if n == name:
                break
            offset += math.prod(shape)
        z = self.posterior_mean[offset : offset + math.prod(self._shapes[name])].reshape(self._shapes[name])
        return to_support(z).detach()

    def _check_site(self, name: str, support: constraints.Constraint) -> None:
        """Hook: refuse a site whose moments may not be in unconstrained space (see :class:`AutoSWAG`)."""

    def _prototype_hide_fn(self, msg: dict) -> bool:
        # the guide covers exactly the given sites; the model draws every other site itself (e.g. the observation
        # site, which is not observed when Predictive calls the model without targets)
        return prototype_hide_fn(msg) or msg["name"] not in self._shapes

    def _setup_prototype(self, *args: Any, **kwargs: Any) -> None:
        owner = type(self).__name__
        try:
            super()._setup_prototype(*args, **kwargs)
        except RuntimeError:  # AutoContinuous found none of the sites in the model
            if self.prototype_trace is None:
                raise
        found = {name: site for name, site in self.prototype_trace.iter_stochastic_nodes()}
        missing = [name for name in self._shapes if name not in found]
        if missing:
            self.prototype_trace = None
            raise ValueError(
                f"{owner}: the sites {missing} are not latent sample sites of the model (its latent sites among the "
                f"given ones: {list(found)})"
            )
        for name, site in found.items():
            self._check_site(name, site["fn"].support)
        model_shapes = dict(self._unconstrained_shapes)
        for name, shape in model_shapes.items():
            if torch.Size(shape) != torch.Size(self._shapes[name]):
                raise ValueError(
                    f"{owner}: site {name!r} has unconstrained shape {tuple(shape)} in the model, "
                    f"{tuple(self._shapes[name])} in the moments"
                )
        offsets, pos = {}, 0
        for name, shape in self._shapes.items():
            offsets[name] = pos
            pos += math.prod(shape)
        # the model's order equals the moments' iff the sites come in the same order (their shapes match)
        identity = list(model_shapes) == list(self._shapes)
        device = self.posterior_mean.device
        self._order = None if identity else torch.cat(
            [torch.arange(offsets[n], offsets[n] + math.prod(s), device=device) for n, s in model_shapes.items()]
        )

    def _ordered(self, t: Tensor) -> Tensor:
        return t if self._order is None else t[self._order.to(t.device)]

    def get_posterior(self, *args: Any, **kwargs: Any) -> dist.TorchDistribution:
        """The Gaussian over the packed unconstrained latent vector (model trace order); the guide must have run once
        (or pass the model's arguments)."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        return LowRankPlusDiagonalNormal(
            self._ordered(self.posterior_mean), self._ordered(self.posterior_variance),
            self._ordered(self.posterior_factor),
        )

    def _loc_scale(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """The mean and marginal standard deviations (for ``median()`` and ``quantiles()``; pass the model's
        arguments the first time if the guide has not been called yet)."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        posterior = self.get_posterior()
        return posterior.mean, posterior.variance.sqrt()


class AutoSWAG(AutoGaussianPosterior):
    r"""The SWAG posterior of a :class:`SWAGCollector` as a post-hoc Pyro guide (an
    :class:`AutoGaussianPosterior`):

    .. math::
        q(z) = \mathcal N\Big(\bar\theta,\ \lambda\big(\Sigma_{\mathrm{diag}} + \tfrac{1}{K-1}DD^\top\big)\Big)

    over the sites' unconstrained values :math:`z`, sampled as :math:`\bar\theta+\sqrt\lambda(\Sigma_{\mathrm{diag}}
    ^{1/2}z_1 + Dz_2/\sqrt{K-1})`, as the reference ``sample(scale, cov=True)``, with :math:`K` the number of
    deviation columns *held* (the reference divides by ``max_num_models - 1`` even before that many exist).
    ``median()`` is :math:`\bar\theta` mapped to the support: the SWA solution.

    :param model: the Pyro model whose latent sites were collected.
    :param SWAGCollector collector: the moments; copied at construction (later collection does not change the guide).
    :param float scale: :math:`\lambda>0`; default 0.5 (SWAG [1]). Use 1.0 with ``diagonal_only`` for SWAG-Diagonal;
        F-BNN [3] uses 0.1 (F-SWAG) and 0.2 (F-SWAG-Diagonal).
    :param bool diagonal_only: drop the low-rank term (SWAG-Diagonal); default ``False``. Without it the collector
        must hold :math:`K\ge2` columns.
    :param variance: a per-site diagonal variance (> 0, unconstrained) used *instead of* the collector's
        :math:`\Sigma_{\mathrm{diag}}` (e.g. the variance rules of :class:`~pyro_flat.infer.averaging.HWA`); default
        ``None`` (the collector's).
    :raises ValueError: if nothing was collected, for a bad ``scale``, or a low-rank guide with :math:`K<2`; at the
        first call, if the model's latent sites differ from the collected ones, or if a constrained site was
        collected in the model's space without its support (the collector cannot know the values' space).

    Example::

        collector = SWAGCollector(max_rank=20, supports=latent_supports(delta_guide))
        callback = collector.callback(delta_guide.median, every=steps_per_epoch, start=swa_start)
        ...  # SVI steps, calling callback(step) after each
        swag = collector.guide(model, scale=0.5)
        logits = Predictive(model, guide=swag, num_samples=30, return_sites=["logits"])(x_test)["logits"]
    """

    def __init__(
        self,
        model: Callable,
        collector: SWAGCollector,
        *,
        scale: float = 0.5,
        diagonal_only: bool = False,
        variance: Mapping[str, Tensor] | None = None,
    ) -> None:
        if not isinstance(collector, SWAGCollector):
            raise ValueError(f"AutoSWAG: `collector` must be a SWAGCollector, got {type(collector).__name__}")
        if collector.num_collected == 0:
            raise ValueError("AutoSWAG: the collector is empty; collect iterates first")
        self.scale = _check_scale(scale)
        self.diagonal_only = bool(diagonal_only)
        if not self.diagonal_only and collector.rank < 2:
            raise ValueError(
                f"AutoSWAG: the low-rank term needs K >= 2 deviation columns, the collector holds {collector.rank}; "
                "collect more iterates or use diagonal_only=True"
            )
        self._space_known = {name: collector.space_known(name) for name in collector.sites}
        dtype = collector.values_dtype
        mean = {k: v.to(dtype) for k, v in collector.mean().items()}
        diag = collector.variance() if variance is None else dict(variance)
        factor = None
        if not self.diagonal_only:
            columns = collector.deviation_matrix() * math.sqrt(self.scale / (collector.rank - 1))
            factor = collector._unflatten_columns(columns.to(dtype))
        super().__init__(model, mean, {k: (self.scale * v).to(dtype) for k, v in diag.items()}, factor)

    def _check_site(self, name: str, support: constraints.Constraint) -> None:
        if not is_real_support(support) and not self._space_known[name]:
            raise ValueError(
                f"AutoSWAG: site {name!r} has support {support} but the collector received its values in the "
                "model's space without that support, so it cannot tell their space. Build the collector with "
                "SWAGCollector(..., supports=latent_supports(model_or_guide, *args)), or collect unconstrained "
                "values with collect_unconstrained (as mcmc_hook does)"
            )


__all__ = ["AutoGaussianPosterior", "AutoSWAG", "LowRankPlusDiagonalNormal", "SWAGCollector", "latent_supports"]
