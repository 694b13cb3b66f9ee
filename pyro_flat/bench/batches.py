r"""The harness's batch and shard arithmetic, in one place: which process this is, the global minibatch, each rank's
share of it and the steps of an epoch.

A run has a global minibatch of :math:`B` examples out of :math:`N` (:func:`minibatch_size`). Under
``torch.distributed`` with :math:`R` ranks every rank gets an equal shard of :math:`B/R` examples of the same global
batch (:func:`shard_size`, :func:`shard_slice`), so that the averaged gradient is the gradient of the whole batch; an
epoch is then :math:`\lfloor N/B\rfloor` steps (the last incomplete batch is dropped), else
:math:`\lceil N/B\rceil` (:func:`steps_per_epoch`).
"""

from __future__ import annotations

import math

import torch.distributed as dist

from ..distributed import shard_size

__all__ = ["is_distributed", "minibatch_size", "shard_size", "shard_slice", "steps_per_epoch", "world"]


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group exists (e.g. under ``torchrun``, even with one process)."""
    return dist.is_available() and dist.is_initialized()


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the ``torch.distributed`` process group, ``(0, 1)`` without one."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def minibatch_size(batch_size: int, num_data: int) -> int:
    """The global minibatch :math:`B`: the configured ``batch_size``, at most the ``num_data`` training examples."""
    return min(batch_size, num_data)


def steps_per_epoch(num_data: int, batch_size: int, *, drop_last: bool) -> int:
    """Minibatches of ``batch_size`` per pass over ``num_data`` examples; with ``drop_last`` (data-parallel runs,
    whose ranks need equal shards) the last incomplete one is dropped."""
    if drop_last:
        return num_data // batch_size
    return math.ceil(num_data / batch_size)


def shard_slice(rank: int, shard: int) -> slice:
    """The positions of rank ``rank``'s shard of ``shard`` examples in the global minibatch."""
    return slice(rank * shard, (rank + 1) * shard)
