"""Image datasets (CIFAR-10/100, SVHN, MNIST, FashionMNIST) read from a local folder; nothing is ever downloaded.

:func:`load_vision_dataset` first checks that the expected folder and files exist and, if not, raises
:class:`FileNotFoundError` naming the folder and the files it expects. The files are the ones the datasets'
publishers distribute, laid out as torchvision lays them out, so a root prepared for torchvision works here:

=============  =====================================================================================================
name           files (train / test)
=============  =====================================================================================================
cifar10        ``<root>/cifar-10-batches-py/``: ``data_batch_1`` .. ``data_batch_5`` / ``test_batch``; both need
               ``batches.meta``
cifar100       ``<root>/cifar-100-python/``: ``train`` / ``test``; both need ``meta`` (the 100 fine labels are used)
svhn           ``<root>/``: ``train_32x32.mat`` / ``test_32x32.mat`` (label 10 means digit 0 and becomes 0)
mnist          ``<root>/MNIST/raw/``: ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte`` /
               ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each may instead be gzipped, ``.gz``)
fashionmnist   ``<root>/FashionMNIST/raw/``: the same four file names as MNIST
=============  =====================================================================================================

Why a small reader of our own rather than ``torchvision.datasets``: torchvision's CIFAR10/CIFAR100/SVHN verify the
md5 checksum of every file, so any re-packed or reduced copy (and any test fixture) is rejected, and torchvision's
MNIST reads only the uncompressed files. Subclassing to skip the checks would override private methods
(``_check_integrity``, ``_load_meta``) that change between torchvision versions. The formats are simple (pickled
dicts, a MATLAB file, idx-ubyte), so reading them takes a few lines, gives one dataset class with the same attributes
for all five names, and yields the same items as torchvision — ``(PIL image, int label)`` passed through
``transform`` — so torchvision transforms work unchanged.

.. warning:: CIFAR files are Python pickles: only read folders you trust (torchvision does the same).

Reading images needs Pillow (``pip install pyro_flat[vision]``); reading SVHN also needs scipy.
"""

from __future__ import annotations

import gzip
import pickle
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["LocalImageDataset", "check_vision_files", "load_vision_dataset", "vision_num_data", "VISION_DATASETS"]

VISION_DATASETS = ("cifar10", "cifar100", "svhn", "mnist", "fashionmnist")

_FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat")
_FASHION_CLASSES += ("Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


class LocalImageDataset(Dataset):
    """Images held in memory as a ``uint8`` array, served as ``(transform(PIL image), int label)`` like torchvision.

    :param str name: the dataset name (e.g. ``"cifar10"``).
    :param numpy.ndarray data: ``uint8`` images, ``[N, H, W]`` (grey) or ``[N, H, W, C]`` (colour, HWC).
    :param Tensor targets: ``int64`` labels ``[N]``.
    :param classes: the class names, indexed by label.
    :type classes: list[str]
    :param transform: applied to each PIL image (e.g. ``torchvision.transforms.ToTensor()``), or ``None`` to get
        the PIL image itself.
    :type transform: Callable or None
    """

    def __init__(
        self,
        name: str,
        data: np.ndarray,
        targets: Tensor,
        classes: list[str],
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        if data.dtype != np.uint8 or data.ndim not in (3, 4):
            raise ValueError(f"{name}: expected uint8 images [N, H, W] or [N, H, W, C], got {data.dtype} {data.shape}")
        if len(targets) != len(data):
            raise ValueError(f"{name}: read {len(data)} images but {len(targets)} labels; expected equal counts")
        if transform is not None and not callable(transform):
            raise ValueError(f"{name}: expected transform to be callable or None, got {transform!r}")
        self.name = name
        self.data = data
        self.targets = targets
        self.classes = classes
        self.transform = transform

    @property
    def num_data(self) -> int:
        """The number of images :math:`N` (the likelihood scale for ``pyro.plate``)."""
        return len(self.data)

    @property
    def num_classes(self) -> int:
        """The number of classes."""
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from PIL import Image

        image = Image.fromarray(self.data[index])
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])

    def __repr__(self) -> str:
        return f"LocalImageDataset(name={self.name!r}, num_data={self.num_data}, image_shape={self.data.shape[1:]})"


def vision_num_data(dataset: Dataset) -> int:
    """The number of examples :math:`N` of a dataset: its ``num_data`` attribute if it has one, else ``len``.

    Works for :class:`LocalImageDataset`, torchvision datasets and :class:`torch.utils.data.Subset`.

    :param dataset: a map-style dataset.
    :type dataset: torch.utils.data.Dataset
    """
    num_data = getattr(dataset, "num_data", None)
    if isinstance(num_data, int):
        return num_data
    if not isinstance(dataset, Sized):
        raise ValueError(f"vision_num_data: expected a dataset with a length, got {type(dataset).__name__}")
    return len(dataset)


# --------------------------------------------------------------------------------------------------------------------
# expected files


def _dataset_key(name: str) -> str:
    key = name.lower().replace("-", "").replace("_", "") if isinstance(name, str) else name
    if key not in VISION_DATASETS:
        raise ValueError(f"load_vision_dataset: unknown dataset name {name!r}; expected one of {list(VISION_DATASETS)}")
    return key


def _mnist_names(train: bool) -> list[str]:
    prefix = "train" if train else "t10k"
    return [f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"]


def _expected(name: str, root: Path, train: bool) -> tuple[Path, list[str]]:
    """The folder a dataset lives in and the files needed to load the ``train`` or test split."""
    if name == "cifar10":
        batches = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        return root / "cifar-10-batches-py", [*batches, "batches.meta"]
    if name == "cifar100":
        return root / "cifar-100-python", ["train" if train else "test", "meta"]
    if name == "svhn":
        return root, [f"{'train' if train else 'test'}_32x32.mat"]
    folder = "MNIST" if name == "mnist" else "FashionMNIST"
    return root / folder / "raw", _mnist_names(train)


def _locate(folder: Path, file: str, allow_gzip: bool) -> Path | None:
    for candidate in (folder / file, folder / f"{file}.gz") if allow_gzip else (folder / file,):
        if candidate.is_file():
            return candidate
    return None


def _check_files(name: str, folder: Path, files: list[str], train: bool) -> list[Path]:
    allow_gzip = name in ("mnist", "fashionmnist")
    paths = [_locate(folder, file, allow_gzip) for file in files]
    missing = [file for file, path in zip(files, paths, strict=True) if path is None]
    if missing:
        split = "train" if train else "test"
        gz = " (each may also be gzipped, <name>.gz)" if allow_gzip else ""
        state = "exists but lacks" if folder.is_dir() else "does not exist; expected it to hold"
        raise FileNotFoundError(
            f"{name} ({split} split): the folder {folder} {state} the files {', '.join(missing)}. "
            f"Expected files in {folder}: {', '.join(files)}{gz}. Nothing is downloaded: place the dataset's "
            f"original files there (the layout torchvision uses)."
        )
    return [path for path in paths if path is not None]


def check_vision_files(name: str, root: str | Path) -> None:
    """Check, without reading them, that the files of both splits of dataset ``name`` are under ``root``.

    :raises ValueError: for an unknown name.
    :raises FileNotFoundError: naming the folder and the missing files.
    """
    key = _dataset_key(name)
    for train in (True, False):
        folder, files = _expected(key, Path(root).expanduser(), train)
        _check_files(key, folder, files, train)


# --------------------------------------------------------------------------------------------------------------------
# readers


def _unpickle(path: Path) -> dict[str, Any]:
    """Load a CIFAR pickle; keys (bytes in the original Python 2 files) become ``str``."""
    try:
        with path.open("rb") as handle:
            entry = pickle.load(handle, encoding="bytes")
    except Exception as error:  # EOFError, UnpicklingError, ... from a truncated or damaged file
        raise ValueError(f"{path}: cannot be read as a CIFAR pickle: truncated or damaged "
                         f"({type(error).__name__}: {error})") from error
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: expected a pickled dict (the CIFAR format), got {type(entry).__name__}")
    return {key.decode("latin1") if isinstance(key, bytes) else key: value for key, value in entry.items()}


def _pixels(path: Path, values: object) -> np.ndarray:
    """``values`` as ``uint8`` pixels, refusing anything a cast would change silently: NaN or infinite values (they
    would become black), values outside ``[0, 255]`` (300 would wrap to 44) and fractions."""
    array = np.asarray(values)
    if array.dtype == np.uint8:
        return array
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{path}: expected pixel values as integers in [0, 255], got dtype {array.dtype}")
    if array.dtype.kind == "f":
        bad = int(np.count_nonzero(~np.isfinite(array)))
        if bad:
            raise ValueError(f"{path}: {bad} pixel values are NaN or infinite; expected integers in [0, 255]")
        if np.any(array != np.round(array)):
            raise ValueError(f"{path}: pixel values hold fractions (in [{array.min():g}, {array.max():g}]); expected "
                             "integers in [0, 255]")
    if array.size and (array.min() < 0 or array.max() > 255):
        raise ValueError(f"{path}: pixel values lie in [{array.min():g}, {array.max():g}]; expected integers in "
                         "[0, 255]")
    return array.astype(np.uint8)


def _read_cifar(name: str, batch_paths: list[Path], meta_path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    label_key, names_key = ("labels", "label_names") if name == "cifar10" else ("fine_labels", "fine_label_names")
    images, labels = [], []
    for path in batch_paths:
        entry = _unpickle(path)
        if "data" not in entry or label_key not in entry:
            raise ValueError(f"{name}: expected keys 'data' and '{label_key}' in {path}, got {sorted(entry)}")
        data = _pixels(path, entry["data"])
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise ValueError(f"{path}: expected 'data' of shape [n, 3072] (one 32x32 RGB image per row), got "
                             f"{data.shape}")
        targets = np.asarray(entry[label_key], dtype=np.int64).reshape(-1)
        if len(targets) != len(data):
            raise ValueError(f"{path}: holds {len(data)} images but {len(targets)} labels")
        images.append(data.reshape(len(data), 3, 32, 32).transpose(0, 2, 3, 1))  # CHW rows -> HWC images
        labels.append(targets)
    meta = _unpickle(meta_path)
    if names_key not in meta:
        raise ValueError(f"{meta_path}: expected the key '{names_key}', got {sorted(meta)}")
    classes = [c.decode("latin1") if isinstance(c, bytes) else str(c) for c in meta[names_key]]
    return np.concatenate(images), np.concatenate(labels), classes


def _read_svhn(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        from scipy.io import loadmat
    except ImportError as error:
        raise ImportError(
            "reading SVHN (.mat files) needs scipy; install it with `pip install scipy` (or pyro_flat[bench])"
        ) from error
    try:
        mat = loadmat(path)
    except Exception as error:
        raise ValueError(f"{path}: cannot be read as a MATLAB file: truncated or damaged ({error})") from error
    if "X" not in mat or "y" not in mat:
        raise ValueError(f"{path}: expected the variables 'X' and 'y' (the SVHN format)")
    pixels = _pixels(path, mat["X"])
    if pixels.ndim != 4 or pixels.shape[:3] != (32, 32, 3):
        raise ValueError(f"{path}: expected 'X' of shape [32, 32, 3, n], got {pixels.shape}")
    images = np.ascontiguousarray(pixels.transpose(3, 0, 1, 2))  # [32,32,3,N] -> NHWC
    labels = np.asarray(mat["y"], dtype=np.int64).reshape(-1)
    if len(labels) != len(images):
        raise ValueError(f"{path}: holds {len(images)} images but {len(labels)} labels")
    labels[labels == 10] = 0
    return images, labels


def _read_idx(path: Path) -> np.ndarray:
    """Read an idx-ubyte file (the MNIST format: big-endian header, ``uint8`` payload), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: expected an idx file of unsigned bytes (magic 0x0000 08 nd), got {raw[:4]!r}")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    payload = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if payload.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header announces shape {shape} but the file holds {payload.size} values")
    return payload.reshape(shape).copy()


def load_vision_dataset(
    name: str,
    root: str | Path,
    *,
    train: bool = True,
    transform: Callable[[Any], Any] | None = None,
) -> LocalImageDataset:
    """Read an image dataset from files under ``root``; never downloads (see the module docstring for the layout).

    Items are ``(transform(image), label)`` with ``image`` a PIL image (``"L"`` for MNIST/FashionMNIST, ``"RGB"``
    otherwise, 28x28 or 32x32) and ``label`` an ``int`` in ``[0, num_classes)``. Pass e.g.
    ``torchvision.transforms.ToTensor()`` to get ``[C, H, W]`` tensors in ``[0, 1]`` that a DataLoader can batch.

    :param str name: ``"cifar10"``, ``"cifar100"``, ``"svhn"``, ``"mnist"`` or ``"fashionmnist"``
        (case-insensitive; ``-`` and ``_`` are ignored).
    :param root: the root folder.
    :type root: str or pathlib.Path
    :param bool train: the training split if true, else the test split.
    :param transform: applied to each PIL image, or ``None``.
    :type transform: Callable or None
    :returns: the dataset, with ``num_data``, ``num_classes``, ``classes``, ``data`` (uint8) and ``targets``.
    :rtype: LocalImageDataset
    :raises FileNotFoundError: if the folder or a needed file is missing (the message names both).
    """
    key = _dataset_key(name)
    if transform is not None and not callable(transform):
        raise ValueError(f"load_vision_dataset: expected transform to be callable or None, got {transform!r}")
    try:
        import PIL.Image  # noqa: F401  (needed by __getitem__; fail early with a clear message)
    except ImportError as error:
        message = "load_vision_dataset needs Pillow; install it with `pip install pyro_flat[vision]`"
        raise ImportError(message) from error
    folder, files = _expected(key, Path(root).expanduser(), train)
    paths = _check_files(key, folder, files, train)
    if key in ("cifar10", "cifar100"):
        images, labels, classes = _read_cifar(key, paths[:-1], paths[-1])
    elif key == "svhn":
        images, labels = _read_svhn(paths[0])
        classes = [str(digit) for digit in range(10)]
    else:
        images, labels = _read_idx(paths[0]), _read_idx(paths[1]).astype(np.int64)
        classes = [str(digit) for digit in range(10)] if key == "mnist" else list(_FASHION_CLASSES)
        if images.ndim != 3 or len(images) != len(labels):
            raise ValueError(f"{paths[0]}: expected {len(labels)} images [n, H, W] for the {len(labels)} labels of "
                             f"{paths[1]}, got shape {images.shape}")
    if len(images) == 0:
        split = "train" if train else "test"
        raise ValueError(f"{key} ({split} split): the files {', '.join(map(str, paths))} hold no images")
    if len(labels) and (labels.min() < 0 or labels.max() >= len(classes)):
        raise ValueError(f"{key}: labels lie in [{labels.min()}, {labels.max()}], expected [0, {len(classes)})")
    return LocalImageDataset(key, images, torch.from_numpy(labels), classes, transform)
