"""bayesian_transfer and replace_head: which parameters become latent, their priors, the new head, errors."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro import poutine
from torch import nn

from pyro_flat.infer import latent_sites
from pyro_flat.nn import BayesianClassifier, bayesian_transfer, replace_head, unpacked_sites


def _pretrained(norm="group"):
    norm_layer = nn.GroupNorm(2, 4) if norm == "group" else nn.BatchNorm2d(4)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), norm_layer, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(4, 5))
    with torch.no_grad():  # "pretrained": non-default affine values
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net


def test_norm_and_head_are_latent_with_their_priors_and_the_rest_is_frozen():
    net = _pretrained()
    model = bayesian_transfer(net, 3, prior_scale=0.1, head_prior_scale=2.0, packed=False)  # packed: test_packed.py
    assert isinstance(model, BayesianClassifier) and model.num_classes == 3
    x = torch.randn(6, 1, 8, 8)
    trace = poutine.trace(model).get_trace(x, torch.zeros(6, dtype=torch.long))
    latents = latent_sites(trace)
    assert set(latents) == {"net.1.weight", "net.1.bias", "net.5.weight", "net.5.bias"}
    assert latents["net.5.weight"].shape == (3, 4)  # the head was replaced for 3 classes
    prior = trace.nodes["net.1.weight"]["fn"].base_dist
    assert torch.allclose(prior.loc, net[1].weight) and torch.allclose(prior.scale, torch.full((4,), 0.1))
    head_prior = trace.nodes["net.5.weight"]["fn"].base_dist
    assert torch.equal(head_prior.loc, torch.zeros(3, 4)) and torch.allclose(head_prior.scale, torch.full((3, 4), 2.0))
    assert list(model.parameters()) == []  # the conv layer is frozen: buffers only, nothing for an optimiser
    assert torch.equal(model.net[0].weight, net[0].weight)
    assert isinstance(net[0].weight, nn.Parameter) and net[5].out_features == 5  # copy=True left `net` untouched


def test_kept_head_is_centred_at_its_pretrained_values_and_rest_can_be_learned():
    net = _pretrained(norm="batch")
    model = bayesian_transfer(net, 5, prior_scale=0.5, new_head=False, rest="learned", copy=False, packed=False)
    assert model.net is net
    trace = poutine.trace(model).get_trace(torch.randn(4, 1, 8, 8))
    head_prior = trace.nodes["net.5.weight"]["fn"].base_dist
    assert torch.allclose(head_prior.loc, model.net[5]._init_weight)
    assert {name for name, _ in model.named_parameters()} == {"net.0.weight", "net.0.bias"}
    with pyro.plate("check", 1):
        assert trace.nodes["logits"]["value"].shape == (4, 5)


def test_torchvision_resnet_norm_layers_and_fc():
    torchvision = pytest.importorskip("torchvision")
    net = torchvision.models.resnet18(weights=None, num_classes=7)
    model = bayesian_transfer(net, 4, prior_scale=0.1)  # packed, the default: one site, relabelled per tensor
    trace = poutine.trace(model).get_trace(torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long))
    assert list(latent_sites(trace)) == ["net.weights"]
    names = set(unpacked_sites(model)["net.weights"])
    assert {"net.fc.weight", "net.fc.bias", "net.bn1.weight", "net.layer1.0.bn2.bias"} <= names
    assert all(".bn" in n or "downsample.1" in n or n.startswith("net.fc") for n in names)
    assert trace.nodes["logits"]["value"].shape == (2, 4)


def test_same_number_of_classes_still_gets_a_new_head():
    net = _pretrained()
    model = bayesian_transfer(net, 5, packed=False)  # new classes, same count: a fresh head with the zero-mean prior
    trace = poutine.trace(model).get_trace(torch.randn(2, 1, 8, 8), torch.zeros(2, dtype=torch.long))
    assert torch.equal(trace.nodes["net.5.weight"]["fn"].base_dist.loc, torch.zeros(5, 4))
    assert not torch.equal(model.net[5]._init_weight, net[5].weight)


def test_replace_head_and_errors():
    net = _pretrained()
    old = net[5]
    new = replace_head(net, 2)
    assert net[5] is new and new is not old and new.out_features == 2 and new.in_features == 4
    with pytest.raises(ValueError, match="new_head=False keeps the pretrained head '5', which must have"):
        bayesian_transfer(net, 3, new_head=False, copy=False)
    assert net[5] is new
    with pytest.raises(ValueError, match="`num_classes` must be an int >= 2"):
        replace_head(net, 1)
    with pytest.raises(ValueError, match="'nope' is not a module"):
        replace_head(net, 3, head="nope")
    with pytest.raises(ValueError, match="must be an nn.Linear"):
        replace_head(net, 3, head="1")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        bayesian_transfer("net", 3)
    with pytest.raises(ValueError, match="`head_prior_scale`"):
        bayesian_transfer(_pretrained(), 3, head_prior_scale=0.0)


def test_frozen_weights_resampled_from_a_source_swag_posterior():
    from pyro_flat.infer.autoguide import SWAGCollector
    from pyro_flat.nn import SWAGFrozenSampler

    net = _pretrained(norm="batch")
    model = bayesian_transfer(net, 3, prior_scale=0.1)
    collector = SWAGCollector(max_rank=4, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):  # iterates of the whole source network (site names as a Pyro model of it would have)
        collector.collect({f"net.{k}": v + 0.1 * torch.randn(v.shape, generator=generator, dtype=v.dtype)
                           for k, v in net.named_parameters()})
    sampler = SWAGFrozenSampler.from_swag(model, collector, scale=0.5)
    assert set(sampler.targets) == {"0.weight", "0.bias"}  # only the frozen block: the conv layer
    # 4000 draws of the 40 frozen numbers: mean and variance of SWAG's marginal, within 5 standard errors
    draws = []
    for _ in range(4000):
        sampler.resample()
        draws.append(torch.cat([model.net[0].weight.reshape(-1), model.net[0].bias]).clone())
    draws = torch.stack(draws)
    mean = torch.cat([collector.mean()["net.0.weight"].reshape(-1), collector.mean()["net.0.bias"]])
    assert list(collector.sites)[:2] == ["net.0.weight", "net.0.bias"]  # the first rows of the flat moments
    d = collector.deviation_matrix()[: mean.numel()]
    variance = 0.5 * (torch.cat([collector.variance()[k].reshape(-1) for k in ("net.0.weight", "net.0.bias")])
                      + d.square().sum(-1) / (collector.rank - 1))
    se = (variance / 4000).sqrt()
    assert ((draws.mean(0) - mean).abs() < 5 * se).all()
    assert ((draws.var(0) / variance - 1).abs() < 5 * (2 / 4000) ** 0.5).all()
    # a new draw before each training forward pass with gradients, none in evaluation or without gradients
    x = torch.randn(2, 1, 8, 8)
    before = model.net[0].weight.clone()
    with torch.no_grad():
        model.net(x)
    assert torch.equal(model.net[0].weight, before)
    model.net(x)
    assert not torch.equal(model.net[0].weight, before)
    sampler.remove()
    after = model.net[0].weight.clone()
    model.net(x)
    assert torch.equal(model.net[0].weight, after)
    with pytest.raises(ValueError, match="not frozen weights"):
        SWAGFrozenSampler(model, {"1.weight": torch.ones(4)}, {"1.weight": torch.ones(4)})
