"""Input validation shared by the metrics. Every failure is a ``ValueError`` naming the argument.

The checks synchronise with the host once or twice per call (to decide whether to raise); they never loop over
points.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sum_tolerance(dtype: torch.dtype) -> float:
    r"""Tolerance on :math:`|\sum_c p_c-1|`: :math:`\max(10^{-6},\sqrt{\varepsilon})` for the dtype's machine epsilon.

    float64: 1e-6 (also admits probabilities computed in float32 and cast); float32: 3.5e-4; float16: 0.03. Wide
    enough for rounding, narrow enough to reject logits or unnormalised scores.
    """
    return max(1e-6, torch.finfo(dtype).eps ** 0.5)


def check_float(x: object, name: str, ndim: int, dims: str, *, finite: bool = True) -> Tensor:
    """``x`` must be a floating-point tensor with ``ndim`` dimensions (described by ``dims``), and finite unless
    ``finite=False`` (the finiteness check reads a value on the host: a synchronisation on an accelerator)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"`{name}` must be a tensor of shape {dims}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"`{name}` must have shape {dims}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor, got dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"`{name}` must not be empty, got shape {tuple(x.shape)}")
    if finite and not bool(torch.isfinite(x).all()):
        raise ValueError(f"`{name}` must be finite, got NaN or Inf values")
    return x


def check_probs(probs: object, name: str = "probs", ndim: int = 2, dims: str = "[N, C]") -> Tensor:
    """``probs`` must be finite, in [0, 1] and sum to one along the last dimension (see :func:`sum_tolerance`)."""
    probs = check_float(probs, name, ndim, dims)
    tol = sum_tolerance(probs.dtype)
    if bool(((probs < 0) | (probs > 1 + tol)).any()):
        raise ValueError(
            f"`{name}` must hold probabilities in [0, 1]; got values outside (pass probabilities, not logits)"
        )
    error = (probs.sum(-1) - 1).abs().max()
    if bool(error > tol):
        raise ValueError(
            f"`{name}` must sum to 1 over the last (class) dimension within {tol:.1e}; the largest deviation is "
            f"{float(error):.3e} (pass probabilities, not logits)"
        )
    return probs


def check_labels(y: object, num_points: int, num_classes: int, like: Tensor, name: str = "y") -> Tensor:
    """``y`` must be an integer tensor of shape [N] with values in {0, ..., C-1}, on the device of ``like``."""
    if not isinstance(y, Tensor):
        raise ValueError(f"`{name}` must be an int64 tensor of shape [N], got {type(y).__name__}")
    if y.ndim != 1:
        raise ValueError(f"`{name}` must have shape [N] = [{num_points}], got shape {tuple(y.shape)}")
    if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"`{name}` must hold integer class labels (int64), got dtype {y.dtype}")
    if y.shape[0] != num_points:
        raise ValueError(f"`{name}` has {y.shape[0]} labels but the predictions have {num_points} rows")
    if y.device != like.device:
        raise ValueError(f"`{name}` is on {y.device} but the predictions are on {like.device}")
    if bool(((y < 0) | (y >= num_classes)).any()):
        raise ValueError(
            f"`{name}` must hold labels in [0, {num_classes - 1}] for C = {num_classes} classes; got values in "
            f"[{int(y.min())}, {int(y.max())}]"
        )
    return y.long()
