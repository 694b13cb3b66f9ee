"""Image data at scale: the augmentation against torchvision's, batches built on the device equal to the loader's and
to the batches built before the device path, loaders that do not depend on workers, mid-epoch resume, data-parallel
shards, normalisation, and the synthetic CIFAR folders."""

from __future__ import annotations

import pytest
import torch

from pyro_flat.data import VisionData, load_vision_data, load_vision_dataset, write_synthetic_cifar
from pyro_flat.data.images import DeviceBatches, EpochBatches, ImageBatches, augment, combined_seed

F = pytest.importorskip("torchvision.transforms.functional")
transforms = pytest.importorskip("torchvision.transforms")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_synthetic_cifar(root, num_train=60, num_test=20)
    return root


def test_synthetic_folders_are_read_by_the_real_readers(tmp_path):
    write_synthetic_cifar(tmp_path, "cifar10", num_train=23, num_test=7)
    write_synthetic_cifar(tmp_path, "cifar100", num_train=11, num_test=5)
    c10, c100 = load_vision_dataset("cifar10", tmp_path), load_vision_dataset("cifar100", tmp_path, train=False)
    assert (c10.num_data, c10.num_classes, c100.num_data, c100.num_classes) == (23, 10, 5, 100)
    assert c10.data.shape == (23, 32, 32, 3)
    with pytest.raises(ValueError, match="'cifar10' or 'cifar100'"):
        write_synthetic_cifar(tmp_path, "svhn")


def test_augment_is_torchvisions_crop_and_flip():
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    generator = torch.Generator().manual_seed(5)
    out = augment(images, torch.Generator().manual_seed(5))
    top, left = torch.randint(0, 9, (6,), generator=generator), torch.randint(0, 9, (6,), generator=generator)
    flips = torch.rand(6, generator=generator) < 0.5
    for i in range(6):  # torchvision's RandomCrop(32, padding=4) and RandomHorizontalFlip at the same offsets
        expected = F.crop(F.pad(images[i], [4]), int(top[i]), int(left[i]), 32, 32)
        expected = F.hflip(expected) if flips[i] else expected
        assert torch.equal(out[i], expected)
    assert torch.equal(augment(images, torch.Generator().manual_seed(5), flip=False)[flips],
                       out[flips].flip(-1))


def test_a_shard_is_augmented_as_within_the_whole_batch():
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    whole = augment(images, torch.Generator().manual_seed(7))
    for start in (0, 4):  # two ranks' shards of a batch of 8
        shard = augment(images[start : start + 4], torch.Generator().manual_seed(7), batch_size=8, offset=start)
        assert torch.equal(shard, whole[start : start + 4])
    with pytest.raises(ValueError, match=r"rows \[6, 10\) are not inside a batch of 8"):
        augment(images[:4], torch.Generator().manual_seed(7), batch_size=8, offset=6)


def test_augment_offsets_and_flips_are_uniform():
    # 9000 single-pixel images padded by 1: the pixel stays inside the 1x1 crop for 1 of the 9 offsets (count
    # 1000, sd 30); a marked column reveals the flips (p = 1/2, sd 47); bounds at 5 sd
    images = torch.ones(9000, 1, 1, 1, dtype=torch.uint8)
    out = augment(images, torch.Generator().manual_seed(0), pad=1)
    assert abs(int(out.sum()) - 1000) < 5 * 30
    images = torch.zeros(9000, 1, 1, 2, dtype=torch.uint8)
    images[..., 0] = 1
    out = augment(images, torch.Generator().manual_seed(1), pad=0)  # no padding: only the flips act
    assert abs(int(out[..., 1].sum()) - 4500) < 5 * 47 and torch.equal(out.sum(-1), images.sum(-1))


def test_normalised_like_torchvision(cifar):
    data = load_vision_data("cifar10", cifar, dtype=torch.float32)
    assert isinstance(data, VisionData) and data.images.dtype == torch.uint8 and data.images.shape == (60, 3, 32, 32)
    zeros = torch.zeros(3, dtype=torch.float32)
    torch.testing.assert_close(data.x_train.mean(dim=(0, 2, 3)), zeros, atol=1e-5, rtol=0)
    torch.testing.assert_close(data.x_train.std(dim=(0, 2, 3), unbiased=False), zeros + 1, atol=1e-4, rtol=0)
    raw = load_vision_dataset("cifar10", cifar, train=False)
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(data.mean.tolist(), data.std.tolist())])
    torch.testing.assert_close(data.x_test[3], normalize(raw[3][0]).to(torch.float32), atol=1e-5, rtol=0)
    # the loaders' un-augmented batches are the same images
    x, y = ImageBatches(data.images, data.y_train, data.mean, data.std)[(torch.tensor([4, 1]), None, 0, 2)]
    torch.testing.assert_close(x, data.x_train[[4, 1]], atol=1e-5, rtol=0)
    assert torch.equal(y, data.y_train[[4, 1]])
    flat = load_vision_data("cifar10", cifar, flatten=True)
    assert flat.x_train.shape == (60, 3072) and flat.x_ood.shape == (20, 3072)


def test_subsets_keep_images_and_labels_together(cifar):
    data = load_vision_data("cifar10", cifar)
    few = data.few_shot(2, seed=1)
    assert isinstance(few, VisionData) and len(few.images) == len(few.y_train) == 20
    x, y = ImageBatches(few.images, few.y_train, few.mean, few.std)[(torch.arange(20), None, 0, 20)]
    torch.testing.assert_close(x.to(few.dtype), few.x_train, atol=1e-5, rtol=0)
    sub = data.subset(classes=[3, 1])
    assert set(sub.y_train.tolist()) <= {0, 1} and len(sub.images) == len(sub.y_train)
    moved = data.to(dtype=torch.float32)
    assert isinstance(moved, VisionData) and moved.images is data.images and moved.x_train.dtype == torch.float32


def _epoch(data, **kwargs):
    return [(x, y) for x, y in data.train_batches(16, seed=3, **kwargs)]


def test_batches_depend_on_the_seed_and_position_only(cifar):
    data = load_vision_data("cifar10", cifar)
    serial, parallel = _epoch(data), _epoch(data, num_workers=2)
    assert len(serial) == 4 and [len(x) for x, _ in serial] == [16, 16, 16, 12]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(serial, parallel, strict=True))
    resumed = _epoch(data, start=2)  # mid-epoch resume: the same batches 2 and 3
    assert all(torch.equal(a[0], b[0]) for a, b in zip(serial[2:], resumed, strict=True))
    other = _epoch(data, epoch=1)
    assert not torch.equal(serial[0][1], other[0][1])  # another epoch, another order
    plain = _epoch(data, augment=False)  # without augmentation: the normalised images in the epoch's order
    for (x, y), (indices, seed, *_) in zip(plain, EpochBatches(60, 16, 3, augment=False), strict=True):
        assert seed is None and torch.equal(y, data.y_train[indices])
        torch.testing.assert_close(x.to(data.dtype), data.x_train[indices], atol=1e-5, rtol=0)


def test_data_parallel_shards_partition_the_global_batch(cifar):
    data = load_vision_data("cifar10", cifar)
    whole = _epoch(data, drop_last=True)
    shards = [_epoch(data, rank=r, world_size=2, drop_last=True) for r in range(2)]
    assert len(whole) == len(shards[0]) == 3
    for b, (x, y) in enumerate(whole):  # the same augmented global batch, split in two equal halves
        assert torch.equal(torch.cat([shards[0][b][0], shards[1][b][0]]), x)
        assert torch.equal(torch.cat([shards[0][b][1], shards[1][b][1]]), y)
    with pytest.raises(ValueError, match="divisible by the number of processes 3"):
        EpochBatches(60, 16, 0, world_size=3)


def _batches_built_before(data, batch_size, seed, *, epoch=0, start=0, augment=True, drop_last=False, rank=0,
                          world_size=1):
    """The reference: one epoch of minibatches as the loaders built them before augmentation moved to the device
    (pyro_flat 8897c86), per batch on the CPU: the epoch's permutation, each batch's generator, its crops by advanced
    indexing of the padded images and its flips by ``torch.where``, then the normalisation."""
    order = torch.randperm(len(data.images), generator=torch.Generator().manual_seed(combined_seed(seed, epoch)))
    full, rest = divmod(len(data.images), batch_size)
    scale = (1.0 / (255.0 * data.std)).to(torch.float32).reshape(1, -1, 1, 1)
    shift = (data.mean / data.std).to(torch.float32).reshape(1, -1, 1, 1)
    shard = batch_size // world_size
    out = []
    for batch in range(start, full + (rest > 0 and not drop_last and world_size == 1)):
        indices = order[batch * batch_size : (batch + 1) * batch_size]
        first, stop = (0, len(indices)) if world_size == 1 else (rank * shard, (rank + 1) * shard)
        images = data.images[indices[first:stop]]
        if augment:
            generator = torch.Generator().manual_seed(combined_seed(seed, epoch, batch))
            total, b = len(indices), stop - first
            top = torch.randint(0, 9, (total,), generator=generator)[first:stop]
            left = torch.randint(0, 9, (total,), generator=generator)[first:stop]
            flips = (torch.rand(total, generator=generator) < 0.5)[first:stop] if data.flip else None
            padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
            rows = (top[:, None] + torch.arange(32))[:, None, :, None]
            cols = (left[:, None] + torch.arange(32))[:, None, None, :]
            images = padded[torch.arange(b)[:, None, None, None], torch.arange(3)[None, :, None, None], rows, cols]
            if flips is not None:
                images = torch.where(flips[:, None, None, None], images.flip(-1), images)
        out.append((images.to(torch.float32) * scale - shift, data.y_train[indices[first:stop]]))
    return out


SETTINGS = [{}, {"epoch": 3, "start": 2}, {"augment": False}, {"drop_last": True}, {"flip": False},
            {"rank": 0, "world_size": 2, "drop_last": True}, {"rank": 1, "world_size": 2, "drop_last": True}]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_batches_on_the_device_equal_the_batches_built_before(cifar, setting):
    """The device path (one gather per batch) and the DataLoader (workers or not) give exactly the batches the
    per-batch CPU pipeline gave before: the same images, crops, flips and normalised float32 values, bit for bit."""
    data = load_vision_data("cifar10", cifar)
    setting = dict(setting)
    if not setting.pop("flip", True):
        data = VisionData(**{**vars(data), "flip": False})
    expected = _batches_built_before(data, 16, 3, **setting)
    on_device = list(DeviceBatches(data).epoch(16, seed=3, **setting))
    loaded = [list(data.train_batches(16, seed=3, num_workers=w, **setting)) for w in (0, 2)]
    assert len(expected) == len(on_device) > 0
    for got in (on_device, *loaded):
        for (x, y), (x0, y0) in zip(got, expected, strict=True):
            assert x.dtype == torch.float32 and torch.equal(x, x0) and torch.equal(y, y0)


def test_building_batches_draws_nothing_from_the_global_random_state(cifar):
    """Each DataLoader iterator used to take its base seed from torch's global generator, so the iterator a resume
    opens mid-epoch shifted every later random number (resume was not exact on image data)."""
    data = load_vision_data("cifar10", cifar)
    state = torch.get_rng_state()
    list(data.train_batches(16, seed=3)), list(data.train_batches(16, seed=3, start=2))
    list(DeviceBatches(data).epoch(16, seed=3, start=1))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.cuda
def test_batches_built_on_a_gpu_equal_the_cpus(cifar):
    data = load_vision_data("cifar10", cifar)
    on_gpu = list(DeviceBatches(data, "cuda").epoch(16, seed=3, epoch=1))
    on_cpu = list(DeviceBatches(data, "cpu").epoch(16, seed=3, epoch=1))
    for (x, y), (x0, y0) in zip(on_gpu, on_cpu, strict=True):
        assert x.is_cuda and torch.equal(x.cpu(), x0) and torch.equal(y.cpu(), y0)
