"""BatchNorm layers: which modules are BatchNorm layers, and running a block without changing their statistics."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from .._internals import BatchNormBase

__all__ = ["batchnorm_statistics_frozen", "has_batchnorm", "is_batchnorm"]


def is_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm layer (of any dimension, including SyncBatchNorm and
    :class:`~pyro_flat.distributed.GlobalBatchNorm`): its running statistics depend on the weights."""
    return isinstance(module, BatchNormBase)


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` contains a BatchNorm layer (whose running statistics depend on the weights)."""
    return any(is_batchnorm(m) for m in model.modules())


@contextlib.contextmanager
def batchnorm_statistics_frozen() -> Iterator[None]:
    """Within the block, every BatchNorm layer that runs leaves its running statistics and ``num_batches_tracked``
    unchanged; its output is what it would have been (batch statistics in training mode, running ones in eval mode).

    Implemented with global module hooks, so it reaches BatchNorm layers wherever they live: in a ``PyroModule``
    model, in a network registered with ``pyro.module`` inside a model function, or in a guide.
    """
    frozen: list[nn.Module] = []

    def before(module: nn.Module, args: Any) -> None:
        if is_batchnorm(module) and module.training and module.track_running_stats:
            module.track_running_stats = False  # batch statistics, no update (torch's documented switch)
            frozen.append(module)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if frozen and frozen[-1] is module:
            frozen.pop().track_running_stats = True

    handles = [
        nn.modules.module.register_module_forward_pre_hook(before),
        nn.modules.module.register_module_forward_hook(after),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while frozen:  # a forward that raised
            frozen.pop().track_running_stats = True
