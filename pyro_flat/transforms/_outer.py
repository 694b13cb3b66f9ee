"""What handlers applied *outside* a model transform will do to a site, known before they run.

A transform's handler is the innermost frame around the model, so it sees each site before the handlers the user
applied outside the transformed model (``poutine.block(sharpness_aware(model), hide=["w"])``). To give such a program
the density of the transform applied outside those handlers (``sharpness_aware(poutine.block(model, ...))``), the
transform looks at the outer frames first:

* a *selective* ``poutine.block`` (one that does not hide every site, e.g. ``hide=["w"]``) makes the site invisible to
  the transform, as it would be if blocked inside; a block that hides every site (``poutine.block()``, used by Pyro
  internally around whole runs) is transparent;
* ``poutine.do`` and ``poutine.reparam`` are refused with a clear error (apply them inside the transform: the
  transform's second pass, hidden from the outer handlers, would not see them);
* whether an outer ``pyro.condition`` holds a value for a name (the transforms decide what conditioned sites are).
"""

from __future__ import annotations

from pyro.poutine.block_messenger import BlockMessenger
from pyro.poutine.condition_messenger import ConditionMessenger
from pyro.poutine.do_messenger import DoMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.reparam_messenger import ReparamMessenger

from .._internals import blocks, handler_stack

_PROBE = "__pyro_flat_probe__"


def _outer_frames(transform: Messenger) -> list[Messenger]:
    """The frames entered before ``transform``, from the innermost outwards (the order apply_stack runs them)."""
    stack = handler_stack()
    index = next(i for i, frame in enumerate(stack) if frame is transform)
    return list(reversed(stack[:index]))


def hidden_outside(transform: Messenger, msg: dict, owner: str) -> bool:
    """Whether a selective block outside ``transform`` hides sample site ``msg``.

    :raises ValueError: if an outer ``poutine.do`` intervenes on the site, or an outer ``poutine.reparam``
        reparameterises it (named, with the fix).
    """
    for frame in _outer_frames(transform):
        if isinstance(frame, DoMessenger) and frame.data.get(msg["name"]) is not None:
            raise ValueError(
                f"{owner}: poutine.do intervenes on site {msg['name']!r} from outside the transformed model; the "
                f"transform cannot give it the meaning it has inside. Apply it inside: {owner}(poutine.do(model, "
                "data), ...)"
            )
        if isinstance(frame, ReparamMessenger) and _reparameterises(frame, msg):
            raise ValueError(
                f"{owner}: poutine.reparam reparameterises site {msg['name']!r} from outside the transformed model, "
                f"where the transform cannot see its new latent. Apply it inside: {owner}(poutine.reparam(model, "
                "config), ...)"
            )
        if isinstance(frame, BlockMessenger):
            hides_everything = blocks(frame, {**msg, "name": _PROBE, "is_observed": False, "value": None})
            if not hides_everything and blocks(frame, msg):
                return True
    return False


def outer_conditions(transform: Messenger, name: str) -> bool:
    """Whether a ``pyro.condition`` / ``poutine.condition`` entered before ``transform`` holds a value for ``name``."""
    return any(isinstance(frame, ConditionMessenger) and name in frame.data for frame in _outer_frames(transform))


def _reparameterises(frame: ReparamMessenger, msg: dict) -> bool:
    config = frame.config
    return (config.get(msg["name"]) if isinstance(config, dict) else config(msg)) is not None
