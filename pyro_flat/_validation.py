"""Argument checks shared across the package."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def check_int(value: object, name: str, *, minimum: int = 1, owner: str | None = None) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; otherwise a ``ValueError`` that names
    ``owner`` (the function or class being called), the argument and the bound."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}`{name}` must be an int >= {minimum}, got {value!r}")
    return value


def all_true(flags: Sequence[Tensor]) -> bool:
    """Whether every 0-d boolean tensor of ``flags`` is true, in one host read (one synchronisation on CUDA, however
    many tensors were checked)."""
    if not flags:
        return True
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
