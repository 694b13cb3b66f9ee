"""The one door to Pyro's and torch's private APIs: every use of one in pyro_flat goes through a name defined here,
each with the public API whose absence makes it necessary. A Pyro or torch release that changes one breaks this
module, and ``tests/test_internals.py`` checks each against the installed versions; ``pyproject.toml`` bounds both
to the releases tested.

pyro_flat also subclasses Pyro's ELBOs and autoguides and overrides their protected hooks (``_get_traces``,
``_differentiable_loss_particle``, ``_setup_prototype``, ``_loc_scale``): that is Pyro's documented way to extend
them, not a use of a private API, and stays in the subclasses. torch's multi-tensor list operations
(``torch._foreach_add_``, ``torch._foreach_copy_``, ...) are called directly: they are the kernels torch's own
optimizers are built on (their ``foreach=`` implementations), with no public alias to route through here.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import pyro
import pyro.optim
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.trace_elbo import _compute_log_r
from pyro.poutine.block_messenger import BlockMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK
from torch import Tensor, nn
from torch._ops import OpOverload
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "BatchNormBase",
    "InstanceNormBase",
    "OpOverload",
    "RNN_FLAT_WEIGHTS",
    "TorchDispatchMode",
    "autocontinuous_loc_scale",
    "blocks",
    "handler_stack",
    "is_deterministic_record",
    "op_schema",
    "optimizer_states_not_consumed",
    "pytree",
    "rnn_weight_names",
    "set_unconstrained",
    "trace_log_r",
    "unconstrained_of",
    "unconstrained_params",
]

# --- torch ---------------------------------------------------------------------------------------------------------

BatchNormBase = nn.modules.batchnorm._BatchNorm
"""The base class of every BatchNorm layer (1d/2d/3d, lazy, SyncBatchNorm): torch has no public base class or
predicate for "a layer with running batch statistics"."""

InstanceNormBase = nn.modules.instancenorm._InstanceNorm
"""The base class of the InstanceNorm layers: torch has no public base class for them."""

RNN_FLAT_WEIGHTS = "_flat_weights"
"""The attribute through which ``nn.RNNBase.forward`` hands a recurrent layer's weights to its kernel (a list torch
caches and keeps in step with the weight attributes): torch has no public way to give the kernel weights that change
at every call, other than replacing this cache as Pyro's ``PyroModule[nn.RNNBase]`` does."""


def rnn_weight_names(layer: nn.RNNBase) -> list[str]:
    """The names of a recurrent layer's weight attributes in the order its kernel takes them
    (``RNNBase._flat_weights_names``): torch has no public accessor for it."""
    return layer._flat_weights_names


# ``torch.utils._pytree`` (flattening nested arguments and outputs, as torch.compile does): torch 2.14 has no public
# pytree module. ``TorchDispatchMode`` (seeing every ATen operation a block runs, the way ``make_fx`` does): torch
# documents dispatch modes but exports the base class only from ``torch.utils._python_dispatch``. ``OpOverload``:
# the type of ``torch.ops.aten.<op>.<overload>``, exported only from ``torch._ops``.


def op_schema(op: OpOverload) -> object:
    """The schema of an ATen operator (its arguments' and returns' types and aliasing, ``torch._C.FunctionSchema``):
    torch has no public accessor for an ``OpOverload``'s schema."""
    return op._schema


# --- Pyro ----------------------------------------------------------------------------------------------------------


def handler_stack() -> list[Messenger]:
    """The effect handlers active now, outermost first (Pyro's ``_PYRO_STACK``, the live list): Pyro has no public
    way to ask which handlers enclose a call."""
    return _PYRO_STACK


def blocks(frame: BlockMessenger, msg: dict) -> bool:
    """Whether the ``poutine.block`` ``frame`` hides the site ``msg``: ``BlockMessenger`` keeps its predicate in the
    undocumented attribute ``hide_fn``."""
    return bool(frame.hide_fn(msg))


def unconstrained_params() -> Mapping[str, Tensor]:
    """The param store's unconstrained tensors by name, without copying or constraining them: ``ParamStore`` exposes
    them only one by one (``named_parameters()`` iterates them; ``store[name]`` constrains)."""
    return pyro.get_param_store()._params


def unconstrained_of(value: Tensor) -> Tensor | None:
    """The param store's unconstrained tensor behind a value ``pyro.param`` returned (its ``unconstrained`` link),
    or ``None`` for another tensor: Pyro has no public accessor for this link."""
    link = getattr(value, "unconstrained", None)
    return None if link is None else link()


def set_unconstrained(value: Tensor, unconstrained: Tensor) -> None:
    """Mark ``value`` as the constrained value of the param store's ``unconstrained`` tensor, as ``pyro.param``
    does (``SVI`` optimises ``value.unconstrained()``): Pyro has no public setter for this link."""
    value.unconstrained = weakref.ref(unconstrained)


def is_deterministic_record(site: dict) -> bool:
    """Whether a sample site is a ``pyro.deterministic`` record: Pyro marks it with the private infer key
    ``"_deterministic"`` and has no public predicate."""
    return bool(site["infer"].get("_deterministic", False))


def optimizer_states_not_consumed(optim: pyro.optim.PyroOptim) -> dict:
    """The per-parameter states a ``PyroOptim`` loaded with ``set_state`` but has not used yet (it makes a
    parameter's optimizer at its first step): ``get_state()`` leaves them out, and Pyro has no public accessor."""
    return dict(getattr(optim, "_state_waiting_to_be_consumed", {}))


def autocontinuous_loc_scale(guide: AutoContinuous) -> list[tuple[str, Tensor, Tensor]]:
    """An ``AutoContinuous`` Gaussian guide's unconstrained loc and marginal scale, split by site: its
    ``_loc_scale()`` and ``_unpack_latent`` (Pyro has no public per-site accessor; ``median()`` constrains and has no
    scale). Raises ``NotImplementedError`` for a guide without a Gaussian loc/scale."""
    loc, scale = guide._loc_scale()
    return [(site["name"], loc_part, scale_part) for (site, loc_part), (_, scale_part)
            in zip(guide._unpack_latent(loc), guide._unpack_latent(scale), strict=True)]


def trace_log_r(model_trace: object, guide_trace: object) -> object:
    """The log-ratio terms ``log p - log q`` per site that ``Trace_ELBO`` weights its score-function terms with
    (``pyro.infer.trace_elbo._compute_log_r``): Pyro exposes the gradient estimator only whole, so an ELBO that keeps
    Pyro's estimator for non-reparameterised sites reuses this helper."""
    return _compute_log_r(model_trace, guide_trace)
