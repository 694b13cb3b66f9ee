r"""Stochastic-gradient MCMC kernels for :class:`pyro.infer.MCMC`, minibatch-aware, with flat-basin samplers.

* :class:`SGLD`, :class:`SGHMC`: Langevin and Hamiltonian SG-MCMC; the model draws its minibatch inside
  ``pyro.plate("data", N, subsample_size=B)`` (see :mod:`~pyro_flat.infer.mcmc.base`).
* :class:`EntropyMCMC`: SGLD on :func:`~pyro_flat.transforms.local_entropy` (Li & Zhang, ICLR 2024).
* :class:`EntropySGD`, :class:`EntropySGLD`: the nested-chain local-entropy methods, for comparison.
* Step-size schedules (:class:`ConstantStepSize`, :class:`PolynomialDecay`, :class:`CyclicalStepSize` for cSGLD),
  keeping and streaming of draws (:class:`DrawBuffer`, :class:`DrawHook`, :class:`DiskWriter`, :func:`load_draws`)
  and the split :math:`\hat R` check of two or more chains (:func:`check_mixing`).

The update rules live in :mod:`pyro_flat.ops.diffusions`, with the convention
:math:`\theta' = \theta - \varepsilon\nabla U + \sqrt{2\varepsilon T}\,\xi` on the full-data potential :math:`U`.
"""

from .base import ModelPotential, SamplerState, StochasticGradientKernel, initialize_sg_model
from .diagnostics import NotMixedWarning, check_mixing
from .entropy_mcmc import CoupledPotential, EntropyMCMC
from .entropy_sgd import EntropySGD
from .entropy_sgld import EntropySGLD
from .schedules import ConstantStepSize, CyclicalStepSize, PolynomialDecay, StepSizeSchedule
from .sghmc import SGHMC
from .sgld import SGLD
from .streaming import DiskWriter, DrawBuffer, DrawHook, load_draws

__all__ = [
    "SGLD",
    "SGHMC",
    "EntropyMCMC",
    "EntropySGD",
    "EntropySGLD",
    "CoupledPotential",
    "StochasticGradientKernel",
    "SamplerState",
    "ModelPotential",
    "initialize_sg_model",
    "StepSizeSchedule",
    "ConstantStepSize",
    "PolynomialDecay",
    "CyclicalStepSize",
    "DrawBuffer",
    "DrawHook",
    "DiskWriter",
    "load_draws",
    "NotMixedWarning",
    "check_mixing",
]
