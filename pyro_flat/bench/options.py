"""The values a per-method option (``--set METHOD.KEY=VALUE``) may take, checked for every job before the first starts.

The methods check their options again where they read them (a constructor's ``ValueError``); this table only moves
the error to the start of a run, so that a typo in the fifth method of a long run does not surface hours in. An option
name means the same thing in every method that reads it (``rho`` is always a SAM radius), so the table is keyed by
name; ``tests/bench/test_harness.py`` checks that every option a method declares is in it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._validation import is_int, is_real
from .config import RunConfig

__all__ = ["OPTION_VALUES", "check_option_values"]


def _in(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Callable[..., bool]:
    return lambda value, config: is_real(value, low, high, low_open=low_open, high_open=high_open)


POSITIVE = ("a number > 0", _in(0, math.inf, low_open=True))
NON_NEGATIVE = ("a number >= 0", _in(0, math.inf))

OPTION_VALUES: dict[str, tuple[str, Callable[[Any, RunConfig], bool]]] = {
    # name: (what is expected, check(value, config))
    "rho": NON_NEGATIVE,
    "adaptive": ("True or False", lambda v, c: isinstance(v, bool)),
    "rank": ("an int >= 1", lambda v, c: is_int(v, 1)),
    "max_rank": ("an int >= 1", lambda v, c: is_int(v, 1)),
    "radius": NON_NEGATIVE,
    "kl_weight": NON_NEGATIVE,
    "backbone_swag": ("a file written by a SWAG method's save_swag", lambda v, c: isinstance(v, str) and v != ""),
    "backbone_scale": POSITIVE,
    "burn_in": ("a number in [0, 1)", _in(0, 1, high_open=True)),
    "lr": POSITIVE,
    "temperature": NON_NEGATIVE,
    "cycles": ("None or an int >= 1", lambda v, c: v is None or is_int(v, 1)),
    "exploration": ("a number in [0, 1)", _in(0, 1, high_open=True)),
    "collect": ("'theta', 'anchor' or 'both'", lambda v, c: v in ("theta", "anchor", "both")),
    "eta": POSITIVE,
    "anchor_prior_scale": ("None or a number > 0", lambda v, c: v is None or POSITIVE[1](v, c)),
    "swa_start": ("an int in [0, epochs)", lambda v, c: is_int(v, 0) and v < c.num_epochs),
    "m_sharpness": ("an int in [1, batch size]", lambda v, c: is_int(v, 1) and v <= c.batch_size),
    "save_swag": ("a file path", lambda v, c: isinstance(v, str) and v != ""),
    "scale": POSITIVE,
    "dafactor": POSITIVE,
    "prior_precision": NON_NEGATIVE,
    "damping": NON_NEGATIVE,
    "beta2": ("a number in [0, 1]", _in(0, 1)),
    "init_scale": POSITIVE,
    "lr_low_ratio": ("a number in (0, 1]", _in(0, 1, low_open=True)),
    "looksam_k": ("an int >= 1", lambda v, c: is_int(v, 1)),
    "looksam_alpha": NON_NEGATIVE,
    "esam_gamma": ("a number in (0, 1]", _in(0, 1, low_open=True)),
    "rst_p": ("a number in [0, 1]", _in(0, 1)),
}
"""Every per-method option: ``(expected, check)``."""


def check_option_values(config: RunConfig, methods: Sequence[str] | None = None) -> None:
    """Check every value of ``config.options`` against :data:`OPTION_VALUES` (and ``config``, e.g. ``swa_start`` below
    the number of epochs); with ``methods`` (the methods a run trains), also that each ``backbone_swag`` file exists
    or is written by one of them (``save_swag``).

    :raises ValueError: naming the method, the option, the value and what was expected.
    """
    options: Mapping[str, Mapping[str, Any]] = config.options
    for method, values in options.items():
        for key, value in values.items():
            if key not in OPTION_VALUES:
                raise ValueError(f"{method}.{key}: no rule for the values of this option (add it to OPTION_VALUES)")
            expected, check = OPTION_VALUES[key]
            if not check(value, config):
                raise ValueError(f"{method}.{key} must be {expected}, got {value!r}")
    if methods is None:
        return
    written = {str(options.get(m, {}).get("save_swag")) for m in methods}
    for method in methods:
        path = options.get(method, {}).get("backbone_swag")
        if path is not None and path not in written and not Path(path).is_file():
            raise ValueError(f"{method}.backbone_swag: the file {path} does not exist and no method of this run "
                             "writes it (save_swag)")
