"""Argument checks shared across the package."""

from __future__ import annotations


def check_int(value: object, name: str, *, minimum: int = 1, owner: str | None = None) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; otherwise a ``ValueError`` that names
    ``owner`` (the function or class being called), the argument and the bound."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}`{name}` must be an int >= {minimum}, got {value!r}")
    return value
