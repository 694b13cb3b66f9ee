"""The runtime layer under the library: running Pyro programs again exactly (replay), random states, BatchNorm
layers, the site predicates every method shares, and capturing a step as a compiled tensor function.

It imports none of pyro_flat's other parts but ``pyro_flat._internals``, the one door to Pyro's and torch's private
APIs (``tests/test_import_graph.py`` checks it), so ``transforms``, ``infer``, ``optim`` and the harness all build
on it.
"""

from . import batchnorm, capture, compiled_calls, replay, rng, sites
from .batchnorm import batchnorm_statistics_frozen, has_batchnorm, is_batchnorm
from .capture import CapturedFunction, CaptureError, CompilationFallbackWarning, is_capturing
from .compiled_calls import CompiledCalls, module_key, options_key, tensor_key
from .replay import RecordedSite, RunRecorder, substituted_tensors
from .rng import random_state, set_random_state
from .sites import (
    NothingToPerturbWarning,
    at_latent_values,
    is_deterministic_site,
    is_latent_site,
    is_real_support,
    latent_sites,
    latent_supports,
    warn_nothing_to_perturb,
)

__all__ = [
    "CaptureError",
    "CapturedFunction",
    "CompilationFallbackWarning",
    "CompiledCalls",
    "NothingToPerturbWarning",
    "RecordedSite",
    "RunRecorder",
    "at_latent_values",
    "batchnorm",
    "batchnorm_statistics_frozen",
    "capture",
    "compiled_calls",
    "has_batchnorm",
    "is_batchnorm",
    "is_capturing",
    "is_deterministic_site",
    "is_latent_site",
    "is_real_support",
    "latent_sites",
    "latent_supports",
    "module_key",
    "options_key",
    "random_state",
    "replay",
    "rng",
    "set_random_state",
    "sites",
    "substituted_tensors",
    "tensor_key",
    "warn_nothing_to_perturb",
]
