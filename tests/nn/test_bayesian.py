"""make_bayesian on the networks users bring: a tied weight is one latent with one prior, seen by every module that
holds it (per tensor and packed); what it refuses, it refuses by name. (Each layer kind against its hand-written log
joint: tests/conformance/test_networks.py.)"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoNormal
from torch import nn
from torch.distributions import Normal
from torch.func import functional_call

from pyro_flat.nn import init_to_network, latent_init_values, make_bayesian, unpacked_sites


class TiedLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.decode = nn.Linear(3, 5)
        self.decode.weight = self.embed.weight

    def forward(self, tokens):
        return self.decode(self.embed(tokens).mean(1))


def _shared():
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), second)


def _reused():
    layer = nn.Linear(3, 3)
    return nn.Sequential(layer, nn.Tanh(), layer)


TIED = {
    "decoder.weight = embedding.weight": (TiedLanguageModel, lambda: torch.randint(0, 5, (4, 6))),
    "one Parameter in two Linear": (_shared, lambda: torch.randn(4, 3)),
    "one Linear used twice": (_reused, lambda: torch.randn(4, 3)),
}


def _latent(trace):
    return {n: s for n, s in trace.nodes.items() if s["type"] == "sample" and not s["is_observed"]}


@pytest.mark.parametrize("packed", [False, True], ids=["per tensor", "packed"])
@pytest.mark.parametrize("kind", list(TIED))
def test_a_tied_weight_is_one_latent_with_one_prior_seen_by_every_holder(kind, packed):
    build, inputs = TIED[kind]
    plain = build()
    x = inputs()
    model = make_bayesian(copy.deepcopy(plain), prior_scale=0.5, packed=packed)
    trace = poutine.trace(model).get_trace(x)
    trace.compute_log_prob()
    latent = _latent(trace)
    tensors = dict(plain.named_parameters())  # each tensor once
    assert sum(s["value"].numel() for s in latent.values()) == sum(p.numel() for p in tensors.values())
    # the values each tensor got, and the network's output computed with them by torch (which ties the holders)
    layout = next(iter(unpacked_sites(model).values())) if packed else {n: s["value"].shape for n, s in latent.items()}
    values = torch.cat([s["value"].reshape(-1) for s in latent.values()]).split([s.numel() for s in layout.values()])
    theta = dict(zip(tensors, (v.reshape(p.shape) for v, p in zip(values, tensors.values(), strict=True)),
                     strict=True))
    prior = sum(Normal(0.0, 0.5).log_prob(v).sum() for v in theta.values())
    torch.testing.assert_close(sum(s["log_prob_sum"] for s in latent.values()), prior)  # counted once
    torch.testing.assert_close(trace.nodes["_RETURN"]["value"], functional_call(plain, theta, (x,)))


def test_a_tied_weight_keeps_one_site_name_and_its_initial_values_start_the_guide():
    model = make_bayesian(_shared(), packed=False)
    x = torch.randn(4, 3)
    assert list(_latent(poutine.trace(model).get_trace(x))) == ["0.weight", "0.bias", "2.bias"]
    reused = make_bayesian(_reused(), packed=False)  # Pyro names a module used twice after its last place
    assert list(_latent(poutine.trace(reused).get_trace(x))) == list(latent_init_values(reused)) == [
        "2.weight", "2.bias"]
    guide = AutoNormal(reused, init_loc_fn=init_to_network(reused))
    guide(x)
    torch.testing.assert_close(guide.median()["2.weight"], latent_init_values(reused)["2.weight"])


def test_a_tied_tensor_is_random_if_any_of_its_names_is_and_stays_one_tensor_otherwise():
    model = make_bayesian(_shared(), random={"2.weight"}, packed=False)  # the second holder's name
    assert list(_latent(poutine.trace(model).get_trace(torch.randn(4, 3)))) == ["0.weight"]
    frozen = make_bayesian(_shared(), random={"2.bias"})
    assert "weight" in dict(frozen[0].named_buffers()) and frozen[0].weight is frozen[2].weight
    learned = make_bayesian(_shared(), random={"2.bias"}, rest="learned")
    assert isinstance(learned[0].weight, nn.Parameter) and learned[0].weight is learned[2].weight


def test_applied_twice_it_says_already_bayesian():
    net = make_bayesian(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)), packed=False)
    with pytest.raises(ValueError, match=r"already Bayesian: make_bayesian has made its latent sites \['0.weight'"):
        make_bayesian(net)
    with pytest.raises(ValueError, match=r"already Bayesian: make_bayesian has made its latent sites \['weights'\]"):
        make_bayesian(make_bayesian(nn.Linear(2, 2)), rest="learned")  # packed, the default
    with pytest.raises(ValueError, match="already Bayesian"):  # inside a plain module
        make_bayesian(nn.Sequential(make_bayesian(nn.Linear(2, 2), packed=False), nn.Linear(2, 2)))


def test_an_embedding_that_renormalises_its_weight_is_refused_by_name():
    net = nn.Sequential(nn.Embedding(5, 3, max_norm=1.0), nn.Flatten(), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"'0.weight' of an Embedding with max_norm=1.0, which renormalises"):
        make_bayesian(net)
    assert isinstance(net[0].weight, nn.Parameter)  # refused before any change
    make_bayesian(net, random="head")  # its weight frozen: the renormalisation changes a buffer, as in torch


@pytest.mark.parametrize("packed", [False, True], ids=["per tensor", "packed"])
def test_a_tied_network_copies_and_pickles_with_its_tie(packed):
    model = make_bayesian(TiedLanguageModel(), packed=packed)
    x = torch.randint(0, 5, (2, 4))
    values = latent_init_values(model)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with poutine.condition(data=values):
            torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
        assert "weight" not in other.decode.__dict__  # the tied value is dropped after the call
