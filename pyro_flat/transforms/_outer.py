"""What handlers applied *outside* a model transform will do to a site, known before they run.

A transform's handler is the innermost frame around the model, so it sees each site before the handlers the user
applied outside the transformed model (``pyro.condition(sharpness_aware(model), data)``). To give such a program the
density of the transform applied outside those handlers (``sharpness_aware(pyro.condition(model, data))``), the
transform looks at the outer frames first:

* ``pyro.condition`` / ``poutine.condition``: the site is an observation, with the condition's value;
* a *selective* ``poutine.block`` (one that does not hide every site, e.g. ``hide=["obs"]``): the site is invisible
  to the transform, as it would be if blocked inside; a block that hides every site (``poutine.block()``, used by Pyro
  internally around whole runs) is transparent;
* ``poutine.do``: refused with a clear error (apply the intervention inside the transform).
"""

from __future__ import annotations

from dataclasses import dataclass

from pyro.poutine.block_messenger import BlockMessenger
from pyro.poutine.condition_messenger import ConditionMessenger
from pyro.poutine.do_messenger import DoMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK
from torch import Tensor

_PROBE = "__pyro_flat_probe__"


@dataclass
class OuterEffect:
    """The effect of the handlers outside a transform on one sample site.

    :param value: the value an outer condition observes (``None`` if none does).
    :param bool hidden: a selective outer block hides the site from everything outside it.
    """

    value: Tensor | None = None
    hidden: bool = False

    @property
    def observed(self) -> bool:
        return self.value is not None


def _hides_everything(block: BlockMessenger, msg: dict) -> bool:
    return bool(block.hide_fn({**msg, "name": _PROBE, "is_observed": False, "value": None}))


def outer_effect(transform: Messenger, msg: dict, owner: str) -> OuterEffect:
    """The effect on sample site ``msg`` of the handlers entered before ``transform`` (outside it).

    :param transform: the transform's handler (on the stack).
    :param msg: the site's message, before the outer handlers process it.
    :param str owner: the transform's name, for error messages.
    :raises ValueError: if an outer ``poutine.do`` intervenes on the site.
    """
    index = next(i for i, frame in enumerate(_PYRO_STACK) if frame is transform)
    probe = dict(msg)
    effect = OuterEffect()
    for frame in reversed(_PYRO_STACK[:index]):  # from the innermost outer frame outwards, as apply_stack runs them
        if isinstance(frame, DoMessenger) and frame.data.get(msg["name"]) is not None:
            raise ValueError(
                f"{owner}: poutine.do intervenes on site {msg['name']!r} from outside the transformed model; the "
                f"transform cannot give it the meaning it has inside. Apply it inside: {owner}(poutine.do(model, "
                "data), ...)"
            )
        if isinstance(frame, ConditionMessenger) and msg["name"] in frame.data:
            frame._process_message(probe)
            effect.value = probe["value"] if probe["is_observed"] else None
        elif isinstance(frame, BlockMessenger) and not _hides_everything(frame, msg) and frame.hide_fn(probe):
            effect.hidden = True
            break  # frames outside the block never see the site
    return effect


def outer_conditions(transform: Messenger, name: str) -> bool:
    """Whether a ``pyro.condition`` / ``poutine.condition`` entered before ``transform`` holds a value for ``name``."""
    index = next(i for i, frame in enumerate(_PYRO_STACK) if frame is transform)
    return any(isinstance(frame, ConditionMessenger) and name in frame.data for frame in _PYRO_STACK[:index])
