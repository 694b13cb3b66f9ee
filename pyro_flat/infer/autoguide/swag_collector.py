r"""The SWAG moments of any trajectory's iterates: :class:`SWAGCollector` (pure bookkeeping, no Pyro state; the
guide it builds is :class:`~pyro_flat.infer.autoguide.AutoSWAG`, the maths in :mod:`pyro_flat.infer.autoguide.swag`).

**Spaces.** The moments are kept in the *unconstrained* space of each site (``biject_to(support).inv``; for the
real-valued weights of a network it is the latent space itself), where a Gaussian is a sensible family.
:meth:`SWAGCollector.collect` takes values in the **model's space** (constrained, as Pyro returns them
everywhere) and maps them with the sites' supports given to the collector (``supports=``, e.g.
:func:`~pyro_flat.infer.util.latent_supports`);
:meth:`SWAGCollector.collect_unconstrained` takes unconstrained values (a kernel's state, a guide's unconstrained
locations). A guide built for a constrained site whose space the collector cannot know (model-space values without
the site's support) is refused with an error naming the site. Collecting from any trajectory:

* SGD/Adam MAP with ``AutoDelta`` through Pyro's ``SVI``, or the means of an SVI guide: ``collector =
  SWAGCollector(supports=latent_supports(guide))`` then ``callback = collector.callback(guide.median,
  every=steps_per_epoch, start=swa_start_step)``, called as ``callback(step)`` after every step;
* SAM / bSAM / any torch optimizer on a dict of tensors ``theta``: ``collector.collect(theta)`` once per epoch
  (SWAG from SAM iterates **is F-SWAG**, Flat Seeking Bayesian Neural Networks, NeurIPS 2023);
* SG-MCMC (SGLD) through Pyro's ``MCMC``: ``MCMC(kernel, ..., hook_fn=collector.mcmc_hook(every=10))`` (Pyro
  passes the kernel's unconstrained state), or afterwards ``collector.collect_samples(mcmc.get_samples())`` (model
  space).

**Flattening order.** The flat vectors (:meth:`SWAGCollector.flat_mean`, :meth:`~SWAGCollector.flat_variance`,
:meth:`~SWAGCollector.deviation_matrix`) concatenate the sites in the order of the first collected dict. Collected from
``guide.median()`` of an ``AutoDelta``/``AutoNormal`` or from :func:`pyro_flat.infer.latent_sites` of a model trace,
that order *is* the model's trace order, which is also the packing order of Pyro's
:class:`~pyro.infer.autoguide.AutoContinuous` guides; :class:`~pyro_flat.infer.autoguide.AutoSWAG` checks the sites
against the model and reorders if a collector was filled in another order (e.g. from ``mcmc.get_samples()``).

References:
    * [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov, Pavel Izmailov,
      Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019), arXiv:1902.02476
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from pyro.distributions import constraints
from torch import Tensor
from torch.distributions import biject_to

from ..._validation import check_int, check_positive
from ...ops.moments import VARIANCE_CLAMP, DeviationBuffer, diagonal_variance, update_running_moments
from ..util import is_real_support
from .swag import AutoSWAG

__all__ = ["SWAGCollector"]


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
    :param supports: ``{site: constraint}`` of the collected sites (e.g.
        :func:`~pyro_flat.infer.util.latent_supports`), so that :meth:`collect` maps model-space values of constrained
        sites to unconstrained space; default ``None`` (every site real-valued, as a network's weights).

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
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"SWAGCollector: `dtype` must be a floating torch.dtype or None, got {dtype!r}")
        if supports is not None and not (
            isinstance(supports, Mapping) and all(isinstance(c, constraints.Constraint) for c in supports.values())
        ):
            raise ValueError(f"SWAGCollector: `supports` must be a dict {{site: constraint}} or None, got {supports!r}")
        self.max_rank = max_rank
        self.var_clamp = check_positive(var_clamp, "var_clamp", owner="SWAGCollector")
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
        """Restore a :meth:`state_dict` (the ``max_rank`` must match). A collector built with a ``dtype`` keeps its
        moments in it: those of a narrower dtype are converted (exactly), those of a wider one refused (they would be
        rounded)."""
        if state["max_rank"] != self.max_rank:
            raise ValueError(f"SWAGCollector.load_state_dict: max_rank {state['max_rank']} != {self.max_rank}")
        saved = state["mean"].dtype if "mean" in state else None
        if saved is not None and self.dtype is not None and torch.promote_types(saved, self.dtype) != self.dtype:
            raise ValueError(
                f"SWAGCollector.load_state_dict: the state holds {saved} moments and this collector keeps "
                f"dtype={self.dtype}, which would round them; build the collector with dtype={saved} or None"
            )
        self.var_clamp = float(state["var_clamp"])
        self.num_collected = int(state["num_collected"])
        self._shapes = {k: torch.Size(v) for k, v in state["sites"].items()}
        self.values_dtype = state.get("values_dtype")
        self.space = state.get("space")
        self.supports = dict(state.get("supports", {}))
        self._flat = None  # the buffer of the next collection: made again, in the loaded size and dtype
        if "mean" not in state:
            self._mean = self._sq_mean = self._deviations = None
            return
        mean = state["mean"]
        dtype = saved if self.dtype is None else self.dtype
        self._mean = mean.to(dtype, copy=True)
        self._sq_mean = state["sq_mean"].to(dtype, copy=True)
        self._deviations = DeviationBuffer(self.max_rank, mean.numel(), dtype=dtype, device=mean.device)
        self._deviations.rows.copy_(state["deviation_rows"])
        self._deviations.num_appended = int(state["num_appended"])

    def guide(self, model: Callable, scale: float = 0.5, diagonal_only: bool = False) -> AutoSWAG:
        """The :class:`AutoSWAG` guide of the current moments (a snapshot: later collection does not change it)."""
        return AutoSWAG(model, self, scale=scale, diagonal_only=diagonal_only)
