from __future__ import annotations

import gzip
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from pyro_flat.data import LocalImageDataset, load_vision_dataset, vision_num_data

transforms = pytest.importorskip("torchvision.transforms")
Image = pytest.importorskip("PIL.Image")

RNG = np.random.default_rng(0)


# ------------------------------------------------------------------------------------------------------------------
# writers of small files in the real formats


def write_pickle(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        pickle.dump(obj, handle)


def write_cifar10(root: Path, per_batch: int = 2) -> dict[str, tuple[np.ndarray, list[int]]]:
    """Five train batches and a test batch of ``per_batch`` random images each, keys as bytes like the originals."""
    folder, written = root / "cifar-10-batches-py", {}
    for i, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        data = RNG.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [(i + j) % 10 for j in range(per_batch)]
        write_pickle(folder / name, {b"data": data, b"labels": labels, b"batch_label": name.encode()})
        written[name] = (data, labels)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    write_pickle(folder / "batches.meta", {b"label_names": names, b"num_vis": 3072})
    return written


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", n) for n in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as handle:
            handle.write(payload)
    else:
        path.write_bytes(payload)


# ------------------------------------------------------------------------------------------------------------------
# CIFAR


def test_cifar10_train_and_test(tmp_path):
    written = write_cifar10(tmp_path)
    train = load_vision_dataset("CIFAR10", tmp_path)
    assert isinstance(train, LocalImageDataset)
    assert len(train) == vision_num_data(train) == train.num_data == 10 and train.num_classes == 10
    assert train.classes[0] == "airplane" and train.classes[9] == "truck"
    assert train.targets.dtype == torch.int64
    assert train.targets.tolist() == sum((written[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    image, label = train[3]  # second image of data_batch_2
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (32, 32)
    assert isinstance(label, int) and label == written["data_batch_2"][1][1]
    # each row is 1024 red, 1024 green, 1024 blue values in row-major order
    raw = written["data_batch_2"][0][1]
    pixel = image.getpixel((5, 7))  # (x=column, y=row)
    assert pixel == (raw[7 * 32 + 5], raw[1024 + 7 * 32 + 5], raw[2048 + 7 * 32 + 5])

    test = load_vision_dataset("cifar10", tmp_path, train=False, transform=transforms.ToTensor())
    assert len(test) == 2
    tensor, label = test[0]
    assert tensor.shape == (3, 32, 32) and tensor.dtype == torch.get_default_dtype()  # ToTensor's choice
    expected = torch.from_numpy(written["test_batch"][0][0].reshape(3, 32, 32) / 255)
    torch.testing.assert_close(tensor, expected.to(tensor.dtype))
    batch_x, batch_y = next(iter(torch.utils.data.DataLoader(test, batch_size=2)))
    assert batch_x.shape == (2, 3, 32, 32) and batch_y.tolist() == written["test_batch"][1]


def test_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    data = RNG.integers(0, 256, size=(3, 3072), dtype=np.uint8)
    write_pickle(folder / "train", {b"data": data, b"fine_labels": [99, 5, 0], b"coarse_labels": [19, 1, 0]})
    write_pickle(folder / "meta", {b"fine_label_names": [f"c{i}".encode() for i in range(100)]})
    train = load_vision_dataset("cifar100", tmp_path)
    assert train.targets.tolist() == [99, 5, 0] and train.num_classes == 100 and train.classes[99] == "c99"
    assert np.array_equal(np.asarray(train[0][0]), data[0].reshape(3, 32, 32).transpose(1, 2, 0))


def _spoil_cifar10(root: Path, change) -> Path:
    """Write a CIFAR-10 folder, then rewrite data_batch_3 with ``change(entry)`` (``None``: truncate the file)."""
    write_cifar10(root)
    path = root / "cifar-10-batches-py" / "data_batch_3"
    if change is None:
        path.write_bytes(path.read_bytes()[:200])
    else:
        with path.open("rb") as handle:
            entry = pickle.load(handle)
        write_pickle(path, change(entry))
    return path


def _with_data(values):
    return lambda entry: entry | {b"data": values}


def _nan_pixels(entry):
    data = entry[b"data"].astype(np.float64)
    data[1, 5] = np.nan
    return entry | {b"data": data}


def _large_pixels(entry):
    data = entry[b"data"].astype(np.int64)
    data[0, 0] = 300  # would wrap to 44 in a uint8 cast
    return entry | {b"data": data}


BAD_CIFAR = {
    "nan": (_nan_pixels, r"1 pixel values are NaN or infinite; expected integers in \[0, 255\]"),
    "out of range": (_large_pixels, r"pixel values lie in \[\d+, 300\]; expected integers in \[0, 255\]"),
    "fractions": (_with_data(np.full((2, 3072), 0.5)), "pixel values hold fractions"),
    "truncated": (None, "cannot be read as a CIFAR pickle: truncated or damaged"),
    "shape": (_with_data(np.zeros((2, 3000), dtype=np.uint8)), r"expected 'data' of shape \[n, 3072\]"),
    "labels": (lambda entry: entry | {b"labels": [1]}, "holds 2 images but 1 labels"),
    "not a dict": (lambda entry: [entry], "expected a pickled dict"),
}


@pytest.mark.parametrize("case", sorted(BAD_CIFAR))
def test_bad_cifar_files_are_refused_naming_the_file(tmp_path, case):
    """NaN pixels used to become black images (with a NumPy warning), 300 wrapped to 44, and a truncated pickle or a
    wrong shape raised errors that did not name the file."""
    change, message = BAD_CIFAR[case]
    path = _spoil_cifar10(tmp_path, change)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": .*" + message):
        load_vision_dataset("cifar10", tmp_path)


def test_an_empty_split_is_refused_naming_its_files(tmp_path):
    write_cifar10(tmp_path, per_batch=0)
    with pytest.raises(ValueError, match=r"cifar10 \(test split\): the files .*test_batch.* hold no images"):
        load_vision_dataset("cifar10", tmp_path, train=False)


# ------------------------------------------------------------------------------------------------------------------
# SVHN


def test_svhn_mat_file(tmp_path):
    scipy_io = pytest.importorskip("scipy.io")
    images = RNG.integers(0, 256, size=(32, 32, 3, 4), dtype=np.uint8)
    scipy_io.savemat(tmp_path / "test_32x32.mat", {"X": images, "y": np.array([[10], [1], [9], [10]], dtype=np.uint8)})
    test = load_vision_dataset("SVHN", tmp_path, train=False, transform=transforms.ToTensor())
    assert test.targets.tolist() == [0, 1, 9, 0]  # label 10 is digit 0
    tensor, label = test[2]
    assert tensor.shape == (3, 32, 32) and label == 9
    expected = torch.from_numpy(images[:, :, :, 2].transpose(2, 0, 1) / 255)
    torch.testing.assert_close(tensor, expected.to(tensor.dtype))
    images = images.astype(np.int16)
    images[0, 0, 0, 1] = 300
    scipy_io.savemat(tmp_path / "test_32x32.mat", {"X": images, "y": np.array([[10], [1], [9], [10]], dtype=np.uint8)})
    with pytest.raises(ValueError, match=r"test_32x32.mat: pixel values lie in \[\d+, 300\]"):
        load_vision_dataset("svhn", tmp_path, train=False)


# ------------------------------------------------------------------------------------------------------------------
# MNIST / FashionMNIST


@pytest.mark.parametrize("name, folder, compress", [("mnist", "MNIST", False), ("FashionMNIST", "FashionMNIST", True)])
def test_mnist_family_idx_files(tmp_path, name, folder, compress):
    raw = tmp_path / folder / "raw"
    images = RNG.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    labels = np.array([3, 0, 9, 1, 1], dtype=np.uint8)
    write_idx(raw / "t10k-images-idx3-ubyte", images, compress)
    write_idx(raw / "t10k-labels-idx1-ubyte", labels, compress)
    test = load_vision_dataset(name, tmp_path, train=False)
    assert vision_num_data(test) == 5 and test.targets.tolist() == [3, 0, 9, 1, 1]
    image, label = test[2]
    assert image.mode == "L" and image.size == (28, 28) and label == 9
    assert np.array_equal(np.asarray(image), images[2])
    assert test.classes[0] == ("0" if name == "mnist" else "T-shirt/top")
    flip = load_vision_dataset(name, tmp_path, train=False, transform=transforms.RandomHorizontalFlip(p=1.0))
    assert np.array_equal(np.asarray(flip[2][0]), images[2][:, ::-1])


def test_idx_header_mismatch_is_reported(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    write_idx(raw / "train-images-idx3-ubyte", RNG.integers(0, 256, size=(2, 28, 28), dtype=np.uint8))
    (raw / "train-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 3) + bytes([1, 2]))
    with pytest.raises(ValueError, match=r"announces shape \(3,\) but the file holds 2 values"):
        load_vision_dataset("mnist", tmp_path)


# ------------------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "name, train, folder, files",
    [
        ("cifar10", True, "cifar-10-batches-py", ["data_batch_1", "data_batch_5", "batches.meta"]),
        ("cifar10", False, "cifar-10-batches-py", ["test_batch", "batches.meta"]),
        ("cifar100", True, "cifar-100-python", ["train", "meta"]),
        ("svhn", True, "", ["train_32x32.mat"]),
        ("mnist", True, "MNIST/raw", ["train-images-idx3-ubyte", "train-labels-idx1-ubyte"]),
        ("fashionmnist", False, "FashionMNIST/raw", ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]),
    ],
)
def test_missing_files_error_names_folder_and_files(tmp_path, name, train, folder, files):
    expected_folder = str(tmp_path / folder) if folder else str(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        load_vision_dataset(name, tmp_path, train=train)
    message = str(info.value)
    assert expected_folder in message and "Nothing is downloaded" in message
    for file in files:
        assert file in message


def test_partial_folder_names_only_missing_files(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape("exists but lacks the files data_batch_3.")):
        load_vision_dataset("cifar10", tmp_path)
    assert len(load_vision_dataset("cifar10", tmp_path, train=False)) == 2  # the test split needs no train batch


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"unknown dataset name 'imagenet'; expected one of \['cifar10'"):
        load_vision_dataset("imagenet", tmp_path)
    write_cifar10(tmp_path)
    with pytest.raises(ValueError, match="transform to be callable"):
        load_vision_dataset("cifar10", tmp_path, transform="to_tensor")


def test_vision_num_data_on_other_datasets():
    subset = torch.utils.data.Subset(torch.utils.data.TensorDataset(torch.zeros(10, 2)), [1, 2, 3])
    assert vision_num_data(subset) == 3
    with pytest.raises(ValueError, match="dataset with a length"):
        vision_num_data(object())
