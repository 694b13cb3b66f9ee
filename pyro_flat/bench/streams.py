"""The minibatch streams of the harness's training loops.

A stream gives one step's model arguments with ``next(stream)`` — ``(args, kwargs)`` — and its position with
``state_dict``/``load_state_dict``, so that a checkpoint can resume it exactly:

* :class:`TensorStream`: tensor data keep the in-model subsampling path (``(x_train, y_train), {"subsample_size":
  B}``; the model's plate draws the indices), or, for methods that need the batch itself, ``(x[idx], y[idx]),
  {"num_data": N}``;
* :class:`LoaderStream`: image data with augmentation, augmented batch by batch on the run's device
  (:class:`~pyro_flat.data.images.DeviceBatches`, or ``DataLoader`` workers on the CPU), as ``(x, y), {"num_data":
  N}``.

Under ``torch.distributed`` each rank gets its equal shard of the same global batch (:mod:`pyro_flat.bench.batches`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..data import ClassificationData
from ..data.images import DeviceBatches, VisionData, combined_seed
from .batches import shard_size, shard_slice

__all__ = ["Batch", "LoaderStream", "TensorStream", "stream_seed"]

Batch = tuple[tuple[Tensor, ...], dict[str, Any]]
"""One step's model arguments ``(args, kwargs)``."""


@dataclass
class TensorStream:
    """Minibatches of in-memory tensor data.

    Without ``explicit`` (one process): the whole training set with ``subsample_size=B`` (the model's
    ``pyro.plate`` draws the minibatch). Otherwise ``idx = randperm(N)[:B]`` from torch's global generator (the
    plate's own draw), this rank's shard of it, and ``num_data=N``. Its randomness is torch's global state, which the
    checkpoints hold, so it has no state of its own.
    """

    data: ClassificationData
    batch_size: int
    explicit: bool = False
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        self._shard = shard_size(self.batch_size, self.world_size)

    def __next__(self) -> Batch:
        data = self.data
        if not self.explicit:
            return (data.x_train, data.y_train), {"subsample_size": self.batch_size}
        idx = torch.randperm(data.num_data, device=data.device)[: self.batch_size]
        idx = idx[shard_slice(self.rank, self._shard)]
        return (data.x_train[idx], data.y_train[idx]), {"num_data": data.num_data}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        """Nothing to restore: the stream's randomness is torch's global state, restored with the checkpoint."""


class LoaderStream:
    """Augmented image minibatches, epoch after epoch, on the run's device (optionally channels-last) and reshaped to
    the data's input shape; yields ``(x, y), {"num_data": N}``. With ``num_workers=0`` they are built on the device
    (:class:`~pyro_flat.data.images.DeviceBatches`: a GPU augments the whole batch at once), else on the CPU by
    ``num_workers`` ``DataLoader`` workers (:meth:`VisionData.train_batches
    <pyro_flat.data.VisionData.train_batches>`) and copied ``non_blocking`` from pinned memory; the batches are the
    same. Its state is ``(epoch, batches consumed in the epoch)``: the batches themselves are a pure function of the
    seed and that position, and building them draws nothing from torch's global random state.
    """

    def __init__(
        self,
        data: VisionData,
        batch_size: int,
        seed: int,
        *,
        augment: bool = True,
        num_workers: int = 0,
        channels_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        self.data, self.batch_size, self.seed, self.drop_last = data, batch_size, seed, drop_last
        self.augment, self.num_workers, self.channels_last = augment, num_workers, channels_last
        self.rank, self.world_size = rank, world_size
        self.epoch, self.batch = 0, 0
        self._batches: Iterator | None = None
        self._on_device = None if num_workers else DeviceBatches(data)

    def _open(self) -> Iterator:
        position = {"seed": self.seed, "epoch": self.epoch, "start": self.batch, "augment": self.augment,
                    "drop_last": self.drop_last, "rank": self.rank, "world_size": self.world_size}
        if self._on_device is not None:
            return self._on_device.epoch(self.batch_size, **position)
        return iter(self.data.train_batches(self.batch_size, num_workers=self.num_workers,
                                            pin_memory=self.data.device.type == "cuda", **position))

    def __next__(self) -> Batch:
        if self._batches is None:
            self._batches = self._open()
        try:
            x, y = next(self._batches)
        except StopIteration:
            self.epoch, self.batch = self.epoch + 1, 0
            self._batches = self._open()
            x, y = next(self._batches)
        self.batch += 1
        data = self.data
        x = x.to(data.device, non_blocking=True).to(data.dtype).reshape(len(x), *data.input_shape)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return (x, y.to(data.device, non_blocking=True)), {"num_data": data.num_data}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: Mapping) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._batches = None


def stream_seed(seed: int, phase: int) -> int:
    """The seed of a loader stream for phase ``phase`` of a job with seed ``seed`` (independent across phases)."""
    return combined_seed(seed, phase, 0x5EED)
