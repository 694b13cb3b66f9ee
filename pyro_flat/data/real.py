"""Small real datasets that need no download: scikit-learn's bundled digits and MNIST-1D generated offline.

Both loaders return a :class:`~pyro_flat.data.datasets.ClassificationData` whose ``x_ood`` is a *feature-shuffled*
copy of the test inputs: every test example gets its own random permutation of its features (pixels or time steps),
drawn from a generator seeded with the loader's ``seed``. The OOD set therefore has exactly the per-example intensity
histogram of in-distribution data but none of its spatial structure, so a model can only tell it apart by what it
learned about the structure (not by a shift in input scale).

scikit-learn and mnist1d are optional (``pip install pyro_flat[bench]``); they are imported only inside the loader
that needs them.

References:
    * [1] `Optical Recognition of Handwritten Digits`, E. Alpaydin, C. Kaynak (UCI Machine Learning Repository, 1998),
      DOI:10.24432/C50P49
    * [2] `Scaling Down Deep Learning with MNIST-1D`, Sam Greydanus, Dmitry Kobak (ICML 2024), arXiv:2011.14439
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._validation import check_int
from .datasets import ClassificationData

__all__ = ["load_digits", "load_mnist1d", "load_dataset", "feature_shuffled"]


def _import_extra(module: str, extra: str, purpose: str) -> Any:
    """Import ``module`` or raise an :class:`ImportError` naming the pyro_flat extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{purpose} needs the optional module '{module}'; install it with `pip install pyro_flat[{extra}]`"
        ) from error


def _as_inputs(array: np.ndarray, device: torch.device | str | None, dtype: torch.dtype | None) -> Tensor:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype, device=device)


def _as_labels(array: np.ndarray, device: torch.device | str | None) -> Tensor:
    return torch.as_tensor(np.asarray(array, dtype=np.int64).copy(), device=device)


def feature_shuffled(x: Tensor, seed: int) -> Tensor:
    """``x`` with the features of every example permuted by an independent random permutation.

    The features are all dimensions after the first (an image ``[N, C, H, W]`` has its ``C*H*W`` values shuffled
    together). The permutations come from a CPU generator seeded with ``seed``; the result keeps ``x``'s shape,
    device and dtype.

    :param Tensor x: inputs of shape ``[N, *features]``.
    :param int seed: the seed of the permutations.
    """
    flat = x.reshape(len(x), -1)
    generator = torch.Generator().manual_seed(seed)
    permutation = torch.rand(flat.shape, generator=generator, dtype=torch.float64).argsort(dim=1).to(x.device)
    return flat.gather(1, permutation).reshape(x.shape)


def _classification_data(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    num_classes: int,
    seed: int,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> ClassificationData:
    x_test_tensor = _as_inputs(x_test, device, dtype)
    return ClassificationData(
        name=name,
        x_train=_as_inputs(x_train, device, dtype),
        y_train=_as_labels(y_train, device),
        x_test=x_test_tensor,
        y_test=_as_labels(y_test, device),
        num_classes=num_classes,
        x_ood=feature_shuffled(x_test_tensor, seed),
    )


def load_digits(
    *,
    test_fraction: float = 0.3,
    seed: int = 0,
    flatten: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> ClassificationData:
    """scikit-learn's bundled 8x8 handwritten digits [1]: 1797 grey images, 10 classes, no download.

    Pixels (integers 0..16) are divided by 16, so inputs lie in ``[0, 1]``. The train/test split is stratified by
    class and drawn with ``seed`` (``sklearn.model_selection.train_test_split``); the test set holds
    ``ceil(test_fraction * 1797)`` images, so the default gives **1257 train / 540 test**. ``x_ood`` holds the test
    images with their 64 pixels shuffled per image (see the module docstring).

    :param float test_fraction: the fraction of images in the test set, in ``(0, 1)``.
    :param int seed: the seed of the split and of the OOD pixel shuffle.
    :param bool flatten: inputs of shape ``[N, 64]`` if true, else ``[N, 1, 8, 8]``.
    :param device: the device of all tensors (default CPU).
    :param dtype: the floating dtype of the inputs (default ``torch.get_default_dtype()``); labels are ``int64``.
    :returns: the dataset, named ``"digits"``.
    :rtype: ClassificationData
    """
    if not (isinstance(test_fraction, float | int) and 0.0 < test_fraction < 1.0):
        raise ValueError(f"load_digits: expected test_fraction in (0, 1), got {test_fraction!r}")
    datasets = _import_extra("sklearn.datasets", "bench", "load_digits")
    model_selection = _import_extra("sklearn.model_selection", "bench", "load_digits")
    digits = datasets.load_digits()
    x = digits.images.astype(np.float64) / 16.0  # [1797, 8, 8]
    x = x.reshape(len(x), 64) if flatten else x.reshape(len(x), 1, 8, 8)
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x, digits.target, test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    return _classification_data(
        "digits", x_train, y_train, x_test, y_test, num_classes=10, seed=seed, device=device, dtype=dtype
    )


@functools.lru_cache(maxsize=8)
def _mnist1d_arrays(num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Generate MNIST-1D offline with ``mnist1d.data.make_dataset`` (cached per ``(num_samples, seed)``).

    ``make_dataset`` reseeds Python's and NumPy's global generators; their states are restored afterwards so that
    loading data does not change the caller's random streams. The arrays are read-only: callers copy them.
    """
    data = _import_extra("mnist1d.data", "bench", "load_mnist1d")
    args = data.get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        raw = data.make_dataset(args)
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    arrays = (raw["x"], raw["y"], raw["x_test"], raw["y_test"])
    for array in arrays:
        array.setflags(write=False)
    return arrays


def load_mnist1d(
    *,
    num_samples: int = 5000,
    seed: int = 42,
    flatten: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> ClassificationData:
    """MNIST-1D [2]: 1-D signals of length 40 built from 10 digit templates, generated offline (no download).

    The data come from ``mnist1d.data.make_dataset(get_dataset_args())`` with ``num_samples`` and ``seed`` replaced
    (never ``get_dataset``, which downloads). ``make_dataset`` makes ``num_samples // 10`` examples per class and
    puts the first 80 % in the training set, so the default gives **4000 train / 1000 test**, 40 features and 10
    classes. Inputs are standardised with one scalar mean and (population) standard deviation computed over all
    values of the *training* inputs (so ``x_train`` has mean 0 and std 1; the test and OOD inputs get the same affine
    map); a scalar rather than per-position statistics keeps the shape of each signal intact. Generation takes about
    a second; the raw arrays are cached in-process, so repeated calls are cheap. ``x_ood`` holds the standardised test
    signals with their 40 values shuffled per signal (see the module docstring).

    :param int num_samples: the total number of examples before the split (at least 10).
    :param int seed: the generation seed (42 is the dataset's published default) and the OOD shuffle seed.
    :param bool flatten: inputs of shape ``[N, 40]`` if true, else ``[N, 1, 40]`` (for 1-D convolutions).
    :param device: the device of all tensors (default CPU).
    :param dtype: the floating dtype of the inputs (default ``torch.get_default_dtype()``); labels are ``int64``.
    :returns: the dataset, named ``"mnist1d"``.
    :rtype: ClassificationData
    """
    check_int(num_samples, "num_samples", minimum=10, owner="load_mnist1d")
    x_train, y_train, x_test, y_test = _mnist1d_arrays(num_samples, seed)
    mean, std = x_train.mean(), x_train.std()
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    if not flatten:
        x_train, x_test = x_train[:, None, :], x_test[:, None, :]
    return _classification_data(
        "mnist1d", x_train, y_train, x_test, y_test, num_classes=10, seed=seed, device=device, dtype=dtype
    )


def _two_moons(**kwargs: Any) -> ClassificationData:
    from .toy import two_moons

    return two_moons(**kwargs)


_LOADERS: dict[str, Callable[..., ClassificationData]] = {
    "digits": load_digits,
    "mnist1d": load_mnist1d,
    "two_moons": _two_moons,
}


def load_dataset(name: str, **kwargs: Any) -> ClassificationData:
    """Load a bundled classification dataset by name.

    :param str name: ``"digits"`` (:func:`load_digits`), ``"mnist1d"`` (:func:`load_mnist1d`) or ``"two_moons"``
        (:func:`pyro_flat.data.toy.two_moons`); case-insensitive.
    :param kwargs: passed to the loader (e.g. ``seed``, ``device``, ``dtype``).
    :returns: the dataset.
    :rtype: ClassificationData
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in _LOADERS:
        raise ValueError(f"load_dataset: unknown dataset name {name!r}; expected one of {sorted(_LOADERS)}")
    return _LOADERS[key](**kwargs)
