"""The replay mechanism shared by the flat objectives: random stream, subsample sites, observations, BatchNorm,
blocking, and tensor substitution."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch import nn

from pyro_flat.infer.replay import RunRecorder, batchnorm_statistics_frozen, substituted_tensors


def dropout_model(x, y=None, subsample_size=None):
    """A latent, a subsampled plate and a dropout mask drawn from torch's global generator after both."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x), subsample_size=subsample_size) as idx:
        mask = torch.nn.functional.dropout(torch.ones(len(idx), dtype=x.dtype), p=0.5)
        pyro.sample("y", dist.Normal(w * x[idx] * mask, 1.0), obs=None if y is None else y[idx])
    return idx, mask


X = torch.linspace(-1.0, 1.0, 10, dtype=torch.float64)


def test_replay_redraws_the_same_indices_and_masks_and_the_stream_continues():
    pyro.set_rng_seed(0)
    with RunRecorder() as run:
        idx, mask = dropout_model(X, X, subsample_size=4)
    after = torch.rand(3)
    pyro.set_rng_seed(0)
    dropout_model(X, X, subsample_size=4)
    expected_after = torch.rand(3)
    pyro.set_rng_seed(0)
    with RunRecorder() as run:
        idx, mask = dropout_model(X, X, subsample_size=4)
    with run.replay(values={"w": torch.tensor(3.0, dtype=torch.float64)}):
        idx2, mask2 = dropout_model(X, X, subsample_size=4)
    assert torch.equal(idx, idx2) and torch.equal(mask, mask2)
    assert torch.equal(torch.rand(3), expected_after) and torch.equal(after, expected_after)


def test_a_value_given_in_the_replay_does_not_shift_the_stream():
    # the first run draws w from its prior; the replay gives w: the mask after it must still be the same
    pyro.set_rng_seed(1)
    with RunRecorder() as run:
        _, mask = dropout_model(X, X)
    with run.replay(values={"w": torch.tensor(0.0, dtype=torch.float64)}):
        _, mask2 = dropout_model(X, X)
    assert torch.equal(mask, mask2)


def test_observations_are_replayed_and_deterministic_records_recomputed():
    def model():
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        pyro.deterministic("twice_w", 2 * w)
        pyro.sample("y", dist.Normal(w, 1.0))

    conditioned = pyro.condition(model, {"y": torch.tensor(0.7)})
    with RunRecorder() as run:
        conditioned()
    w = torch.tensor(5.0)
    with poutine.trace() as tracer, run.replay(values={"w": w}, block=False):
        model()  # the outer condition is gone: the replay gives the observation
    nodes = tracer.trace.nodes
    assert nodes["y"]["is_observed"] and nodes["y"]["value"] == 0.7
    assert nodes["twice_w"]["value"] == 2 * w  # at the replayed value, not the first run's


def test_numbers_drawn_before_a_site_in_the_recorded_run_only_do_not_shift_the_replay():
    # issue 20 item 3: a fresh autoguide sets itself up on its first call (drawing from the prior, hidden from every
    # handler) before its first site; the replay runs the set-up guide and must still redraw the first run's value
    set_up = []

    def guide():
        if not set_up:
            set_up.append(torch.rand(7))  # the set-up's draws
        return pyro.sample("w", dist.Normal(0.0, 1.0))

    with RunRecorder() as run:
        w = guide()
    with run.replay():
        assert torch.equal(guide(), w)


def test_a_site_observed_inside_the_replay_keeps_the_replayed_runs_value():
    # issue 20 item 7: a closure conditions the model on values that move between the two runs (bSAM's closure on an
    # AutoDelta, model_loss_fn); only sites observed by handlers outside the replay (blocked there) get the recorded
    # value, a site observed inside it is observed again, at the new value
    def model():
        return pyro.sample("w", dist.Normal(0.0, 1.0))

    with RunRecorder() as run:
        pyro.condition(model, {"w": torch.tensor(0.5)})()
    with poutine.trace() as tracer, run.replay(block=False):
        pyro.condition(model, {"w": torch.tensor(2.0)})()
    assert tracer.trace.nodes["w"]["value"] == 2.0 and tracer.trace.nodes["w"]["is_observed"]


def test_the_replay_is_hidden_from_enclosing_handlers_unless_asked():
    with RunRecorder() as run:
        dropout_model(X, X)
    with poutine.trace() as outer, run.replay():
        dropout_model(X, X)
    assert not outer.trace.nodes
    with poutine.trace() as outer, run.replay(block=False):
        dropout_model(X, X)
    assert {"w", "y"} <= set(outer.trace.nodes)


def test_sites_of_the_same_name_are_matched_by_occurrence():
    # a guide and its model both have a site "data" (their plates): each occurrence replays its own value
    def guide_then_model():
        with pyro.plate("data", 10, subsample_size=3) as i:
            pass
        with pyro.plate("data", 10, subsample_size=5) as j:
            pass
        return i, j

    with RunRecorder() as run:
        first = guide_then_model()
    torch.rand(10)  # the stream moved on
    with run.replay():
        second = guide_then_model()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_replay_before_recording_is_an_error():
    with pytest.raises(ValueError, match="nothing was recorded"):
        with RunRecorder().replay():
            pass


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))

    def forward(self, x):
        return self.body(x)


def test_batchnorm_statistics_frozen_reaches_networks_inside_model_functions():
    # a network registered with pyro.module inside a function model: no reference to it is needed
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(8, 2)

    def model():
        pyro.module("net", net)
        return net(x)

    reference = model()  # one ordinary training-mode pass
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with batchnorm_statistics_frozen():
        frozen = model()
    torch.testing.assert_close(frozen, reference, atol=0, rtol=0)  # batch statistics, as in training mode
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())  # running stats and count untouched
    assert net.body[1].track_running_stats
    net.eval()
    with batchnorm_statistics_frozen():
        evaluated = model()
    torch.testing.assert_close(evaluated, net(x), atol=0, rtol=0)  # eval mode: the running statistics


def test_batchnorm_flag_is_restored_when_the_forward_raises():
    bn = nn.BatchNorm1d(3)
    with pytest.raises(RuntimeError), batchnorm_statistics_frozen():
        bn(torch.randn(4, 5))  # wrong number of features
    assert bn.track_running_stats


def test_substituted_tensors_reach_every_way_a_guide_reads_its_parameters():
    net = nn.Linear(2, 1)
    module = pyro.nn.PyroModule[nn.Linear](2, 1)

    def guide(x):
        a = pyro.param("a", torch.tensor(0.5), constraint=dist.constraints.positive)
        b = pyro.param("b", torch.tensor([1.0, 2.0]))
        pyro.module("net", net)
        return a * b.sum() + net(x).sum() + module(x).sum()

    x = torch.ones(3, 2)
    base = guide(x)
    leaves = [pyro.param("a").unconstrained(), pyro.param("b").unconstrained(), net.weight, module.weight]
    shifted = [(leaf, leaf + 1.0) for leaf in leaves]
    with substituted_tensors(shifted):
        moved = guide(x)
        assert net.weight.requires_grad and net.weight.shape == (1, 2)  # attribute reads are the original's
    with torch.no_grad():
        a = torch.exp(pyro.param("a").unconstrained() + 1.0)  # the param store's positive constraint: exp
        expected = (a * (pyro.param("b") + 1.0).sum() + (x @ (net.weight + 1.0).T + net.bias).sum()
                    + (x @ (module.weight + 1.0).T + module.bias).sum())
    torch.testing.assert_close(moved, expected)
    assert not torch.allclose(moved, base)
    moved.backward()
    assert all(leaf.grad is not None for leaf in leaves)  # gradients reach the originals through the replacements
