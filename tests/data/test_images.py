"""Image data at scale: the augmentation against torchvision's, loaders that do not depend on workers, mid-epoch
resume, data-parallel shards, normalisation, and the synthetic CIFAR folders."""

from __future__ import annotations

import pytest
import torch

from pyro_flat.data import VisionData, load_vision_data, load_vision_dataset, write_synthetic_cifar
from pyro_flat.data.images import EpochBatches, ImageBatches, augment

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
