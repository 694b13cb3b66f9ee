"""Random states: torch's generators only (read and restored around every replayed site, so kept cheap), and the
whole random state a checkpoint saves (torch's, Python's, NumPy's and CUDA's)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyro
import torch
from torch import Tensor

__all__ = ["TorchRandomState", "cuda_devices", "random_state", "set_random_state", "set_torch_random_state",
           "torch_random_state"]

TorchRandomState = tuple[Tensor, list[Tensor]]
"""torch's CPU generator state and the states of the CUDA devices' generators, in the order of their devices."""


def cuda_devices() -> list[int]:
    """The CUDA devices whose generators hold state: all of them once CUDA is initialised (none before)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


def torch_random_state(devices: list[int]) -> TorchRandomState:
    """The states of torch's CPU generator and of the generators of the CUDA ``devices``."""
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def set_torch_random_state(state: TorchRandomState, devices: list[int]) -> None:
    """Restore a state of :func:`torch_random_state` read on the same ``devices``."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, s in zip(devices, cuda, strict=True):
        torch.cuda.set_rng_state(s, device)


def random_state() -> dict:
    """torch's, Python's, NumPy's (its key as an int64 tensor, so that a weights-only load reads it) and CUDA's
    random states."""
    state = pyro.util.get_rng_state()
    name, key, position, has_gauss, cached = state["numpy"]
    state["numpy"] = (name, torch.from_numpy(key.astype(np.int64)), int(position), int(has_gauss), float(cached))
    devices = cuda_devices()
    if devices:
        state["cuda"] = torch_random_state(devices)[1]
    return state


def set_random_state(state: Mapping) -> None:
    """Restore a state of :func:`random_state`."""
    name, key, position, has_gauss, cached = state["numpy"]
    pyro.util.set_rng_state({**state, "numpy": (name, key.numpy().astype(np.uint32), position, has_gauss, cached)})
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
