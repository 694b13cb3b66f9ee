"""Argument checks shared across the package.

One rule for numbers given as tensors: a tensor with one element stands for the number it holds (an int for an
integer dtype, a float for a floating one; never a bool), read once, when the argument is checked, so that
``step_size=torch.tensor(1e-3)`` and ``step_size=1e-3`` mean the same everywhere. The checks return the Python
number; a tensor of several elements is not a number.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor is checked: the command line's help and errors do without it
    from torch import Tensor


def as_number(value: object) -> object:
    """The number a one-element tensor holds (a host read); any other value as it is."""
    torch = sys.modules.get("torch")  # no tensor exists before torch is imported
    return value.item() if torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1 else value


def is_int(value: object, minimum: float = -math.inf) -> bool:
    """Whether ``value`` is an int (not a bool; or a one-element integer tensor) of at least ``minimum``."""
    value = as_number(value)
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_real(
    value: object, low: float = -math.inf, high: float = math.inf, *, low_open: bool = False, high_open: bool = False
) -> bool:
    """Whether ``value`` is a finite real number (an int or a float, not a bool; or a one-element tensor holding one)
    between ``low`` and ``high`` (each end included unless ``low_open`` / ``high_open``)."""
    value = as_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return (value > low if low_open else value >= low) and (value < high if high_open else value <= high)


def check_int(value: object, name: str, *, minimum: int = 1, owner: str | None = None) -> int:
    """``value`` as an int if it is an int (not a bool; or a one-element integer tensor) of at least ``minimum``;
    otherwise a ``ValueError`` that names ``owner`` (the function or class being called), the argument and the
    bound."""
    if not is_int(value, minimum):
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}`{name}` must be an int >= {minimum}, got {value!r}")
    return int(as_number(value))


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """``> 0``, ``>= 0``, ``< 1``, ``in [0, 1)``: the set of accepted numbers, as an error message says it."""
    if math.isinf(high):
        return f"a finite number {'>' if low_open else '>='} {low:g}" if math.isfinite(low) else "a finite number"
    if math.isinf(low):
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_real(
    value: object,
    name: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    owner: str | None = None,
) -> float:
    """``value`` as a float if it is a finite real number (an int or a float, not a bool; or a one-element tensor
    holding one) between ``low`` and ``high`` (each end included unless ``low_open`` / ``high_open``); otherwise a
    ``ValueError`` that names ``owner`` (the function or class being called), the argument and the accepted numbers,
    e.g. ``"SAM: `rho` must be a finite number >= 0, got -1"``."""
    if not is_real(value, low, high, low_open=low_open, high_open=high_open):
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}`{name}` must be {_interval(low, high, low_open, high_open)}, got {value!r}")
    return float(as_number(value))


def check_positive(
    value: object, name: str, *, owner: str | None = None, allow_zero: bool = False, allow_none: bool = False
) -> float | None:
    """:func:`check_real` for a number ``> 0`` (``>= 0`` with ``allow_zero``; ``None`` passes with ``allow_none``)."""
    if value is None and allow_none:
        return None
    return check_real(value, name, low=0, low_open=not allow_zero, owner=owner)


def all_true(flags: Sequence[Tensor]) -> bool:
    """Whether every 0-d boolean tensor of ``flags`` is true, in one host read (one synchronisation on CUDA, however
    many tensors were checked)."""
    if not flags:
        return True
    import torch

    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
