r"""The minibatch-aware base of pyro_flat's stochastic-gradient MCMC kernels (a :class:`~pyro.infer.mcmc.MCMCKernel`).

**How the minibatch reaches the model.** Pyro's ``MCMCKernel.sample(params)`` receives no data, and
:func:`pyro.infer.mcmc.util.initialize_model` rejects subsampled plates (``NotImplementedError: HMC/NUTS does not
support model with subsample sites``). The kernels here therefore build the potential themselves:

* ``MCMC.run(*args, **kwargs)`` passes the *full* data set to :meth:`StochasticGradientKernel.setup`, which stores
  the arguments;
* the model draws its minibatch itself, inside ``pyro.plate("data", N, subsample_size=B)``; Pyro then scales the
  minibatch log-likelihood by :math:`N/B`, so the potential

  .. math:: \tilde U(z) = -\log p\big(x(z)\big) - \tfrac{N}{B}\sum_{i\in\mathcal B}\log p(y_i\mid x(z))
      + \log\Big|\det\frac{\partial z}{\partial x}\Big|

  is an unbiased estimate of the full-data potential :math:`U(z) = -\log p(x(z), \mathcal D) + \log|\det J|` in
  the unconstrained coordinates :math:`z = t(x)` (:math:`t` = ``biject_to(site["fn"].support).inv``, as in Pyro);
* the model is re-run (re-traced) at every gradient evaluation, so every step draws a fresh minibatch; the plate's
  subsample site (``"data"``) is not a latent and is never part of ``params``.

The bias of SG-MCMC without a Metropolis correction, the step-size convention and the temperature are those of
:mod:`pyro_flat.ops.diffusions`: one Langevin step is :math:`z' = z - \varepsilon\nabla\tilde U(z) +
\sqrt{2\varepsilon T}\,\xi` and :math:`T = 1` targets the posterior.

**Draws, warm-up and thinning.** ``MCMC(kernel, num_samples, warmup_steps)`` calls :meth:`~StochasticGradientKernel
.sample` ``warmup_steps + num_samples`` times. A warm-up call takes one *transition* (one gradient step for SGLD, one
outer step for the nested Entropy-SGD kernels). After warm-up a call runs until the next draw: ``thinning``
transitions, or, with a schedule that collects (:class:`~pyro_flat.infer.mcmc.CyclicalStepSize`), until a collection
step. ``MCMC`` keeps every draw; to keep them in rows allocated once (in memory or in files), give them a
:class:`~pyro_flat.infer.mcmc.DrawBuffer`; to keep none, stream them (:class:`~pyro_flat.infer.mcmc.DrawHook`).

**Divergence** (:mod:`pyro_flat.infer.mcmc.divergence`). Each gradient step records, on the device and without a
host synchronisation, whether each site's new value and the potential are finite, and the first step at which one was
not. The record is read every ``divergence_check_every`` steps, in :meth:`diagnostics` and by :meth:`check_divergence`;
a non-finite value raises a ``FloatingPointError`` naming the (exact) first step and the site. Reading the record (one
host read per check) is the only host synchronisation of the hot loop; the progress bar shows the step size (a Python
number) and the potential energy read at the last check.

**Compilation** (``jit_compile=True``, like Pyro's ``HMC``): the gradient evaluation — the model run at the
current values, its potential and the backward pass — is captured once per shape of the latent values as a pure
tensor function (:mod:`pyro_flat.infer.compiled`) and compiled with :func:`torch.compile` (``jit_options``). The
minibatch's random indices and every other random number are drawn outside the graph, as the eager step draws them,
so the chain is the eager chain (the same draws given the same seed, up to floating-point rounding). The first
gradient step runs eagerly, the second is captured, the third compiles (tens of seconds on a CPU); a model that cannot
be captured runs eagerly after one :class:`~pyro_flat.infer.compiled.CompilationFallbackWarning`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from pyro.poutine.util import site_is_subsample
from torch import Tensor
from torch.distributions import biject_to
from torch.distributions.transforms import ComposeTransform, IndependentTransform, Transform

from ..._validation import check_int, check_positive
from ..compiled import CompiledCalls, module_key, options_key, tensor_key
from ..util import at_latent_values, is_latent_site, subsampled_plate
from .divergence import describe, first_divergence, nonfinite_arguments, record_finiteness
from .schedules import StepSizeSchedule, as_schedule

__all__ = ["ModelPotential", "initialize_sg_model", "SamplerState", "StochasticGradientKernel"]

Params = dict[str, Tensor]


def _is_identity(transform: Transform) -> bool:
    """Whether ``transform`` is Pyro's identity bijection (``biject_to(real)`` and its ``independent`` versions)."""
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return isinstance(transform, ComposeTransform) and not transform.parts


class ModelPotential:
    r"""The potential :math:`\tilde U(z)` of a Pyro model in unconstrained coordinates, re-traced at every call.

    Each call runs ``model(*model_args, **model_kwargs)`` at the constrained values :math:`x = t^{-1}(z)` (set as
    latent values by :func:`~pyro_flat.infer.at_latent_values`, not observed), so subsampled plates draw a fresh
    minibatch and scale it by :math:`N/B`; the result is
    :math:`-\log p + \sum \log|\det \partial t(x)/\partial x|` (the Jacobian term only for constrained sites).

    :param model: the Pyro model.
    :param tuple model_args: its positional arguments (typically the full data set).
    :param dict model_kwargs: its keyword arguments (e.g. ``subsample_size``).
    :param dict transforms: ``{site: t}`` mapping each latent site's support to the reals.
    :raises ValueError: (at call time) if the model samples a latent site that is not in ``params``.
    """

    def __init__(
        self, model: Callable, model_args: tuple, model_kwargs: dict, transforms: Mapping[str, Transform]
    ) -> None:
        self.model = model
        self.model_args = model_args
        self.model_kwargs = model_kwargs
        self.transforms = dict(transforms)
        self._constrained = {k: t for k, t in self.transforms.items() if not _is_identity(t)}

    def __call__(self, params: Mapping[str, Tensor]) -> Tensor:
        values = dict(params)
        log_det = None
        for name, transform in self._constrained.items():
            z = params[name]
            x = transform.inv(z)
            values[name] = x
            term = transform.log_abs_det_jacobian(x, z).sum()
            log_det = term if log_det is None else log_det + term
        trace = poutine.trace(at_latent_values(self.model, values)).get_trace(*self.model_args, **self.model_kwargs)
        for name, site in trace.nodes.items():
            if site["type"] == "sample" and name not in values and is_latent_site(site):
                raise ValueError(
                    f"the model sampled latent site {name!r}, which is not among the kernel's parameters "
                    f"{sorted(values)}; a model's latent sites must not change between calls"
                )
        # subsample sites excluded: their log-density is a constant zero that Pyro makes from a Python number on
        # the device at every call (a blocking host-to-device copy on a GPU)
        potential = -trace.log_prob_sum(site_filter=lambda _, site: not site_is_subsample(site))
        return potential if log_det is None else potential + log_det


def initialize_sg_model(
    model: Callable, model_args: tuple = (), model_kwargs: dict | None = None, init_strategy: Callable = init_to_median
) -> tuple[Params, ModelPotential, dict[str, Transform]]:
    r"""Pyro's ``initialize_model`` for stochastic-gradient kernels, accepting subsampled plates.

    Runs the model once under ``InitMessenger(init_strategy)``; every latent site (see
    :func:`~pyro_flat.infer.util.is_latent_site`: subsample, observed and deterministic sites excluded) gets the
    transform ``biject_to(site["fn"].support).inv`` and an initial value in unconstrained space.

    :param model: the Pyro model.
    :param tuple model_args: the model's positional arguments.
    :param model_kwargs: the model's keyword arguments.
    :type model_kwargs: dict or None
    :param init_strategy: a per-site initialisation function (e.g. ``init_to_median``,
        :class:`~pyro_flat.nn.init_to_network`).
    :returns: ``(initial_params, potential_fn, transforms)``.
    :raises ValueError: if the model has no latent site, or a discrete one (named in the message).
    """
    model_kwargs = {} if model_kwargs is None else dict(model_kwargs)
    with torch.no_grad():
        trace = poutine.trace(InitMessenger(init_strategy)(model)).get_trace(*model_args, **model_kwargs)
    transforms, params = {}, {}
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or not is_latent_site(site):
            continue
        fn = site["fn"]
        if fn.support.is_discrete or getattr(fn, "has_enumerate_support", False):
            raise ValueError(
                f"site {name!r} is a discrete latent ({type(fn).__name__}); stochastic-gradient kernels need "
                "continuous latent sites (marginalise or condition the discrete ones)"
            )
        plate = subsampled_plate(site)
        if plate is not None:
            raise ValueError(
                f"site {name!r} is a local latent inside the subsampled plate {plate!r}: a kernel's state "
                "would hold only one minibatch's values of it. Sample local latents without subsampling their plate "
                "(subsample only the plates of observations), or marginalise them"
            )
        transform = biject_to(fn.support).inv
        transforms[name] = transform
        params[name] = transform(site["value"].detach())
    if not params:
        raise ValueError("the model has no latent sample site: there is nothing to sample")
    return params, ModelPotential(model, tuple(model_args), model_kwargs, transforms), transforms


@dataclass
class SamplerState:
    """The bookkeeping of one chain (reset by ``setup`` and ``cleanup``); parameters are not part of it.

    :param int num_calls: calls of ``sample`` so far (warm-up included).
    :param int step: gradient steps taken (warm-up included); the index :math:`t` of the step-size schedule.
    :param float step_size: the step size of the last gradient step.
    :param float potential: the potential energy read at the last divergence check (``nan`` before).
    :param dict first_bad: per group of tracked tensors (keyed by their labels), int64 tensors on the device holding
        the first step at which each tensor (and the potential, when tracked) was non-finite, or -1.
    :param last_potential: the potential energy of the last gradient evaluation, on the device.
    :type last_potential: Tensor or None
    """

    num_calls: int = 0
    step: int = 0
    step_size: float = math.nan
    potential: float = math.nan
    first_bad: dict[tuple[str, ...], Tensor] = field(default_factory=dict)
    last_potential: Tensor | None = None


class StochasticGradientKernel(MCMCKernel):
    r"""Base class of the stochastic-gradient kernels: model/potential handling, schedules, thinning, divergence
    tracking and the bookkeeping :class:`SamplerState`. Subclasses implement :meth:`_transition`.

    :param model: a Pyro model whose minibatch is drawn inside ``pyro.plate("data", N, subsample_size=B)`` (see the
        module docstring); exactly one of ``model`` and ``potential_fn``.
    :param potential_fn: a callable ``{name: tensor} -> scalar`` potential :math:`U` (it draws its own minibatch);
        then ``initial_params`` must be given (to ``MCMC`` or the kernel).
    :param step_size: :math:`\varepsilon > 0`, a number or a :class:`~pyro_flat.infer.mcmc.StepSizeSchedule`
        (on the full-data scale: a mean-loss learning rate :math:`\alpha` corresponds to :math:`\alpha/N`).
    :param float temperature: :math:`T \ge 0` (default 1, the posterior; 0 gives stochastic gradient descent).
    :param init_strategy: per-site initialisation (default ``init_to_median``; for networks use
        :class:`~pyro_flat.nn.init_to_network`).
    :param int thinning: transitions per draw after warm-up (default 1) when the schedule does not collect.
    :param int divergence_check_every: gradient steps between two reads of the divergence record (default 100).
    :param bool jit_compile: capture the gradient evaluation once and compile it (see the module docstring);
        default ``False``.
    :param jit_options: options of :func:`torch.compile` for ``jit_compile`` (e.g. ``{"mode": "max-autotune"}``);
        ``{"backend": None}`` evaluates the captured graph without compiling it.
    :type jit_options: dict or None

    Subclasses take these options as keyword arguments after their own.
    """

    def __init__(
        self,
        model: Callable | None = None,
        potential_fn: Callable[[Params], Tensor] | None = None,
        *,
        step_size: float | StepSizeSchedule,
        temperature: float = 1.0,
        init_strategy: Callable = init_to_median,
        thinning: int = 1,
        divergence_check_every: int = 100,
        jit_compile: bool = False,
        jit_options: dict | None = None,
    ) -> None:
        owner = type(self).__name__
        if (model is None) == (potential_fn is None):
            raise ValueError(f"{owner}: expected exactly one of model and potential_fn")
        if model is not None and not callable(model):
            raise ValueError(f"{owner}: expected model to be callable, got {model!r}")
        if potential_fn is not None and not callable(potential_fn):
            raise ValueError(f"{owner}: expected potential_fn to be callable, got {potential_fn!r}")
        self.model = model
        self.schedule = as_schedule(step_size, "step_size")
        self.temperature = check_positive(temperature, "temperature", owner=owner, allow_zero=True)
        if not callable(init_strategy):
            raise ValueError(f"{owner}: expected init_strategy to be callable, got {init_strategy!r}")
        self.init_strategy = init_strategy
        self.thinning = check_int(thinning, "thinning", owner=owner)
        self.divergence_check_every = check_int(divergence_check_every, "divergence_check_every", owner=owner)
        if not isinstance(jit_compile, bool):
            raise ValueError(f"{owner}: expected jit_compile to be a bool, got {jit_compile!r}")
        if jit_options is not None and not isinstance(jit_options, Mapping):
            raise ValueError(f"{owner}: expected jit_options to be a dict or None, got {jit_options!r}")
        self.jit_compile = jit_compile
        self.jit_options = None if jit_options is None else dict(jit_options)
        self._compiled = CompiledCalls(owner, jit_options)
        self._data: tuple[list[Tensor], object] = ([], ())
        self.potential_fn = potential_fn
        self.transforms: dict[str, Transform] | None = None if model is not None else {}
        self._user_initial_params: Params | None = None
        self._initial_params: Params | None = None
        self._user_save_params: list[str] | None = None
        self._warmup_steps = 0
        self._state = SamplerState()

    # ------------------------------------------------------------------------------------------------------------
    # MCMCKernel interface

    @property
    def initial_params(self) -> Params | None:
        """The initial parameters (unconstrained) of the chain: those set by the user, else (after :meth:`setup`)
        the ones drawn by ``init_strategy``."""
        return self._initial_params if self._initial_params is not None else self._user_initial_params

    @initial_params.setter
    def initial_params(self, params: Mapping[str, Tensor]) -> None:
        self._user_initial_params = {k: v.detach() for k, v in params.items()}
        self._initial_params = None

    @property
    def save_params(self) -> list[str] | None:
        """The sites ``MCMC`` keeps, sorted (``MCMC`` unpacks its flat samples in sorted order): the ones set by
        the user or by ``MCMC(save_params=...)``, else all parameters (after :meth:`setup`)."""
        if self._user_save_params is not None:
            return sorted(self._user_save_params)
        default = self._default_save_params()
        return None if default is None else sorted(default)

    @save_params.setter
    def save_params(self, names: list[str]) -> None:
        self._user_save_params = list(names)

    def _default_save_params(self) -> list[str] | None:
        return None if self._initial_params is None else list(self._initial_params)

    def setup(self, warmup_steps: int, *args: object, **kwargs: object) -> None:
        """Store the model arguments (the full data set), build the potential, draw or check the initial
        parameters and reset the chain's bookkeeping.

        :param int warmup_steps: the number of warm-up calls of :meth:`sample` (one transition each).
        :param args: the model's positional arguments (passed on by ``MCMC.run``).
        :param kwargs: the model's keyword arguments (e.g. ``subsample_size=B``).
        """
        owner = type(self).__name__
        self._warmup_steps = check_int(warmup_steps, "warmup_steps", minimum=0, owner=owner)
        if self.model is not None:
            init, potential, transforms = self._initialize_model(args, kwargs)
            self.potential_fn, self.transforms = potential, transforms
            params = init if self._user_initial_params is None else dict(self._user_initial_params)
        else:
            if self._user_initial_params is None:
                raise ValueError(
                    f"{owner} built with potential_fn needs initial parameters: pass initial_params to MCMC or set "
                    "kernel.initial_params"
                )
            params = dict(self._user_initial_params)
        params = self._complete_initial_params(params)
        if self.model is not None:
            expected, got = set(self.transforms), set(params)
            if expected != got:
                raise ValueError(
                    f"{owner}: initial_params must have exactly the model's latent sites {sorted(expected)}; missing "
                    f"{sorted(expected - got)}, unexpected {sorted(got - expected)}"
                )
        self._initial_params = {k: v.detach().clone() for k, v in params.items()}
        self._state = SamplerState()
        tensors, key = tensor_key((args, kwargs))
        self._data = (tensors, (key, module_key(self.model)))
        self._setup_chain(self._initial_params)

    def sample(self, params: Mapping[str, Tensor]) -> Params:
        """Advance the chain: one transition during warm-up, afterwards until the next draw (see the module
        docstring); returns the new parameters (unconstrained)."""
        state = self._state
        warmup = state.num_calls < self._warmup_steps
        state.num_calls += 1
        params = dict(params)
        transitions = 0
        while True:
            start = state.step
            params = self._transition(params)
            transitions += 1
            if warmup:
                return params
            rules = [self.schedule.collects(t) for t in range(start, state.step)]
            if rules and rules[0] is not None:
                if any(rules):
                    return params
            elif transitions >= self.thinning:
                return params

    def set_model_args(self, *args: object, **kwargs: object) -> None:
        """Give the model new arguments for the following gradient evaluations (after :meth:`setup`): a driver that
        feeds external minibatches (e.g. augmented images from a ``DataLoader``, with ``num_data=N``) calls it before
        each :meth:`sample`. Every gradient evaluation until the next call sees these arguments.

        :raises ValueError: if the kernel was built with ``potential_fn`` (it has no model arguments), or before
            :meth:`setup`.
        """
        potential = self.potential_fn if self.model is not None else None
        if not isinstance(potential, ModelPotential):  # e.g. EntropyMCMC's coupled potential wraps the model's
            potential = getattr(potential, "potential", None)
        if not isinstance(potential, ModelPotential):
            raise ValueError(f"{type(self).__name__}.set_model_args: needs a kernel built on a model, after setup()")
        potential.model_args, potential.model_kwargs = tuple(args), dict(kwargs)
        tensors, key = tensor_key((args, kwargs))  # the inputs (and capture key) of the compiled gradient
        self._data = (tensors, (key, module_key(self.model)))

    def state_dict(self) -> dict:
        """The chain's bookkeeping (step counter, divergence record, ...) and per-chain state (momenta, inner chains),
        to resume a chain exactly with :meth:`load_state_dict` after :meth:`setup` (the parameters themselves are the
        driver's: ``MCMC`` passes them to :meth:`sample`)."""
        return {"sampler": dataclasses.asdict(self._state), "chain": self._chain_state()}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a :meth:`state_dict` (call after :meth:`setup`)."""
        self._state = SamplerState(**state["sampler"])
        self._load_chain_state(state["chain"])

    def logging(self) -> OrderedDict:
        """The progress bar's fields: the last step size and the potential energy at the last divergence check (no
        host synchronisation)."""
        return OrderedDict(
            [("step size", f"{self._state.step_size:.2e}"), ("potential", f"{self._state.potential:.4g}")]
        )

    def diagnostics(self) -> dict:
        """Checks the divergence record (raises on a non-finite value), then returns the number of gradient steps."""
        self.check_divergence()
        return {"gradient_steps": self._state.step}

    def cleanup(self) -> None:
        """Forget the chain's user-set initial parameters and bookkeeping (``MCMC`` calls it after every chain, so
        sequential chains do not share state)."""
        self._user_initial_params = None
        self._initial_params = None
        self._state = SamplerState()
        self._cleanup_chain()

    # ------------------------------------------------------------------------------------------------------------
    # helpers for subclasses

    @property
    def num_gradient_steps(self) -> int:
        """Gradient evaluations of the current chain so far (warm-up included)."""
        return self._state.step

    def _initialize_model(
        self, args: tuple, kwargs: dict
    ) -> tuple[Params, Callable[[Params], Tensor], dict[str, Transform]]:
        """Hook: ``(initial params, potential, transforms)`` of ``self.model`` (default :func:`initialize_sg_model`)."""
        return initialize_sg_model(self.model, args, kwargs, self.init_strategy)

    def _complete_initial_params(self, params: Params) -> Params:
        """Hook: add derived initial parameters (e.g. anchors) before they are checked."""
        return params

    def _setup_chain(self, params: Params) -> None:
        """Hook: set up per-chain state (momenta, inner chains)."""

    def _cleanup_chain(self) -> None:
        """Hook: drop per-chain state."""

    def _chain_state(self) -> dict:
        """Hook: the per-chain state :meth:`state_dict` saves (default: none)."""
        return {}

    def _load_chain_state(self, state: Mapping) -> None:
        """Hook: restore :meth:`_chain_state`."""

    def _transition(self, params: Params) -> Params:
        raise NotImplementedError

    def _step_parameters(self, t: int) -> tuple[float, float]:
        """``(step size, temperature)`` of gradient step ``t`` (temperature 0 where the schedule injects no
        noise)."""
        step_size = self.schedule(t)
        if not (step_size > 0 and math.isfinite(step_size)):
            raise ValueError(f"{type(self).__name__}: the schedule {self.schedule!r} gave step size {step_size} at "
                             f"step {t}; expected a finite number > 0")
        temperature = self.temperature if self.schedule.injects_noise(t) else 0.0
        self._state.step_size = step_size
        return step_size, temperature

    @staticmethod
    def _noise(value: Tensor, temperature: float) -> Tensor | None:
        return torch.randn_like(value) if temperature > 0 else None

    def _potential_grad(self, params: Mapping[str, Tensor]) -> tuple[Params, Tensor]:
        """``(grad U, U)`` at ``params`` (one gradient evaluation; a fresh minibatch for a model): :meth:`_gradient`,
        captured and compiled with ``jit_compile``."""
        if not self.jit_compile:
            return self._gradient(params)
        names = list(params)
        tensors, data_key = self._data
        key = (tuple((n, params[n].shape, params[n].dtype, params[n].device) for n in names), data_key,
               options_key(self))
        with torch.no_grad():
            return self._compiled(key, lambda: self._gradient(params), lambda: [params[n] for n in names] + tensors)

    def _gradient(self, params: Mapping[str, Tensor]) -> tuple[Params, Tensor]:
        """``(grad U, U)`` at ``params``, eagerly (the hook a kernel with its own potential overrides)."""
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        with torch.enable_grad():
            potential = self.potential_fn(leaves)
            grads = torch.autograd.grad(potential, list(leaves.values()), materialize_grads=True)
        return dict(zip(leaves, grads, strict=True)), potential.detach()

    def _record(
        self, tensors: Mapping[str, Tensor], potential: Tensor | None, *, steps: int = 1, label: str = ""
    ) -> None:
        """Record the finiteness of ``tensors`` (and ``potential``) at the current step (:mod:`.divergence`), then
        advance the step counter by ``steps`` gradient evaluations; read the record every ``divergence_check_every``
        steps."""
        state = self._state
        record_finiteness(state.first_bad, {f"{name}{label}": v for name, v in tensors.items()}, potential, state.step)
        if potential is not None:
            state.last_potential = potential
        before = state.step
        state.step += steps
        if state.step // self.divergence_check_every > before // self.divergence_check_every:
            self.check_divergence()

    def check_divergence(self) -> None:
        """Read the divergence record (one host synchronisation; a second one only to name a divergence).

        :raises FloatingPointError: naming the first gradient step (counted from 0, warm-up included) at which a
            site or the potential energy became NaN or infinite, and which.
        """
        state = self._state
        potential, divergence = first_divergence(state.first_bad, state.last_potential)
        if potential is not None:
            state.potential = potential
        if divergence is None:
            return
        step, names = divergence
        model_potential = self.potential_fn
        if not isinstance(model_potential, ModelPotential):
            model_potential = getattr(model_potential, "potential", None)  # e.g. EntropyMCMC's coupled potential
        bad_data = [] if not isinstance(model_potential, ModelPotential) else nonfinite_arguments(
            model_potential.model, model_potential.model_args, model_potential.model_kwargs)
        if bad_data:
            advice = (
                f"The model's data hold NaN or infinite values ({', '.join(bad_data)}), which the step size "
                "cannot fix: clean the data, or mask missing values (e.g. pyro.sample(..., obs_mask=...))."
            )
        else:
            advice = (
                f"The step size there was {self.schedule(step):.3g} and the temperature {self.temperature:g}; "
                "lower the step size, or check the model and the initial values."
            )
        raise FloatingPointError(
            f"{type(self).__name__} diverged at gradient step {step} (counted from 0, warm-up included): "
            f"{describe(names)} became NaN or infinite. {advice}"
        )
