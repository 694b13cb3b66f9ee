"""The BMA predictive: one-shot and streaming, against direct formulas and scipy, including huge logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import entr, log_softmax, logsumexp, softmax
from torch import Tensor

from pyro_flat.metrics import StreamingBMA, bma_log_probs, bma_probs, mutual_information, predictive_entropy

from .conftest import make_problem


def _reference_log_bma(logits):
    """log of the mean of softmaxes, by scipy in float64 (an implementation independent of torch)."""
    x = logits.double().numpy()
    return logsumexp(log_softmax(x, axis=-1), axis=0) - math.log(x.shape[0])


def test_bma_probs_is_the_mean_of_softmaxes(problem):
    logits, _ = problem
    probs = bma_probs(logits)
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1).mean(dim=0), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(logits.shape[1]))
    np.testing.assert_allclose(bma_log_probs(logits).numpy(), _reference_log_bma(logits), rtol=1e-12)


def test_bma_log_probs_stay_finite_for_huge_logits():
    logits = 1e3 * torch.randn(5, 20, 4)
    log_bma = bma_log_probs(logits)
    assert bool(torch.isfinite(log_bma).all())
    assert float(log_bma.min()) < -100  # log(mean(softmax)) would give -inf here
    np.testing.assert_allclose(log_bma.numpy(), _reference_log_bma(logits), rtol=1e-12)


def _stream(logits, group_sizes):
    acc = StreamingBMA()
    start = 0
    for size in group_sizes:
        chunk = logits[start : start + size]
        acc.update(chunk[0] if size == 1 else chunk)  # single samples as [N, C], groups as [s, N, C]
        start += size
    assert start == logits.shape[0]
    return acc


def test_streaming_equals_one_shot_after_many_updates():
    logits, _ = make_problem(num_samples=60, num_points=100)
    acc = _stream(logits, [1] * 20 + [3] * 5 + [7, 10, 1, 1, 1, 5])
    assert acc.num_samples == 60
    torch.testing.assert_close(acc.log_probs, bma_log_probs(logits), rtol=0, atol=1e-10)
    torch.testing.assert_close(acc.probs, bma_probs(logits), rtol=0, atol=1e-10)
    sample_probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(acc.predictive_entropy, predictive_entropy(bma_probs(logits)), rtol=0, atol=1e-10)
    expected_mean_entropy = predictive_entropy(sample_probs.reshape(-1, 10)).reshape(60, 100).mean(dim=0)
    torch.testing.assert_close(acc.mean_entropy, expected_mean_entropy, rtol=0, atol=1e-10)
    torch.testing.assert_close(acc.mutual_information, mutual_information(sample_probs), rtol=0, atol=1e-10)


def test_streaming_is_stable_for_logits_of_magnitude_1e3():
    logits = 1e3 * torch.randn(40, 30, 5)
    acc = _stream(logits, [1] * 40)
    assert bool(torch.isfinite(acc.log_probs).all()) and bool(torch.isfinite(acc.mutual_information).all())
    np.testing.assert_allclose(acc.log_probs.numpy(), _reference_log_bma(logits), rtol=1e-10)
    # invariant to adding a constant to each sample's logits of a point
    shifted = _stream(logits + 1e3 * torch.randn(40, 30, 1), [1] * 40)
    torch.testing.assert_close(shifted.log_probs, acc.log_probs, rtol=1e-10, atol=1e-9)
    # the per-sample entropies, by scipy
    expected = entr(softmax(logits.numpy(), axis=-1)).sum(axis=-1).mean(axis=0)
    np.testing.assert_allclose(acc.mean_entropy.numpy(), expected, rtol=1e-8, atol=1e-15)


def _state_numel(acc):
    return sum(v.numel() for v in vars(acc).values() if isinstance(v, Tensor))


def test_streaming_memory_does_not_grow_with_samples():
    logits = torch.randn(100, 7, 3)
    acc = StreamingBMA().update(logits[0])
    size = _state_numel(acc)
    for s in range(1, 100):
        acc.update(logits[s])
    assert _state_numel(acc) == size == 7 * 3 + 7 + 1  # log-sum [N, C], entropy sum [N], first non-finite update


def test_streaming_reset_dtype_and_detach():
    logits = torch.randn(4, 6, 3, requires_grad=True)
    acc = StreamingBMA().update(logits)
    assert not acc.log_probs.requires_grad
    acc.reset()
    assert acc.num_samples == 0
    acc.update(logits.detach().float())
    assert acc.probs.dtype == torch.float32 and acc.mutual_information.dtype == torch.float32
    with pytest.raises(ValueError, match="must be torch.float32 on cpu like the previous updates"):
        acc.update(logits.detach())


def test_streaming_validation_errors():
    acc = StreamingBMA()
    with pytest.raises(ValueError, match=r"StreamingBMA holds no samples yet: call update\(logits\) first"):
        _ = acc.probs
    with pytest.raises(ValueError, match=r"`logits` must have shape \[N, C\] or \[s, N, C\], got shape \(3,\)"):
        acc.update(torch.randn(3))
    acc.update(torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"`logits` must have shape \[N, C\] = \[5, 3\]"):
        acc.update(torch.randn(2, 4, 3))


def test_streaming_non_finite_logits_raise_when_read_naming_the_update():
    # update() records finiteness on the device (no host sync); reading the results raises
    acc = StreamingBMA().update(torch.randn(2, 3)).update(torch.tensor([[0.0, float("nan"), 1.0]] * 2))
    acc.update(torch.randn(2, 3))
    for read in ("log_probs", "probs", "mean_entropy", "mutual_information"):
        with pytest.raises(ValueError, match=r"`logits` must be finite: update 1 \(counted from 0\)"):
            getattr(acc, read)
    acc.reset()
    acc.update(torch.randn(2, 3))
    assert bool(torch.isfinite(acc.log_probs).all())


def test_bma_validation_errors():
    with pytest.raises(ValueError, match=r"`sample_logits` must have shape \[S, N, C\], got shape \(4, 3\)"):
        bma_probs(torch.randn(4, 3))
    with pytest.raises(ValueError, match="`sample_logits` must be finite"):
        bma_log_probs(torch.tensor([[[0.0, float("inf")]]]))
