"""Divergence tracking of the stochastic-gradient kernels, on the device: each gradient step records whether the new
values and the potential are finite, and the first step at which one was not, without a host read; a check reads the
record once and names the first divergence (see :class:`~pyro_flat.infer.mcmc.base.StochasticGradientKernel`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

POTENTIAL = "the potential energy"
"""The name the record gives the potential energy."""

__all__ = ["POTENTIAL", "DivergenceRecord", "describe", "first_divergence", "nonfinite_arguments", "record_finiteness"]

DivergenceRecord = dict[tuple[str, ...], Tensor]
"""Per group of tracked tensors (keyed by their names), an int64 tensor on the device holding the first step at which
each was non-finite, or -1."""


def record_finiteness(record: DivergenceRecord, tensors: Mapping[str, Tensor], potential: Tensor | None,
                      step: int) -> None:
    """Note in ``record`` which of ``tensors`` (and ``potential``) are non-finite at ``step``, on their device (no host
    read)."""
    names = list(tensors)
    # a sum is finite iff every element is (barring an overflow of the sum itself, itself a divergence); it is cheap,
    # unlike the infinity norm, whose foreach kernel is ~50x slower on CPU
    values = [value.sum() for value in tensors.values()]
    if potential is not None:
        names.append(POTENTIAL)
        values.append(potential)
    reference = values[0]
    finite = torch.isfinite(torch.stack([v.to(reference.dtype) for v in values]))
    key = tuple(names)
    first = record.get(key)
    if first is None:
        first = torch.full((len(key),), -1, dtype=torch.int64, device=reference.device)
    record[key] = torch.where(~finite & (first < 0), step, first)


def first_divergence(record: DivergenceRecord, last_potential: Tensor | None) -> tuple[float | None, tuple | None]:
    """``(last potential, (step, names) of the first divergence or None)``, in one host read (a second one only to
    name a divergence). The last potential is ``None`` when none was recorded."""
    summary = []  # [any non-finite value recorded, the last potential (for a progress bar: float32 is enough)]
    if record:
        summary.append(torch.stack([(first >= 0).any() for first in record.values()]).any().float())
    if last_potential is not None:
        summary.append(last_potential.detach().float().reshape(()))
    if not summary:
        return None, None
    values = torch.stack(summary).tolist()
    potential = values[-1] if last_potential is not None else None
    if not record or values[0] == 0:
        return potential, None
    worst: tuple[int, list[str]] | None = None
    for key, first in record.items():
        steps = first.tolist()
        if max(steps) < 0:
            continue
        step = min(s for s in steps if s >= 0)
        names = [name for name, s in zip(key, steps, strict=True) if s == step]
        if worst is None or step < worst[0]:
            worst = (step, names)
        elif step == worst[0]:
            worst[1].extend(names)
    return potential, worst


def describe(names: list[str]) -> str:
    """``"site 'w'"``, ``"site 'w' and the potential energy"``, ``"the potential energy"``."""
    sites = [n for n in names if n != POTENTIAL]
    what = ", ".join(f"site {n!r}" for n in sites) if sites else POTENTIAL
    if sites and len(sites) < len(names):
        what += f" and {POTENTIAL}"
    return what


def nonfinite_arguments(model: Callable, args: tuple, kwargs: Mapping) -> list[str]:
    """The tensor arguments of ``model(*args, **kwargs)`` holding NaN or infinite values, named (read on the error path
    only)."""
    try:
        bound = inspect.signature(model).bind_partial(*args, **kwargs)
        named = [(f"argument {k!r}", a) for k, a in bound.arguments.items()]
    except (TypeError, ValueError):  # no signature: positions
        named = [(f"argument {i}", a) for i, a in enumerate(args)]
        named += [(f"argument {k!r}", a) for k, a in kwargs.items()]
    out = []
    for name, value in named:
        if isinstance(value, Tensor) and value.is_floating_point():
            count = int((~torch.isfinite(value)).sum())
            if count:
                out.append(f"{name}: {count} of {value.numel()} values")
    return out
