"""In-memory datasets: :class:`ClassificationData` and :class:`RegressionData`.

Both hold train and test tensors on one device with one floating dtype, validate themselves on construction, and
hand out minibatch loaders. ``num_data`` (the number of training examples) is the likelihood scale :math:`N` that a
Pyro model passes to ``pyro.plate("data", num_data, subsample_size=B)``.

The loaders index the stored tensors with a whole batch of indices at once (a :class:`~torch.utils.data.BatchSampler`
used as the sampler, ``batch_size=None``), so a batch costs one gather on the data's device rather than ``B`` Python
``__getitem__`` calls and a collate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

from .._validation import check_int

__all__ = ["ClassificationData", "RegressionData"]


# --------------------------------------------------------------------------------------------------------------------
# validation helpers


def _check_features(owner: str, name: str, x: object) -> Tensor:
    """Check that ``x`` is a finite floating tensor of shape ``[n, *features]``."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{owner}: expected {name} to be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{owner}: expected {name} to be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{owner}: expected {name} of shape [n, *features] (at least 2-D), got {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{owner}: {name} contains NaN or Inf values; expected finite inputs")
    return x


def _check_same_length(owner: str, x_name: str, x: Tensor, y_name: str, y: Tensor) -> None:
    if len(x) != len(y):
        raise ValueError(f"{owner}: {x_name} has {len(x)} rows but {y_name} has {len(y)}; expected equal lengths")


def _check_consistent(owner: str, named: dict[str, Tensor]) -> None:
    """Check that all tensors live on one device and all floating tensors share one dtype."""
    devices = {name: t.device for name, t in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{owner}: expected all tensors on one device, got {devices}")
    dtypes = {name: t.dtype for name, t in named.items() if t.is_floating_point()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"{owner}: expected all floating tensors to share one dtype, got {dtypes}")


def _check_float_dtype(owner: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{owner}: expected dtype to be a floating torch.dtype or None, got {dtype!r}")


def _tensor_loader(
    tensors: Sequence[Tensor], batch_size: int, *, shuffle: bool, seed: int, drop_last: bool
) -> DataLoader:
    """A loader yielding ``[x_batch, y_batch]`` by indexing ``tensors`` with one batch of indices at a time.

    With ``shuffle`` the order comes from a CPU generator seeded with ``seed``: every pass over the loader draws a new
    permutation, and the sequence of permutations is the same for the same seed. The loader's own generator gives
    each pass its base seed, so iterating it never draws from torch's global random state.
    """
    dataset = TensorDataset(*tensors)
    if shuffle:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    else:
        sampler = SequentialSampler(dataset)
    return DataLoader(dataset, batch_size=None, sampler=BatchSampler(sampler, batch_size, drop_last),
                      generator=torch.Generator())


class _InMemoryData:
    """What every in-memory dataset offers: ``x_train``/``y_train``/``x_test``/``y_test`` tensors on one device."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor

    @property
    def num_data(self) -> int:
        """The number of training examples :math:`N` (the likelihood scale for ``pyro.plate``)."""
        return len(self.x_train)

    @property
    def input_shape(self) -> torch.Size:
        """The shape of one input, ``x_train.shape[1:]``."""
        return self.x_train.shape[1:]

    @property
    def device(self) -> torch.device:
        """The device all tensors live on."""
        return self.x_train.device

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of the inputs."""
        return self.x_train.dtype

    def train_loader(
        self, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> DataLoader:
        """A loader over ``(x_train, y_train)`` yielding ``[x, y]`` batches on the data's device.

        :param int batch_size: the batch size ``B``.
        :param bool shuffle: draw a new random order every epoch (from a generator seeded with ``seed``).
        :param int seed: the seed of the shuffling generator; the same seed gives the same sequence of batches.
        :param bool drop_last: drop the last incomplete batch.
        """
        check_int(batch_size, "batch_size", owner=f"{type(self).__name__}.train_loader")
        return _tensor_loader((self.x_train, self.y_train), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def test_loader(self, batch_size: int) -> DataLoader:
        """A loader over ``(x_test, y_test)`` in order, keeping the last incomplete batch.

        :param int batch_size: the batch size.
        """
        check_int(batch_size, "batch_size", owner=f"{type(self).__name__}.test_loader")
        return _tensor_loader((self.x_test, self.y_test), batch_size, shuffle=False, seed=0, drop_last=False)


# --------------------------------------------------------------------------------------------------------------------
# classification


@dataclass(eq=False)
class ClassificationData(_InMemoryData):
    """A classification dataset held in memory: train, test and (optionally) out-of-distribution inputs.

    :param str name: a short name (e.g. ``"digits"``), used in tables and logs.
    :param Tensor x_train: training inputs, floating, shape ``[N, *input_shape]``.
    :param Tensor y_train: training labels, ``int64`` in ``[0, num_classes)``, shape ``[N]``.
    :param Tensor x_test: test inputs, shape ``[M, *input_shape]``.
    :param Tensor y_test: test labels, ``int64``, shape ``[M]``.
    :param int num_classes: the number of classes ``K``.
    :param x_ood: out-of-distribution inputs with the same ``input_shape`` (or ``None``); used for OOD AUROC.
    :type x_ood: Tensor or None

    All tensors must be on one device and all inputs share one floating dtype. Construction raises
    :class:`ValueError` naming the offending field if lengths differ, labels are not ``int64`` in range, inputs hold
    NaN/Inf, or feature shapes disagree.
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    x_ood: Tensor | None = None

    def __post_init__(self) -> None:
        owner = "ClassificationData"
        check_int(self.num_classes, "num_classes", owner=owner)
        _check_features(owner, "x_train", self.x_train)
        _check_features(owner, "x_test", self.x_test)
        if len(self.x_train) == 0:
            raise ValueError(f"{owner}: expected x_train to hold at least one example, got 0")
        for y_name in ("y_train", "y_test"):
            self._check_labels(y_name, getattr(self, y_name))
        _check_same_length(owner, "x_train", self.x_train, "y_train", self.y_train)
        _check_same_length(owner, "x_test", self.x_test, "y_test", self.y_test)
        named = {"x_train": self.x_train, "y_train": self.y_train, "x_test": self.x_test, "y_test": self.y_test}
        if self.x_ood is not None:
            named["x_ood"] = _check_features(owner, "x_ood", self.x_ood)
        for x_name in ("x_test", "x_ood"):
            x = named.get(x_name)
            if x is not None and x.shape[1:] != self.x_train.shape[1:]:
                raise ValueError(
                    f"{owner}: {x_name} has feature shape {tuple(x.shape[1:])}, "
                    f"expected x_train's {tuple(self.x_train.shape[1:])}"
                )
        _check_consistent(owner, named)

    def _check_labels(self, name: str, y: object) -> None:
        owner = "ClassificationData"
        if not isinstance(y, Tensor) or y.dtype != torch.int64 or y.dim() != 1:
            shape = tuple(y.shape) if isinstance(y, Tensor) else None
            dtype = y.dtype if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"{owner}: expected {name} to be a 1-D int64 tensor, got dtype {dtype}, shape {shape}")
        if y.numel() > 0 and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise ValueError(
                f"{owner}: {name} has labels in [{int(y.min())}, {int(y.max())}], "
                f"expected labels in [0, num_classes={self.num_classes})"
            )

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ClassificationData:
        """A copy on ``device`` with inputs cast to ``dtype`` (labels stay ``int64``); ``None`` keeps the current one.

        :param device: the target device.
        :param dtype: the target floating dtype of the inputs.
        """
        _check_float_dtype("ClassificationData.to", dtype)
        dtype = self.dtype if dtype is None else dtype
        return ClassificationData(
            name=self.name,
            x_train=self.x_train.to(device=device, dtype=dtype),
            y_train=self.y_train.to(device=device),
            x_test=self.x_test.to(device=device, dtype=dtype),
            y_test=self.y_test.to(device=device),
            num_classes=self.num_classes,
            x_ood=None if self.x_ood is None else self.x_ood.to(device=device, dtype=dtype),
        )

    def subset(
        self, num_train: int | None = None, classes: Sequence[int] | None = None, seed: int = 0
    ) -> ClassificationData:
        """A smaller task: keep only some classes and/or a random subset of the training set.

        With ``classes``, train and test keep only examples of those classes, relabelled ``0..k-1`` in the order
        given (``classes=[7, 1]`` maps 7 to 0 and 1 to 1); ``x_ood`` is kept unchanged. With ``num_train``,
        ``num_train`` training examples are then drawn without replacement (in their original order) using a
        generator seeded with ``seed``. The test set is never subsampled.

        :param num_train: the number of training examples to keep (``None``: all).
        :type num_train: int or None
        :param classes: the original labels to keep (``None``: all), distinct and in ``[0, num_classes)``.
        :type classes: Sequence[int] or None
        :param int seed: the seed of the training-subset draw.
        """
        owner = "ClassificationData.subset"
        train_index = torch.arange(self.num_data, device=self.device)
        y_train, x_test, y_test = self.y_train, self.x_test, self.y_test
        num_classes, name = self.num_classes, self.name
        if classes is not None:
            classes = [int(c) for c in classes]
            if not classes or len(set(classes)) != len(classes) or not all(0 <= c < num_classes for c in classes):
                raise ValueError(
                    f"{owner}: expected classes to be a non-empty sequence of distinct labels in "
                    f"[0, {num_classes}), got {classes}"
                )
            relabel = torch.full((num_classes,), -1, dtype=torch.int64, device=self.device)
            relabel[classes] = torch.arange(len(classes), device=self.device)
            keep_train, keep_test = relabel[y_train] >= 0, relabel[y_test] >= 0
            train_index = train_index[keep_train]
            y_train = relabel[y_train]
            x_test, y_test = x_test[keep_test], relabel[y_test[keep_test]]
            num_classes, name = len(classes), f"{name}[classes={classes}]"
            if len(train_index) == 0:
                raise ValueError(f"{owner}: no training example has a label in classes={classes}")
        if num_train is not None:
            check_int(num_train, "num_train", owner=owner)
            if num_train > len(train_index):
                raise ValueError(
                    f"{owner}: expected num_train <= {len(train_index)} available examples, got {num_train}"
                )
            generator = torch.Generator().manual_seed(seed)
            keep = torch.randperm(len(train_index), generator=generator)[:num_train].sort().values.to(self.device)
            train_index = train_index[keep]
            name = f"{name}[num_train={num_train}]"
        return self._derived(train_index, y_train=y_train[train_index], x_test=x_test, y_test=y_test,
                             num_classes=num_classes, name=name)

    def few_shot(self, shots_per_class: int, seed: int = 0) -> ClassificationData:
        """A ``k``-shot training set: ``shots_per_class`` random training examples of every class; test unchanged.

        The examples are drawn without replacement with a generator seeded with ``seed`` and kept in their original
        order. Raises :class:`ValueError` if some class has fewer than ``shots_per_class`` training examples.

        :param int shots_per_class: the number of examples per class ``k``.
        :param int seed: the seed of the draw.
        """
        owner = "ClassificationData.few_shot"
        check_int(shots_per_class, "shots_per_class", owner=owner)
        generator = torch.Generator().manual_seed(seed)
        labels = self.y_train.cpu()
        picked = []
        for c in range(self.num_classes):
            members = torch.nonzero(labels == c).flatten()
            if len(members) < shots_per_class:
                raise ValueError(
                    f"{owner}: class {c} has {len(members)} training examples, expected at least "
                    f"shots_per_class={shots_per_class}"
                )
            picked.append(members[torch.randperm(len(members), generator=generator)[:shots_per_class]])
        index = torch.cat(picked).sort().values.to(self.device)
        return self._derived(index, name=f"{self.name}[{shots_per_class}-shot]")

    def _derived(self, train_index: Tensor, **changes: object) -> ClassificationData:
        """A copy keeping the training examples ``train_index`` (in that order), with ``changes`` to other fields
        (subclasses holding more per-example data override this)."""
        fields = {"name": self.name, "x_train": self.x_train[train_index], "y_train": self.y_train[train_index],
                  "x_test": self.x_test, "y_test": self.y_test, "num_classes": self.num_classes, "x_ood": self.x_ood}
        return ClassificationData(**(fields | changes))


# --------------------------------------------------------------------------------------------------------------------
# regression


@dataclass(eq=False)
class RegressionData(_InMemoryData):
    """A regression dataset held in memory.

    :param str name: a short name.
    :param Tensor x_train: training inputs, floating, shape ``[N, *input_shape]``.
    :param Tensor y_train: training targets, floating, shape ``[N]`` or ``[N, *target_shape]``.
    :param Tensor x_test: test inputs, shape ``[M, *input_shape]``.
    :param Tensor y_test: test targets, shape ``[M, ...]`` like ``y_train``.

    All tensors must be finite, on one device, and share one floating dtype (:class:`ValueError` otherwise).
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor

    def __post_init__(self) -> None:
        owner = "RegressionData"
        for x_name in ("x_train", "x_test"):
            _check_features(owner, x_name, getattr(self, x_name))
        if len(self.x_train) == 0:
            raise ValueError(f"{owner}: expected x_train to hold at least one example, got 0")
        for y_name in ("y_train", "y_test"):
            y = getattr(self, y_name)
            if not isinstance(y, Tensor) or not y.is_floating_point() or y.dim() < 1:
                raise ValueError(f"{owner}: expected {y_name} to be a floating tensor of shape [n, ...], got {y!r}")
            if not bool(torch.isfinite(y).all()):
                raise ValueError(f"{owner}: {y_name} contains NaN or Inf values; expected finite targets")
        _check_same_length(owner, "x_train", self.x_train, "y_train", self.y_train)
        _check_same_length(owner, "x_test", self.x_test, "y_test", self.y_test)
        if self.x_test.shape[1:] != self.x_train.shape[1:]:
            raise ValueError(
                f"{owner}: x_test has feature shape {tuple(self.x_test.shape[1:])}, "
                f"expected x_train's {tuple(self.x_train.shape[1:])}"
            )
        if self.y_test.shape[1:] != self.y_train.shape[1:]:
            raise ValueError(
                f"{owner}: y_test has target shape {tuple(self.y_test.shape[1:])}, "
                f"expected y_train's {tuple(self.y_train.shape[1:])}"
            )
        named = {"x_train": self.x_train, "y_train": self.y_train, "x_test": self.x_test, "y_test": self.y_test}
        _check_consistent(owner, named)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> RegressionData:
        """A copy on ``device`` with all tensors cast to ``dtype``; ``None`` keeps the current one.

        :param device: the target device.
        :param dtype: the target floating dtype.
        """
        _check_float_dtype("RegressionData.to", dtype)
        dtype = self.dtype if dtype is None else dtype
        return RegressionData(
            self.name,
            *(t.to(device=device, dtype=dtype) for t in (self.x_train, self.y_train, self.x_test, self.y_test)),
        )

