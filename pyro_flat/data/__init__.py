"""Data for pyro_flat: in-memory datasets, bundled real data, toy targets with known answers, local image datasets.

* :mod:`~pyro_flat.data.datasets`: :class:`ClassificationData`, :class:`RegressionData` (train/test tensors,
  ``num_data``, minibatch loaders, class subsets and few-shot tasks).
* :mod:`~pyro_flat.data.real`: scikit-learn's digits and MNIST-1D, both without download (extra ``[bench]``).
* :mod:`~pyro_flat.data.toy`: two moons, heteroscedastic 1-D regression, and targets with exact answers
  (:class:`SharpFlatEnergy`, :class:`BayesianLinearRegression`, :class:`GaussianTarget`).
* :mod:`~pyro_flat.data.vision`: CIFAR-10/100, SVHN, MNIST, FashionMNIST read from a local folder (extra
  ``[vision]``).
* :mod:`~pyro_flat.data.images`: those datasets at scale (:class:`VisionData`): the standard augmentation and
  ``DataLoader`` s whose batches depend only on the seed and their position (resumable, any number of workers).

Importing this package imports only torch, numpy and Pyro; the optional packages are imported by the loaders that
need them.
"""

from . import toy
from .datasets import ClassificationData, RegressionData
from .images import VisionData, load_vision_data, write_synthetic_cifar
from .real import feature_shuffled, load_dataset, load_digits, load_mnist1d
from .toy import *  # noqa: F403 (two moons, heteroscedastic regression, the targets with exact answers)
from .vision import VISION_DATASETS, LocalImageDataset, check_vision_files, load_vision_dataset, vision_num_data

__all__ = [
    "ClassificationData",
    "RegressionData",
    "load_digits",
    "load_mnist1d",
    "load_dataset",
    "feature_shuffled",
    *toy.__all__,
    "load_vision_dataset",
    "check_vision_files",
    "vision_num_data",
    "LocalImageDataset",
    "VISION_DATASETS",
    "VisionData",
    "load_vision_data",
    "write_synthetic_cifar",
]
