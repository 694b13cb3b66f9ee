r"""Compiled flat objectives, like Pyro's :class:`~pyro.infer.JitTrace_ELBO`: the loss of a step is captured once as a
pure function of the guide's (and the model's) parameters, the model's tensor arguments and the step's random numbers
(:mod:`pyro_flat.infer.compiled`), then compiled with :func:`torch.compile`.

Each class computes exactly the loss of its eager counterpart — the same guide draw, minibatch, perturbed pass and
random numbers (given the same seed, the same values up to floating-point rounding) — only without re-running Pyro's
tracing at every step. As for ``JitTrace_ELBO``, the model and guide must have a static structure for given argument
shapes: a capture is made per model, guide, shapes, dtypes and devices of the tensor arguments, values of the other
arguments, and train/eval modes and buffers of ``nn.Module`` models and guides. The first step of each runs eagerly
(guides set themselves up), the second is captured (an eager step recorded), the third compiles (tens of seconds on
a CPU), later ones run the compiled loss. A model that cannot be captured (Python control flow on tensor values, a
random draw that depends on learned values, ...) runs eagerly after one
:class:`~pyro_flat.infer.compiled.CompilationFallbackWarning` naming the reason.

``loss_and_grads`` and ``differentiable_loss`` are compiled; ``loss`` (``SVI.evaluate_loss``) is the eager one, as in
Pyro. The compiled SA-ELBOs with LookSAM or RST (``looksam_k``, ``rst_p``) decide each step's kind in Python before
the step and keep one capture per kind (the ascent, a LookSAM reuse step, an RST step without the ascent), each made
and compiled the first times its kind comes up; LookSAM's directions are tensors updated in place, which the captures
read and write like BatchNorm statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any

import pyro
import torch
from pyro import poutine
from pyro.infer.util import is_validation_enabled
from pyro.poutine.runtime import effectful
from pyro.util import warn_if_nan
from torch import Tensor

from ..._internals import handler_stack, set_unconstrained, unconstrained_params
from ...runtime.compiled_calls import CompiledCalls, module_key, options_key, tensor_key
from .kl_ball import KLBallELBO
from .sharpness_aware import SharpnessAwareELBO, SharpnessAwareMeanFieldELBO
from .trace_elbo import TensorTrace_ELBO

__all__ = ["JitKLBallELBO", "JitSharpnessAwareELBO", "JitSharpnessAwareMeanFieldELBO", "JitTensorTrace_ELBO"]


@effectful(type="param")
def _compiled_param(name: str, value: Tensor) -> Tensor:
    """A parameter statement whose constrained value a compiled step has computed (``pyro.param`` would compute it
    again)."""
    return value


class _Jit:
    """Shared by the compiled ELBOs: the loss of a step evaluated through :class:`~pyro_flat.infer.compiled
    .CompiledCalls`."""

    def __init__(self, *args: Any, jit_options: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if jit_options is not None and not isinstance(jit_options, dict):
            raise ValueError(f"{type(self).__name__}: `jit_options` must be a dict or None, got {jit_options!r}")
        self.jit_options = None if jit_options is None else dict(jit_options)
        self._compiled = CompiledCalls(type(self).__name__, jit_options)
        self._param_names: dict[Hashable, list[str]] = {}
        self._programs: dict[Hashable, tuple[Callable, Callable]] = {}

    def _particle_loss(self, model_trace: poutine.Trace, guide_trace: poutine.Trace) -> Tensor:
        """The differentiable loss of one particle: the eager ELBO's surrogate (its value is the loss, every guide
        site being reparameterised, which the eager ELBO checks)."""
        return self._differentiable_loss_particle(model_trace, guide_trace)[1]

    def _eager_loss(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> Tensor:
        loss = 0.0
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            loss = loss + self._particle_loss(model_trace, guide_trace) / self.num_particles
        return torch.as_tensor(loss)

    def compiled_loss(self, model: Callable, guide: Callable, *args: Any, **kwargs: Any) -> Tensor:
        """The loss of one step (a differentiable scalar tensor), evaluated eagerly, captured or compiled; an objective
        whose steps come in kinds (``_scheduled_step``, the SA-ELBOs' LookSAM and RST) has one capture per kind."""
        scheduled = getattr(self, "_scheduled_step", None)
        with contextlib.nullcontext(()) if scheduled is None else scheduled() as step_key:
            return self._compiled_loss(model, guide, args, kwargs, step_key)

    def _compiled_loss(self, model: Callable, guide: Callable, args: tuple, kwargs: dict, step_key: tuple) -> Tensor:
        tensors, arg_key = tensor_key((args, kwargs))
        key = (id(model), id(guide), arg_key, module_key(model, guide), options_key(self), torch.is_grad_enabled(),
               step_key)
        self._programs.setdefault(key, (model, guide))  # holds them, so that their ids stay theirs
        mode = self._compiled.mode(key)

        def step() -> tuple[Tensor, list[Tensor]]:
            with poutine.trace(param_only=True) as params:
                loss = self._eager_loss(model, guide, args, kwargs)
            names = self._param_names[key] = sorted(params.trace.nodes)
            # the captured step also returns the parameters' constrained values, for the parameter statements
            store = pyro.get_param_store()
            return loss, [store[name] for name in names] if mode == "capture" else []

        def inputs() -> list[Tensor]:
            store = unconstrained_params()
            return [store[name] for name in self._param_names[key]] + tensors

        loss, constrained = self._compiled(key, step, inputs)
        if mode == "captured":
            self._report_parameters(key, constrained)
        return loss

    def _report_parameters(self, key: Hashable, constrained: list[Tensor]) -> None:
        """The parameter statements of a compiled step, as the eager step makes them, for the enclosing handlers
        (``SVI`` collects the parameters it optimises there), with the values the graph computed."""
        if not handler_stack():
            return
        store = unconstrained_params()
        for name, value in zip(self._param_names[key], constrained, strict=True):
            set_unconstrained(value, store[name])
            if _compiled_param(name, value, name=name) is not value:
                raise NotImplementedError(
                    f"{type(self).__name__}: a handler replaced the value of parameter {name!r} of a compiled step, "
                    f"which computed with the stored value; use {type(self).__name__[3:]} (eager) under such handlers"
                )

    def differentiable_loss(self, model: Callable, guide: Callable, *args: Any, **kwargs: Any) -> Tensor:
        loss = self.compiled_loss(model, guide, *args, **kwargs)
        if is_validation_enabled():
            warn_if_nan(loss, "loss")
        return loss

    def loss_and_grads(self, model: Callable, guide: Callable, *args: Any, **kwargs: Any) -> float:
        loss = self.compiled_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward(retain_graph=self.retain_graph)
        value = loss.item()
        warn_if_nan(value, "loss")
        return value

    def captures(self) -> list:
        """The :class:`~pyro_flat.infer.compiled.CapturedFunction` s made so far (with their capture and compile
        times)."""
        return self._compiled.captures()


class JitSharpnessAwareELBO(_Jit, SharpnessAwareELBO):
    r""":class:`~pyro_flat.infer.SharpnessAwareELBO` with the loss of a step captured once and compiled (see the
    module docstring), like :class:`~pyro.infer.JitTrace_ELBO`.

    :param float rho: the SAM radius :math:`\rho\ge0` (default 0.05).
    :param jit_options: options of :func:`torch.compile` (``backend``, ``mode``, ``options``); ``{"backend": None}``
        runs the captured graph without compiling it.
    :type jit_options: dict or None
    :param kwargs: the options of :class:`~pyro_flat.infer.SharpnessAwareELBO` (``adaptive``, ``freeze_batchnorm``,
        ``distributed``, ``looksam_k``, ``rst_p``, ``num_particles``, ...).
    """


class JitSharpnessAwareMeanFieldELBO(_Jit, SharpnessAwareMeanFieldELBO):
    r""":class:`~pyro_flat.infer.SharpnessAwareMeanFieldELBO` with the loss of a step captured once and compiled
    (see the module docstring), like :class:`~pyro.infer.JitTraceMeanField_ELBO`.

    :param float rho: the SAM radius :math:`\rho\ge0` (default 0.05).
    :param jit_options: options of :func:`torch.compile`; ``{"backend": None}`` runs the captured graph uncompiled.
    :type jit_options: dict or None
    :param kwargs: the options of :class:`~pyro_flat.infer.SharpnessAwareMeanFieldELBO`.
    """


class JitKLBallELBO(_Jit, KLBallELBO):
    r""":class:`~pyro_flat.infer.KLBallELBO` (SA-BMA) with the loss of a step captured once and compiled (see the
    module docstring); the Fisher direction (closed form or conjugate gradients) is part of the compiled step.

    :param float radius: :math:`\gamma\ge0` in nats (required).
    :param jit_options: options of :func:`torch.compile`; ``{"backend": None}`` runs the captured graph uncompiled.
    :type jit_options: dict or None
    :param kwargs: the options of :class:`~pyro_flat.infer.KLBallELBO` (``direction``, ``kl_weight``, ``fisher``,
        ...).
    """


class JitTensorTrace_ELBO(_Jit, TensorTrace_ELBO):  # noqa: N801 (named like Pyro's ELBOs)
    r""":class:`~pyro_flat.infer.TensorTrace_ELBO` with the loss of a step captured once and compiled (see the module
    docstring): the non-flat baselines (MAP with ``AutoDelta``, mean-field VI) on the compiled path of the flat
    objectives, CUDA graphs included, so that a flat method and its base are compared on the same footing. Unlike
    Pyro's :class:`~pyro.infer.JitTrace_ELBO` (``torch.jit.trace``) it compiles with :func:`torch.compile`, and every
    guide site must be reparameterised.

    :param jit_options: options of :func:`torch.compile`; ``{"backend": None}`` runs the captured graph uncompiled.
    :type jit_options: dict or None
    :param kwargs: :class:`~pyro.infer.Trace_ELBO` options.
    """

    def _get_trace(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> tuple:
        model_trace, guide_trace = super()._get_trace(model, guide, args, kwargs)
        for name, site in guide_trace.nodes.items():
            if site["type"] == "sample" and not site["is_observed"] and not site["fn"].has_rsample:
                raise ValueError(
                    f"JitTensorTrace_ELBO: guide site {name!r} ({type(site['fn']).__name__}) is not "
                    "reparameterisable; the compiled loss is the reparameterised estimator (use TensorTrace_ELBO)"
                )
        return model_trace, guide_trace
