"""pyro_flat.ops.moments: running moments, the deviation ring buffer and the SWAG sample formula."""

import pytest
import torch

from pyro_flat.ops.moments import (
    DeviationBuffer,
    diagonal_variance,
    low_rank_gaussian_sample,
    update_running_mean,
    update_running_moments,
)


def test_running_moments_equal_batch_moments():
    values = torch.randn(7, 5)
    mean, sq = torch.zeros(5), torch.zeros(5)
    for n, v in enumerate(values):
        update_running_moments(mean, sq, v, n)
        torch.testing.assert_close(mean, values[: n + 1].mean(0))
        torch.testing.assert_close(sq, values[: n + 1].square().mean(0))
    torch.testing.assert_close(diagonal_variance(mean, sq), values.var(0, unbiased=False))


def test_running_moments_overwrite_whatever_the_buffers_held_before_the_first_value():
    mean, sq = torch.full((2,), float("nan")), torch.full((2,), float("inf"))
    update_running_moments(mean, sq, torch.tensor([2.0, -3.0]), 0)
    assert torch.equal(mean, torch.tensor([2.0, -3.0])) and torch.equal(sq, torch.tensor([4.0, 9.0]))


def test_running_mean_first_value_is_exact_and_bad_count_fails():
    mean = torch.full((3,), 123.0)
    update_running_mean(mean, torch.tensor([1.0, 2.0, 3.0]), 0)
    assert torch.equal(mean, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="num_before"):
        update_running_mean(mean, mean, -1)


def test_diagonal_variance_is_clamped():
    mean = torch.tensor([1.0, 2.0])
    var = diagonal_variance(mean, mean.square() - torch.tensor([0.0, 1e-3]), clamp=1e-30)
    assert torch.equal(var, torch.tensor([1e-30, 1e-30]))


@pytest.mark.parametrize("max_rank", [1, 3, 10])
def test_deviation_buffer_keeps_the_last_columns_in_order(max_rank):
    columns = torch.randn(7, 4)
    buffer = DeviationBuffer(max_rank, 4, dtype=columns.dtype, device="cpu")
    for n, c in enumerate(columns):
        buffer.append(c)
        k = min(n + 1, max_rank)
        assert buffer.rank == k
        torch.testing.assert_close(buffer.matrix(), columns[n + 1 - k : n + 1].T)


def test_deviation_buffer_stores_a_difference_in_place():
    value, mean = torch.randn(4), torch.randn(4)
    buffer = DeviationBuffer(2, 4, dtype=value.dtype, device="cpu")
    rows = buffer.rows.data_ptr()
    buffer.append(value, minus=mean)
    assert buffer.rows.data_ptr() == rows
    torch.testing.assert_close(buffer.matrix()[:, 0], value - mean)


def test_deviation_buffer_rejects_bad_rank():
    with pytest.raises(ValueError, match="max_rank"):
        DeviationBuffer(0, 3, dtype=torch.float64, device="cpu")


def test_low_rank_sample_formula():
    mean, var = torch.randn(6), torch.rand(6) + 0.1
    dev = torch.randn(6, 3)
    z1, z2 = torch.randn(2, 6), torch.randn(2, 3)
    out = low_rank_gaussian_sample(mean, var, dev, 0.5, z1, z2)
    expected = mean + 0.5**0.5 * (var.sqrt() * z1 + (dev @ z2.T).T / 2**0.5)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(low_rank_gaussian_sample(mean, var, None, 2.0, z1), mean + 2**0.5 * var.sqrt() * z1)
    with pytest.raises(ValueError, match="K >= 2"):
        low_rank_gaussian_sample(mean, var, dev[:, :1], 0.5, z1, z2[:, :1])
