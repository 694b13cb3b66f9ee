from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pyro_flat.data import ClassificationData, feature_shuffled, load_dataset, load_digits, load_mnist1d
from pyro_flat.data import real as real_module

sklearn_datasets = pytest.importorskip("sklearn.datasets")


def sorted_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(len(x), -1).sort(dim=1).values


def check_feature_shuffled_ood(data: ClassificationData) -> None:
    """x_ood holds each test example's own values, in a different order for (almost) every example."""
    assert data.x_ood.shape == data.x_test.shape
    assert torch.equal(sorted_rows(data.x_ood), sorted_rows(data.x_test))
    changed = (data.x_ood != data.x_test).reshape(len(data.x_test), -1).any(dim=1)
    assert changed.float().mean() > 0.95


# ------------------------------------------------------------------------------------------------------------------
# digits


@pytest.fixture(scope="module")
def digits() -> ClassificationData:
    return load_digits(dtype=torch.float64)


def test_digits_sizes_and_ranges(digits):
    assert (digits.num_data, len(digits.x_test)) == (1257, 540)
    assert digits.input_shape == torch.Size([64]) and digits.num_classes == 10
    assert digits.x_train.min() == 0 and digits.x_train.max() == 1
    assert torch.equal(digits.y_train.unique(), torch.arange(10))
    assert digits.y_train.dtype == torch.int64


def test_digits_split_is_a_partition_of_the_bundled_data(digits):
    bundled = sklearn_datasets.load_digits()
    ours = torch.cat([digits.x_train, digits.x_test]) * 16
    keys = lambda x: sorted(map(tuple, np.asarray(x).round().astype(int).tolist()))  # noqa: E731
    assert keys(ours) == keys(bundled.data)
    labels = torch.cat([digits.y_train, digits.y_test])
    assert torch.equal(torch.bincount(labels), torch.as_tensor(np.bincount(bundled.target)))


def test_digits_split_is_stratified(digits):
    total = torch.bincount(torch.cat([digits.y_train, digits.y_test])).double()
    test = torch.bincount(digits.y_test, minlength=10).double()
    assert ((test - 0.3 * total).abs() <= 1).all()  # each class split 70/30 up to rounding


def test_digits_seed_determinism(digits):
    again = load_digits(seed=0)
    other = load_digits(seed=1)
    assert torch.equal(again.x_test, digits.x_test) and torch.equal(again.x_ood, digits.x_ood)
    assert not torch.equal(other.y_test, digits.y_test)


def test_digits_images_and_dtype():
    images = load_digits(flatten=False, dtype=torch.float32, device="cpu")
    flat = load_digits()
    assert images.x_train.shape == (1257, 1, 8, 8) and images.x_ood.shape == (540, 1, 8, 8)
    assert images.dtype == torch.float32 and images.y_train.dtype == torch.int64
    assert torch.equal(images.x_train.reshape(1257, 64).double(), flat.x_train)


def test_digits_follow_the_default_dtype_without_changing_values(digits):
    torch.set_default_dtype(torch.float32)  # the conftest fixture restores float64 afterwards
    data = load_digits()
    assert data.dtype == torch.float32
    assert torch.equal(data.x_ood.double(), digits.x_ood) and torch.equal(data.y_test, digits.y_test)


def test_digits_ood_is_feature_shuffled(digits):
    check_feature_shuffled_ood(digits)


@pytest.mark.parametrize("test_fraction", [0.0, 1.0, -0.1, "0.3"])
def test_digits_bad_test_fraction(test_fraction):
    with pytest.raises(ValueError, match="test_fraction in"):
        load_digits(test_fraction=test_fraction)


def test_feature_shuffled_uses_one_permutation_per_example():
    x = torch.arange(50.0).expand(40, 50)
    shuffled = feature_shuffled(x, seed=0)
    assert torch.equal(shuffled.sort(dim=1).values, x)
    assert len({tuple(row.tolist()) for row in shuffled}) == 40
    assert torch.equal(feature_shuffled(x, seed=0), shuffled)
    assert not torch.equal(feature_shuffled(x, seed=1), shuffled)


# ------------------------------------------------------------------------------------------------------------------
# MNIST-1D

mnist1d_data = pytest.importorskip("mnist1d.data")


def test_mnist1d_default_sizes_and_standardisation():
    data = load_mnist1d()
    assert (data.num_data, len(data.x_test)) == (4000, 1000)
    assert data.input_shape == torch.Size([40]) and data.num_classes == 10
    assert torch.equal(data.y_train.unique(), torch.arange(10)) and data.y_train.dtype == torch.int64
    assert abs(float(data.x_train.mean())) < 1e-10
    assert abs(float(data.x_train.std(unbiased=False)) - 1) < 1e-10
    check_feature_shuffled_ood(data)


def test_mnist1d_matches_offline_generation_with_train_statistics():
    raw = mnist1d_data.make_dataset(_args(num_samples=300, seed=3))
    data = load_mnist1d(num_samples=300, seed=3)
    assert (data.num_data, len(data.x_test)) == (240, 60)
    mean, std = raw["x"].mean(), raw["x"].std()
    np.testing.assert_allclose(data.x_train.numpy(), (raw["x"] - mean) / std, atol=1e-12)
    np.testing.assert_allclose(data.x_test.numpy(), (raw["x_test"] - mean) / std, atol=1e-12)
    assert data.y_test.tolist() == raw["y_test"].tolist()


def _args(num_samples: int, seed: int):
    args = mnist1d_data.get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    return args


def test_mnist1d_seeds_cache_and_global_rng():
    np.random.seed(123)
    random.seed(123)
    numpy_before, python_before = np.random.get_state()[1].copy(), random.getstate()
    first = load_mnist1d(num_samples=200, seed=7)
    assert np.array_equal(np.random.get_state()[1], numpy_before) and random.getstate() == python_before
    hits = real_module._mnist1d_arrays.cache_info().hits
    again = load_mnist1d(num_samples=200, seed=7, flatten=False, dtype=torch.float32)
    assert real_module._mnist1d_arrays.cache_info().hits == hits + 1
    assert again.x_train.shape == (160, 1, 40) and again.dtype == torch.float32
    assert torch.allclose(again.x_train[:, 0].double(), first.x_train, atol=1e-6)
    assert not torch.equal(load_mnist1d(num_samples=200, seed=8).x_train, first.x_train)


def test_mnist1d_bad_num_samples():
    with pytest.raises(ValueError, match="load_mnist1d: `num_samples` must be an int >= 10"):
        load_mnist1d(num_samples=5)


# ------------------------------------------------------------------------------------------------------------------
# dispatch


def test_load_dataset_dispatch():
    assert load_dataset("Digits", seed=0).name == "digits"
    assert load_dataset("two_moons", num_data=10).num_data == 10
    with pytest.raises(ValueError, match=r"unknown dataset name 'cifar'; expected one of \['digits', 'mnist1d'"):
        load_dataset("cifar")
