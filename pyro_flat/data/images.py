r"""Image datasets at scale: the standard augmentation, batched on the run's device or in ``DataLoader`` workers.

:func:`load_vision_data` reads CIFAR-10/100, SVHN, MNIST or FashionMNIST from a local folder
(:func:`~pyro_flat.data.load_vision_dataset`, never downloads) into a :class:`VisionData`: a
:class:`~pyro_flat.data.ClassificationData` whose tensors hold the normalised images (for evaluation, BatchNorm
refreshes and in-model subsampling) and which also keeps the ``uint8`` training images for augmented minibatches, for
SVI steps and kernels called with ``num_data=N`` — augmented images are new at every step, so they cannot live inside
the model's tensor. Two ways build the same minibatches:

* :class:`DeviceBatches`: the whole batch at once on the run's device (a GPU when there is one) in the calling
  process — one gather of the ``uint8`` images, one gather for the crops and flips, one normalisation;
* :meth:`VisionData.train_batches`: a :class:`~torch.utils.data.DataLoader` that builds them on the CPU in worker
  processes (pinned memory).

**The augmentation** (:func:`augment`): zero-pad by 4 pixels and take a random crop of the original size, flip
horizontally with probability 1/2 (not for the digit datasets, SVHN and MNIST), then normalise each channel by the
training set's mean and standard deviation — torchvision's ``RandomCrop(32, padding=4)``,
``RandomHorizontalFlip()`` and ``Normalize(mean, std)``.

**Why not torchvision's transforms.** They draw from the global random state of the process that applies them, so a
batch depends on the number of workers, on which worker built it, and on every batch before it. Here each minibatch
is a pure function of ``(seed, epoch, batch index)``: the epoch's order is a permutation drawn from a generator seeded
by ``(seed, epoch)``, and the batch's crops and flips come from a generator seeded by ``(seed, epoch, batch)`` (CPU
generators, also when the images are augmented on a GPU). A run is then the same on the device or with 0 or 16
workers, and a killed run resumes mid-epoch at exactly the next batch (:class:`EpochBatches`); data-parallel ranks
take equal shards of the *same* augmented global batch. Neither way draws from torch's global random state, so
opening an epoch's batches changes no random number the training draws.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from ..distributed import shard_size
from .datasets import ClassificationData
from .real import feature_shuffled
from .vision import load_vision_dataset

__all__ = [
    "DeviceBatches",
    "EpochBatches",
    "ImageBatches",
    "VisionData",
    "augment",
    "crop_and_flip",
    "load_vision_data",
    "write_synthetic_cifar",
]

FLIPS = {"cifar10": True, "cifar100": True, "svhn": False, "mnist": False, "fashionmnist": True}
"""Whether the standard augmentation of a dataset flips images horizontally (never for digits)."""


def combined_seed(*entropy: int) -> int:
    """A 63-bit seed mixing ``entropy`` (numpy's ``SeedSequence``: nearby inputs give unrelated seeds)."""
    return int(np.random.SeedSequence([int(e) for e in entropy]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def _crop_and_flip_draws(generator: torch.Generator, total: int, pad: int, flip: bool) -> tuple[Tensor, ...]:
    """The crop offsets (rows, then columns, uniform in ``[0, 2 pad]``) and flips (probability 1/2) of a batch of
    ``total`` images, drawn from ``generator`` in that order."""
    top = torch.randint(0, 2 * pad + 1, (total,), generator=generator)
    left = torch.randint(0, 2 * pad + 1, (total,), generator=generator)
    flips = torch.rand(total, generator=generator) < 0.5 if flip else torch.zeros(total, dtype=torch.bool)
    return top, left, flips


def crop_and_flip(images: Tensor, top: Tensor, left: Tensor, flips: Tensor, *, pad: int = 4) -> Tensor:
    """Zero-pad ``images`` by ``pad`` pixels, crop image ``i`` of the original size at ``(top[i], left[i])`` and flip
    it horizontally where ``flips[i]``: one gather on the images' device.

    :param images: ``[b, C, H, W]`` images (any dtype).
    :param top: ``[b]`` row offsets in ``[0, 2 pad]``, on the images' device.
    :param left: ``[b]`` column offsets in ``[0, 2 pad]``.
    :param flips: ``[b]`` booleans.
    :returns: a new tensor of the same shape and dtype.
    """
    b, c, h, w = images.shape
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    rows = top[:, None] + torch.arange(h, device=images.device)  # [b, H]
    columns = torch.arange(w, device=images.device)
    columns = left[:, None] + torch.where(flips[:, None], w - 1 - columns, columns)  # a flip reverses the columns
    index = (rows[:, :, None] * (w + 2 * pad) + columns[:, None, :]).reshape(b, 1, h * w).expand(b, c, h * w)
    return padded.reshape(b, c, -1).gather(2, index).reshape(b, c, h, w)


def augment(
    images: Tensor, generator: torch.Generator, *, pad: int = 4, flip: bool = True, batch_size: int | None = None,
    offset: int = 0,
) -> Tensor:
    """The standard augmentation of a batch: zero padding by ``pad`` pixels, a random crop of the original size (offsets
    uniform in ``[0, 2 pad]``), a horizontal flip with probability 1/2 if ``flip``.

    :param images: ``[b, C, H, W]`` images (any dtype and device; ``uint8`` in the loaders): the whole batch, or rows
        ``[offset, offset + b)`` of a batch of ``batch_size`` (a data-parallel rank's shard, augmented as within the
        whole batch).
    :param generator: the CPU generator of the offsets and flips (drawn for the whole batch at once, in the order
        rows, columns, flips).
    :param batch_size: the size of the whole batch (default ``b``).
    :param offset: the first row of ``images`` in the whole batch.
    :returns: a new tensor of the same shape, dtype and device.
    """
    if images.dim() != 4:
        raise ValueError(f"augment: expected images [B, C, H, W], got shape {tuple(images.shape)}")
    b = len(images)
    total = b if batch_size is None else batch_size
    if not 0 <= offset <= total - b:
        raise ValueError(f"augment: rows [{offset}, {offset + b}) are not inside a batch of {total}")
    draws = _crop_and_flip_draws(generator, total, pad, flip)
    top, left, flips = (d[offset : offset + b].to(images.device) for d in draws)
    return crop_and_flip(images, top, left, flips, pad=pad)


def _normalisation(mean: Tensor, std: Tensor, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """``(scale, shift)`` with ``x = pixels * scale - shift`` the normalised float32 image."""
    scale = (1.0 / (255.0 * std)).to(torch.float32).reshape(1, -1, 1, 1)
    shift = (mean / std).to(torch.float32).reshape(1, -1, 1, 1)
    return scale.to(device), shift.to(device)


class ImageBatches(Dataset):
    """Minibatches of normalised float32 images, one per key ``(indices, seed, start, stop)``.

    ``indices`` are the examples of a (global) minibatch; with a ``seed`` the batch is augmented (:func:`augment`
    with a generator seeded by it) and ``[start:stop]`` of it returned (a data-parallel rank's shard), else
    the images are only normalised. A map-style dataset for a ``DataLoader`` with ``batch_size=None``.

    :param images: ``uint8`` images ``[N, C, H, W]`` on the CPU.
    :param targets: ``int64`` labels ``[N]``.
    :param mean: per-channel mean of ``images / 255``.
    :param std: per-channel standard deviation of ``images / 255``.
    :param flip: whether the augmentation flips.
    """

    def __init__(self, images: Tensor, targets: Tensor, mean: Tensor, std: Tensor, *, flip: bool = True) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(
                f"ImageBatches: expected uint8 images [N, C, H, W], got {images.dtype} {tuple(images.shape)}"
            )
        self.images, self.targets = images, targets.cpu()
        self.scale, self.shift = _normalisation(mean, std)
        self.flip = flip

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: tuple[Tensor, int | None, int, int]) -> tuple[Tensor, Tensor]:
        indices, seed, start, stop = key
        images = self.images[indices[start:stop]]  # this rank's shard, augmented as within the whole batch
        if seed is not None:
            images = augment(images, torch.Generator().manual_seed(seed), flip=self.flip, batch_size=len(indices),
                             offset=start)
        return images.to(torch.float32) * self.scale - self.shift, self.targets[indices[start:stop]]


@dataclass
class EpochBatches(Sampler):
    """The keys of :class:`ImageBatches` for one epoch, from batch ``start`` on: a permutation of ``num_data`` drawn
    from a generator seeded by ``(seed, epoch)``, cut into global batches of ``batch_size``, each with its augmentation
    seed ``(seed, epoch, batch)`` (``None`` without augmentation) and this rank's shard ``[rank B/R, (rank + 1) B/R)``.

    :param num_data: :math:`N`.
    :param batch_size: the global batch size :math:`B` (divisible by ``world_size``).
    :param seed: the stream's seed.
    :param epoch: the epoch (0-based).
    :param start: the first batch of the epoch to yield (to resume mid-epoch).
    :param augment: draw augmentation seeds.
    :param drop_last: drop the last incomplete batch (always with several ranks: shards must be equal).
    :param rank: this process's rank :math:`r`.
    :param world_size: the number of ranks :math:`R`.
    """

    num_data: int
    batch_size: int
    seed: int
    epoch: int = 0
    start: int = 0
    augment: bool = True
    drop_last: bool = False
    rank: int = 0
    world_size: int = 1
    _shard: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._shard = shard_size(self.batch_size, self.world_size)
        if self.batch_size > self.num_data:
            raise ValueError(f"the batch size {self.batch_size} exceeds the number of examples {self.num_data}")

    def __len__(self) -> int:
        full, rest = divmod(self.num_data, self.batch_size)
        return full + (rest > 0 and not self.drop_last and self.world_size == 1)

    def __iter__(self) -> Iterator[tuple[Tensor, int | None, int, int]]:
        generator = torch.Generator().manual_seed(combined_seed(self.seed, self.epoch))
        order = torch.randperm(self.num_data, generator=generator)
        for batch in range(self.start, len(self)):
            indices = order[batch * self.batch_size : (batch + 1) * self.batch_size]
            seed = combined_seed(self.seed, self.epoch, batch) if self.augment else None
            shard = len(indices) if self.world_size == 1 else self._shard
            yield indices, seed, self.rank * shard, (self.rank + 1) * shard


@dataclass(eq=False)
class VisionData(ClassificationData):
    """A :class:`~pyro_flat.data.ClassificationData` of images that also keeps the raw training images for augmented
    minibatches (:meth:`train_batches`).

    ``x_train``, ``x_test`` (and ``x_ood``, the test images with their pixels shuffled) hold the normalised images,
    flattened if the data were loaded with ``flatten=True``.

    :param images: ``uint8`` training images ``[N, C, H, W]``, kept on the CPU.
    :param mean: per-channel mean of the training images (in ``[0, 1]``), float64 ``[C]``.
    :param std: per-channel standard deviation, float64 ``[C]``.
    :param flip: whether the augmentation flips horizontally.
    """

    images: Tensor | None = None
    mean: Tensor | None = None
    std: Tensor | None = None
    flip: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.images is None or self.mean is None or self.std is None:
            raise ValueError("VisionData: expected `images`, `mean` and `std`")
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or len(self.images) != len(self.y_train):
            raise ValueError(f"VisionData: expected uint8 images [{len(self.y_train)}, C, H, W], got "
                             f"{self.images.dtype} {tuple(self.images.shape)}")

    def _derived(self, train_index: Tensor, **changes: object) -> VisionData:
        base = super()._derived(train_index, **changes)
        return VisionData(**vars(base), images=self.images[train_index.cpu()], mean=self.mean, std=self.std,
                          flip=self.flip)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> VisionData:
        """A copy with the tensors on ``device`` and inputs in ``dtype``; the raw images stay on the CPU (the
        loaders' workers read them there; :class:`DeviceBatches` copies them to its device once)."""
        base = super().to(device, dtype)
        return VisionData(**vars(base), images=self.images, mean=self.mean, std=self.std, flip=self.flip)

    def train_batches(
        self,
        batch_size: int,
        *,
        seed: int,
        epoch: int = 0,
        start: int = 0,
        augment: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> DataLoader:
        """One epoch of ``(x, y)`` minibatches (float32 normalised images ``[b, C, H, W]`` on the CPU, ``int64``
        labels), from batch ``start`` on, built in ``num_workers`` worker processes; see :class:`EpochBatches` for the
        arguments. The batches are the same for any ``num_workers``, and those of :class:`DeviceBatches`.

        The loader has a generator of its own: each of its iterators takes its base seed from it, not from torch's
        global random state (which a resume restores: an iterator opened mid-epoch on resume would otherwise shift
        every random number drawn after it)."""
        batches = ImageBatches(self.images, self.y_train, self.mean, self.std, flip=self.flip)
        sampler = EpochBatches(len(self.images), batch_size, seed, epoch, start, augment, drop_last, rank, world_size)
        return DataLoader(batches, batch_size=None, sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                          persistent_workers=False, generator=torch.Generator())


class DeviceBatches:
    """The minibatches of :meth:`VisionData.train_batches` built on a device in the calling process: the ``uint8``
    training images are copied to ``device`` once; each batch is then one gather of its images, one gather for the
    crops and flips (:func:`crop_and_flip`) and the normalisation, on that device (the same float32 values as the
    ``DataLoader``'s, bit for bit on the CPU).

    An epoch's order, crop offsets and flips are drawn up front on the CPU from the same seeded generators as the
    loader's (:class:`EpochBatches`) and copied to the device in one transfer, so a batch needs no host
    synchronisation.

    :param data: the image dataset.
    :param device: where the batches are built (default: the data's device).
    """

    def __init__(self, data: VisionData, device: torch.device | str | None = None) -> None:
        self.device = data.device if device is None else torch.device(device)
        self.images = data.images.to(self.device)
        self.targets = data.y_train.to(self.device)
        self.scale, self.shift = _normalisation(data.mean, data.std, self.device)
        self.flip = data.flip

    def epoch(
        self,
        batch_size: int,
        *,
        seed: int,
        epoch: int = 0,
        start: int = 0,
        augment: bool = True,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """One epoch of ``(x, y)`` minibatches on the device (float32 normalised images ``[b, C, H, W]``, ``int64``
        labels), from batch ``start`` on; the arguments are :meth:`VisionData.train_batches`'s."""
        keys = list(EpochBatches(len(self.images), batch_size, seed, epoch, start, augment, drop_last, rank,
                                 world_size))
        if not keys:
            return
        rows = [indices[first:stop] for indices, _, first, stop in keys]
        columns = [torch.cat(rows)]
        if augment:
            draws = [_crop_and_flip_draws(torch.Generator().manual_seed(key), len(indices), 4, self.flip)
                     for indices, key, _, _ in keys]
            for part in range(3):  # rows, columns, flips
                columns.append(torch.cat([d[part][first:stop] for d, (_, _, first, stop) in zip(draws, keys,
                                                                                                  strict=True)]))
        table = torch.stack([c.to(torch.int64) for c in columns]).to(self.device)  # one copy for the epoch
        position = 0
        for part in rows:
            chunk = table[:, position : position + len(part)]
            position += len(part)
            images = self.images.index_select(0, chunk[0])
            if augment:
                images = crop_and_flip(images, chunk[1], chunk[2], chunk[3].bool())
            yield images.to(torch.float32) * self.scale - self.shift, self.targets.index_select(0, chunk[0])


def _channel_moments(images: Tensor, chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """Per-channel mean and standard deviation of ``images / 255`` (float64, in chunks)."""
    total = torch.zeros(images.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for part in images.split(chunk):
        values = part.to(torch.float64) / 255
        total += values.sum(dim=(0, 2, 3))
        squares += values.square().sum(dim=(0, 2, 3))
    count = images.numel() / images.shape[1]
    mean = total / count
    return mean, (squares / count - mean.square()).clamp_min(1e-12).sqrt()


def _as_nchw(data: np.ndarray) -> Tensor:
    array = data[:, None] if data.ndim == 3 else data.transpose(0, 3, 1, 2)  # [N, H, W] or NHWC -> NCHW
    return torch.from_numpy(np.ascontiguousarray(array))


def load_vision_data(
    name: str,
    root: str | Path,
    *,
    flatten: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    ood_seed: int = 0,
) -> VisionData:
    """Read an image dataset from ``root`` (layout: :mod:`pyro_flat.data.vision`) into a :class:`VisionData`.

    :param name: ``"cifar10"``, ``"cifar100"``, ``"svhn"``, ``"mnist"`` or ``"fashionmnist"``.
    :param root: the folder holding the dataset's original files.
    :param flatten: flatten the images of ``x_train``/``x_test`` (for an MLP); the loaders follow.
    :param device: where ``x_train``, ``x_test`` and the labels live.
    :param dtype: their floating dtype (default: torch's default).
    :param ood_seed: seed of the pixel permutations of ``x_ood``.
    """
    train = load_vision_dataset(name, root, train=True)
    test = load_vision_dataset(name, root, train=False)
    images, test_images = _as_nchw(train.data), _as_nchw(test.data)
    mean, std = _channel_moments(images)
    dtype = torch.get_default_dtype() if dtype is None else dtype

    def normalised(x: Tensor) -> Tensor:
        x = ((x.to(torch.float64) / 255 - mean[:, None, None]) / std[:, None, None]).to(dtype)
        return (x.flatten(1) if flatten else x).to(device)

    x_test = normalised(test_images)
    return VisionData(
        name=train.name,
        x_train=normalised(images),
        y_train=train.targets.to(device),
        x_test=x_test,
        y_test=test.targets.to(device),
        num_classes=train.num_classes,
        x_ood=feature_shuffled(x_test, ood_seed),
        images=images,
        mean=mean,
        std=std,
        flip=FLIPS[train.name],
    )



def write_synthetic_cifar(
    root: str | Path, name: str = "cifar10", *, num_train: int = 500, num_test: int = 100, seed: int = 0
) -> Path:
    """Write a folder in the real on-disk format of CIFAR-10 (``cifar-10-batches-py/data_batch_1`` .. ``5``,
    ``test_batch``, ``batches.meta``) or CIFAR-100 (``cifar-100-python/train``, ``test``, ``meta``) holding random
    32x32 images — for smoke runs and tests of the whole pipeline without the real data (nothing is downloaded).

    Every image is uniform noise plus a colour offset of its class, so a network can learn a little from it; the
    classes are balanced (as even as ``num_train`` and ``num_test`` allow).

    :param root: the dataset root (what ``--data-root`` receives).
    :param name: ``"cifar10"`` or ``"cifar100"``.
    :param num_train: training images (split over the five CIFAR-10 batches).
    :param num_test: test images.
    :param seed: the seed of the images and labels.
    :returns: the dataset's folder.
    """
    if name not in ("cifar10", "cifar100"):
        raise ValueError(f"write_synthetic_cifar: `name` must be 'cifar10' or 'cifar100', got {name!r}")
    rng = np.random.default_rng(seed)
    num_classes = 10 if name == "cifar10" else 100
    colours = rng.integers(-60, 61, size=(num_classes, 3))

    def batch(n: int) -> tuple[np.ndarray, list[int]]:
        labels = rng.permutation(np.arange(n) % num_classes)  # balanced: every class as often as n allows
        noise = rng.integers(0, 196, size=(n, 3, 1024))
        images = np.clip(noise + 30 + colours[labels][:, :, None], 0, 255).astype(np.uint8).reshape(n, 3072)
        return images, labels.tolist()

    def dump(path: Path, entry: dict) -> None:
        with path.open("wb") as handle:
            pickle.dump(entry, handle)

    folder = Path(root) / ("cifar-10-batches-py" if name == "cifar10" else "cifar-100-python")
    folder.mkdir(parents=True, exist_ok=True)
    if name == "cifar10":
        for i, part in enumerate(np.array_split(np.arange(num_train), 5), start=1):
            data, labels = batch(len(part))
            dump(folder / f"data_batch_{i}", {b"data": data, b"labels": labels, b"batch_label": b"synthetic"})
        data, labels = batch(num_test)
        dump(folder / "test_batch", {b"data": data, b"labels": labels, b"batch_label": b"synthetic"})
        dump(folder / "batches.meta", {b"label_names": [f"class{c}".encode() for c in range(10)], b"num_vis": 3072})
    else:
        for split, n in (("train", num_train), ("test", num_test)):
            data, labels = batch(n)
            dump(folder / split, {b"data": data, b"fine_labels": labels, b"coarse_labels": [c // 5 for c in labels]})
        dump(folder / "meta", {b"fine_label_names": [f"class{c}".encode() for c in range(100)],
                               b"coarse_label_names": [f"super{c}".encode() for c in range(20)]})
    return folder
