from __future__ import annotations

import pytest
import torch

from pyro_flat.data import ClassificationData, RegressionData


def make_data(num_train: int = 20, num_test: int = 7, classes: int = 3, **overrides) -> ClassificationData:
    """Row ``i`` of x_train is ``[i, i, i]``, so batches can be traced back to their rows."""
    fields = {
        "name": "toy",
        "x_train": torch.arange(num_train, dtype=torch.float64)[:, None].expand(num_train, 3).clone(),
        "y_train": torch.arange(num_train) % classes,
        "x_test": torch.randn(num_test, 3),
        "y_test": torch.arange(num_test) % classes,
        "num_classes": classes,
        "x_ood": torch.randn(5, 3),
    }
    fields.update(overrides)
    return ClassificationData(**fields)


def rows(x: torch.Tensor) -> list[int]:
    return x[:, 0].long().tolist()


def test_properties():
    data = make_data()
    assert data.num_data == 20
    assert data.input_shape == torch.Size([3])
    assert data.device == torch.device("cpu")
    assert data.dtype == torch.float64


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"y_train": torch.zeros(19, dtype=torch.int64)}, "x_train has 20 rows but y_train has 19"),
        ({"y_test": torch.zeros(7, dtype=torch.int32)}, "y_test to be a 1-D int64"),
        ({"y_train": torch.zeros(20)}, "y_train to be a 1-D int64"),
        ({"y_train": torch.full((20,), 3)}, r"y_train has labels in \[3, 3\].*num_classes=3"),
        ({"y_test": torch.full((7,), -1)}, r"y_test has labels in \[-1, -1\]"),
        ({"x_test": torch.tensor([[0.0, float("nan"), 0.0]] * 7)}, "x_test contains NaN or Inf"),
        ({"x_ood": torch.tensor([[float("inf"), 0.0, 0.0]])}, "x_ood contains NaN or Inf"),
        ({"x_ood": torch.randn(5, 4)}, r"x_ood has feature shape \(4,\), expected x_train's \(3,\)"),
        ({"x_test": torch.randn(7, 2)}, r"x_test has feature shape \(2,\)"),
        ({"x_train": torch.arange(20)[:, None].expand(20, 3)}, "x_train to be a floating-point tensor"),
        ({"x_train": torch.randn(20)}, r"x_train of shape \[n, \*features\]"),
        ({"x_test": torch.randn(7, 3, dtype=torch.float32)}, "share one dtype"),
        ({"num_classes": 0}, "`num_classes` must be an int >= 1"),
    ],
)
def test_validation_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_data(**overrides)


def test_to_casts_inputs_and_keeps_int64_labels():
    data = make_data().to(dtype=torch.float32)
    assert data.x_train.dtype == data.x_test.dtype == data.x_ood.dtype == torch.float32
    assert data.y_train.dtype == data.y_test.dtype == torch.int64
    assert data.dtype == torch.float32
    assert data.to(device="cpu").dtype == torch.float32  # None keeps the current dtype
    with pytest.raises(ValueError, match="floating torch.dtype"):
        make_data().to(dtype=torch.int64)


def test_train_loader_visits_every_row_once_per_epoch():
    data = make_data()
    loader = data.train_loader(6)
    assert len(loader) == 4
    batches = list(loader)
    assert [len(x) for x, _ in batches] == [6, 6, 6, 2]
    seen = sum((rows(x) for x, _ in batches), [])
    assert sorted(seen) == list(range(20))
    assert seen != list(range(20))  # shuffled
    for x, y in batches:  # labels travel with their rows
        assert torch.equal(y, data.y_train[x[:, 0].long()])
        assert y.dtype == torch.int64 and x.dtype == torch.float64


def test_train_loader_seed_determinism_and_epochs():
    data = make_data()
    order = lambda loader: sum((rows(x) for x, _ in loader), [])  # noqa: E731
    assert order(data.train_loader(5, seed=3)) == order(data.train_loader(5, seed=3))
    assert order(data.train_loader(5, seed=3)) != order(data.train_loader(5, seed=4))
    loader = data.train_loader(5, seed=3)
    assert order(loader) != order(loader)  # a new permutation every epoch


def test_loaders_never_draw_from_the_global_random_state():
    # a DataLoader without a generator of its own seeds each iterator from torch's global generator, which shifts
    # every random number the training draws after it (and breaks exact resume)
    data = make_data()
    state = torch.get_rng_state()
    for loader in (data.train_loader(6), data.train_loader(6, shuffle=False), data.test_loader(6)):
        list(loader), list(loader)
    assert torch.equal(torch.get_rng_state(), state)


def test_train_loader_drop_last_and_no_shuffle():
    data = make_data()
    assert [len(x) for x, _ in data.train_loader(6, drop_last=True)] == [6, 6, 6]
    assert sum((rows(x) for x, _ in data.train_loader(6, shuffle=False)), []) == list(range(20))


def test_test_loader_in_order_with_last_batch():
    data = make_data()
    batches = list(data.test_loader(3))
    assert [len(x) for x, _ in batches] == [3, 3, 1]
    assert torch.equal(torch.cat([x for x, _ in batches]), data.x_test)
    with pytest.raises(ValueError, match="`batch_size` must be an int >= 1"):
        data.test_loader(0)
    with pytest.raises(ValueError, match="`batch_size` must be an int >= 1"):
        data.train_loader(2.5)


def test_subset_classes_relabels_in_given_order():
    data = make_data()
    sub = data.subset(classes=[2, 0])
    assert sub.num_classes == 2
    assert sub.num_data == 13  # rows 0, 3, ..., 18 (class 0) and 2, 5, ..., 17 (class 2)
    original = data.y_train[sub.x_train[:, 0].long()]
    assert torch.equal(sub.y_train, torch.where(original == 2, 0, 1))
    assert sub.y_test.tolist() == [{2: 0, 0: 1}[y] for y in data.y_test.tolist() if y in (0, 2)]
    assert sub.x_ood is data.x_ood


def test_subset_num_train_is_seeded():
    data = make_data()
    a, b, c = data.subset(num_train=8, seed=1), data.subset(num_train=8, seed=1), data.subset(num_train=8, seed=2)
    assert a.num_data == 8 and len(set(rows(a.x_train))) == 8
    assert rows(a.x_train) == sorted(rows(a.x_train))  # original order kept
    assert rows(a.x_train) == rows(b.x_train) != rows(c.x_train)
    assert torch.equal(a.y_train, data.y_train[a.x_train[:, 0].long()])
    assert torch.equal(a.x_test, data.x_test)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"classes": [1, 1]}, "distinct labels"),
        ({"classes": [3]}, r"labels in \[0, 3\)"),
        ({"classes": []}, "non-empty"),
        ({"num_train": 21}, "num_train <= 20"),
        ({"num_train": 0}, "`num_train` must be an int >= 1"),
    ],
)
def test_subset_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_data().subset(**kwargs)


def test_few_shot():
    data = make_data(num_train=30)
    shots = data.few_shot(4, seed=5)
    assert torch.equal(torch.bincount(shots.y_train, minlength=3), torch.tensor([4, 4, 4]))
    assert torch.equal(shots.y_train, data.y_train[shots.x_train[:, 0].long()])
    assert torch.equal(shots.x_test, data.x_test) and torch.equal(shots.y_test, data.y_test)
    assert rows(data.few_shot(4, seed=5).x_train) == rows(shots.x_train)
    assert rows(data.few_shot(4, seed=6).x_train) != rows(shots.x_train)
    with pytest.raises(ValueError, match="class 0 has 10 training examples, expected at least shots_per_class=11"):
        data.few_shot(11)


def make_regression(**overrides) -> RegressionData:
    fields = {
        "name": "reg",
        "x_train": torch.arange(10.0)[:, None],
        "y_train": torch.arange(10.0) * 2,
        "x_test": torch.randn(4, 1),
        "y_test": torch.randn(4),
    }
    fields.update(overrides)
    return RegressionData(**fields)


def test_regression_data():
    data = make_regression()
    assert data.num_data == 10 and data.input_shape == torch.Size([1])
    small = data.to(dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in (small.x_train, small.y_train, small.x_test, small.y_test))
    batches = list(data.train_loader(4, seed=0))
    assert [len(x) for x, _ in batches] == [4, 4, 2]
    for x, y in batches:
        assert torch.equal(y, 2 * x[:, 0])
    assert torch.equal(torch.cat([y for _, y in data.test_loader(3)]), data.y_test)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"y_train": torch.arange(9.0)}, "x_train has 10 rows but y_train has 9"),
        ({"y_test": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, "y_test contains NaN or Inf"),
        ({"y_train": torch.arange(10)}, "y_train to be a floating tensor"),
        ({"x_test": torch.randn(4, 2)}, r"x_test has feature shape \(2,\)"),
        ({"y_test": torch.randn(4, 2)}, r"y_test has target shape \(2,\)"),
    ],
)
def test_regression_validation_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_regression(**overrides)
