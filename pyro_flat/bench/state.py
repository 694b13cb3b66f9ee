"""The state of what a harness loop looks after: reading and restoring each object's state, the random states, moving
a checkpoint's tensors to the run's device, finding a non-finite tensor or a degenerate posterior (:func:`healthy`,
:func:`first_degenerate`), and the holder of a value a loop checkpoints (:class:`Holder`; the SG-MCMC draws go to a
:class:`~pyro_flat.infer.mcmc.DrawBuffer`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pyro
import pyro.optim
import torch
from torch import Tensor, nn
from torch.distributions import constraints

from .._internals import optimizer_states_not_consumed
from .._validation import all_true
from ..runtime.rng import random_state, set_random_state  # the harness's random states, saved with a checkpoint

__all__ = [
    "Holder",
    "first_degenerate",
    "first_non_finite",
    "get_state",
    "healthy",
    "move_tensors",
    "random_state",
    "set_random_state",
    "set_state",
]


def get_state(obj: object) -> object:
    """``obj``'s state: ``state_dict()``, or for a Pyro optimizer ``get_state()`` with the states it loaded but has not
    used yet."""
    if isinstance(obj, pyro.optim.PyroOptim):
        # states loaded but not yet consumed (no step since the resume) are part of the state
        return {**optimizer_states_not_consumed(obj), **obj.get_state()}
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}: it has no state_dict()")


def set_state(obj: object, state: object) -> None:
    """Restore a state of :func:`get_state`."""
    if isinstance(obj, pyro.optim.PyroOptim):
        obj.set_state(state)
    else:
        obj.load_state_dict(state)


def move_tensors(obj: object, device: torch.device) -> object:
    """``obj`` (nested dicts, lists and tuples) with its tensors moved to ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return type(obj)((k, move_tensors(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_tensors(v, device) for v in obj)
    return obj


def _floating_tensors(obj: object, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        if obj.is_floating_point():
            yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _floating_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _floating_tensors(value, f"{prefix}[{i}]")


def first_non_finite(state: Mapping) -> str | None:
    """The name of the first floating tensor of ``state`` holding a NaN or an infinity (one host read if none)."""
    tensors = list(_floating_tensors(state))
    if not tensors:
        return None
    flags = [t.isfinite().all() for _, t in tensors]
    if all_true(flags):
        return None
    return next(name for (name, _), ok in zip(tensors, flags, strict=True) if not bool(ok))


def _checked_tensors(objects: Mapping[str, object]) -> Iterator[tuple[str, Tensor, object]]:
    """``(name, tensor, constraint)`` for every floating parameter of the modules among ``objects`` (constraint
    ``None``: only finiteness is checked) and every constrained Pyro parameter (``PyroParam``) as its constrained
    value, which must lie in its constraint's support: a guide's scale that underflowed to 0 is finite, yet no
    posterior."""
    for key, obj in objects.items():
        if not isinstance(obj, nn.Module):
            continue
        for name, param in obj.named_parameters():
            if param.is_floating_point():
                yield f"{key}.{name}", param, None
        for prefix, module in obj.named_modules():
            for name, (constraint, _) in getattr(module, "_pyro_params", {}).items():
                if constraint is not constraints.real:
                    yield ".".join(filter(None, (key, prefix, name))), getattr(module, name), constraint


def _ok(tensor: Tensor, constraint: object) -> Tensor:
    ok = tensor.isfinite().all()
    return ok if constraint is None else ok & constraint.check(tensor).all()


@torch.no_grad()
def healthy(objects: Mapping[str, object]) -> Tensor | None:
    """A 0-d boolean tensor, on the device, true when every tensor :func:`_checked_tensors` finds in the modules among
    ``objects`` is finite and every constrained Pyro parameter lies in its support (no host read: combine it with a
    value read anyway); ``None`` if there is nothing to check."""
    flags = [_ok(t, c) for _, t, c in _checked_tensors(objects)]
    return torch.stack([f.to(flags[0].device) for f in flags]).all() if flags else None


@torch.no_grad()
def first_degenerate(objects: Mapping[str, object]) -> str | None:
    """What :func:`healthy` found wrong first (``"guide.scales.x is 0 at its smallest, outside the support of
    softplus_positive"``), or ``None`` (a host read per tensor: for the message after a failed check)."""
    for name, tensor, constraint in _checked_tensors(objects):
        if not bool(_ok(tensor, constraint)):
            if not bool(tensor.isfinite().all()):
                return f"{name} is NaN or infinite"
            low, high = tensor.min().item(), tensor.max().item()
            return f"{name} left the support of its constraint {constraint} (its values span [{low:g}, {high:g}])"
    return None


class Holder:
    """A value a loop changes (e.g. a chain's parameters), checkpointed as is."""

    def __init__(self, value: object) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping) -> None:
        self.value = state["value"]
