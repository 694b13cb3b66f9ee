"""Packed Bayesian networks (``make_bayesian``'s default / ``pack_latents``): one sample site holding every latent
weight, with the same prior, loss and gradients as the per-tensor form (``packed=False``; exact in float64, given the
same noise)."""

import copy
import io
import pickle

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoDelta, AutoNormal
from pyro.nn.module import to_pyro_module_
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_flat.infer import (
    HWA,
    EntropyMCMC,
    KLBallELBO,
    SharpnessAwareELBO,
    SharpnessAwareMeanFieldELBO,
    SWAGCollector,
    TensorSVI,
    TensorTrace_ELBO,
    guide_draws,
)
from pyro_flat.infer.mcmc import SGLD
from pyro_flat.nn import (
    BayesianClassifier,
    BayesianCNN,
    BayesianMLP,
    BayesianRegressionMLP,
    bayesian_transfer,
    init_to_network,
    is_packed,
    latent_init_values,
    make_bayesian,
    pack_latents,
    resnet18,
    unpacked_sites,
)


class FixedNoise(TorchDispatchMode):
    """Serves the given standard-normal draws, in turn and cyclically, to every ``normal_`` of the block (a replayed
    pass asks for the same draws again), so that a per-tensor and a packed guide draw the same numbers."""

    def __init__(self, noises):
        super().__init__()
        self.noises, self.calls = list(noises), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.normal_.default:
            noise = self.noises[self.calls % len(self.noises)]
            self.calls += 1
            assert noise.numel() == args[0].numel(), (tuple(noise.shape), tuple(args[0].shape))
            return args[0].copy_(noise.reshape(args[0].shape))
        return func(*args, **(kwargs or {}))


def pair(dropout=0.0):
    """The same MLP twice, per tensor and packed, and data."""
    torch.manual_seed(1)
    per_tensor = BayesianMLP(5, 3, hidden=(8, 6), dropout=dropout, packed=False)
    packed = copy.deepcopy(per_tensor)
    pack_latents(packed.net)
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    return per_tensor, packed, x, y


def latent_names(model, x, y):
    trace = poutine.trace(model).get_trace(x, y)
    return [n for n, s in trace.nodes.items() if s["type"] == "sample" and not s["is_observed"] and n != "data"]


def test_one_site_with_the_prior_and_initial_values_of_the_tensors():
    per_tensor, packed, x, y = pair()
    names = latent_names(per_tensor, x, y)
    assert latent_names(packed, x, y) == ["net.weights"] and is_packed(packed) and not is_packed(per_tensor)
    inits = latent_init_values(per_tensor)
    flat = torch.cat([inits[n].reshape(-1) for n in names])
    torch.testing.assert_close(latent_init_values(packed)["net.weights"], flat, rtol=0, atol=0)
    # the prior density of the packed site at the concatenated values is the sum of the per-tensor ones
    values = {n: torch.randn_like(inits[n]) for n in names}
    packed_value = torch.cat([values[n].reshape(-1) for n in names])
    with poutine.trace() as t1, poutine.condition(data=values):
        per_tensor(x, y)
    with poutine.trace() as t2, poutine.condition(data={"net.weights": packed_value}):
        packed(x, y)
    t1.trace.compute_log_prob()
    t2.trace.compute_log_prob()
    torch.testing.assert_close(sum(t1.trace.nodes[n]["log_prob_sum"] for n in names),
                               t2.trace.nodes["net.weights"]["log_prob_sum"], rtol=1e-14, atol=0)
    # the likelihood too: the network computes with the views of the packed value
    torch.testing.assert_close(t1.trace.nodes["obs"]["log_prob_sum"], t2.trace.nodes["obs"]["log_prob_sum"])
    assert packed.net._prior_loc_weights.shape == () and packed.net._prior_scale_weights.shape == ()


def _loss_and_grads(elbo, model, guide, x, y, noises):
    pyro.set_rng_seed(3)
    with FixedNoise(noises), poutine.trace(param_only=True) as tr:
        loss = elbo.loss_and_grads(model, guide, x, y, subsample_size=8)
    grads = {name: site["value"].unconstrained().grad.clone() for name, site in tr.trace.nodes.items()}
    for site in tr.trace.nodes.values():
        site["value"].unconstrained().grad = None
    return loss, grads


OBJECTIVES = {
    "TensorTrace_ELBO": (TensorTrace_ELBO, AutoNormal),
    "SharpnessAwareELBO": (lambda: SharpnessAwareELBO(0.1), AutoNormal),
    "SharpnessAwareMeanFieldELBO": (lambda: SharpnessAwareMeanFieldELBO(0.1), AutoNormal),
    "SharpnessAwareELBO-AutoDelta (SAM)": (lambda: SharpnessAwareELBO(0.1), AutoDelta),
    "KLBallELBO-fisher": (lambda: KLBallELBO(0.05), AutoNormal),
    "KLBallELBO-score": (lambda: KLBallELBO(0.05, direction="normalized_score"), AutoNormal),
}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_same_loss_and_gradients_as_the_per_tensor_network(name):
    make, guide_class = OBJECTIVES[name]
    per_tensor, packed, x, y = pair(dropout=0.2)  # dropout masks drawn alike in both (bernoulli, not normal)
    names = latent_names(per_tensor, x, y)
    results = []
    for model, split in ((per_tensor, True), (packed, False)):
        pyro.clear_param_store()
        options = {} if guide_class is AutoDelta else {"init_scale": 0.05}
        guide = guide_class(model, init_loc_fn=init_to_network(model), **options)
        guide(x, y, subsample_size=8)
        sizes = [latent_init_values(per_tensor)[n].numel() for n in names]
        eps = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(5))
        results.append(_loss_and_grads(make(), model, guide, x, y, list(eps.split(sizes)) if split else [eps]))
    (loss, grads), (packed_loss, packed_grads) = results
    assert loss == pytest.approx(packed_loss, rel=1e-13)
    prefix = {AutoNormal: ["AutoNormal.locs.", "AutoNormal.scales."], AutoDelta: ["AutoDelta."]}[guide_class]
    for p in prefix:
        per_tensor_flat = torch.cat([grads[p + n].reshape(-1) for n in names])
        torch.testing.assert_close(packed_grads[p + "net.weights"], per_tensor_flat, rtol=1e-12, atol=1e-12)


def test_sgld_potential_and_gradient_equal_the_per_tensor_ones():
    per_tensor, packed, x, y = pair()
    names = latent_names(per_tensor, x, y)
    values = {n: torch.randn_like(latent_init_values(per_tensor)[n]) for n in names}
    potentials = []
    for model, params in ((per_tensor, values), (packed, {"net.weights": torch.cat([values[n].reshape(-1)
                                                                                    for n in names])})):
        kernel = SGLD(model, step_size=1e-4)
        kernel.setup(0, x, y)
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        potential = kernel.potential_fn(leaves)
        grads = torch.autograd.grad(potential, list(leaves.values()))
        potentials.append((potential, torch.cat([g.reshape(-1) for g in grads])))
    torch.testing.assert_close(potentials[0][0], potentials[1][0], rtol=1e-13, atol=0)
    torch.testing.assert_close(potentials[0][1], potentials[1][1], rtol=1e-12, atol=1e-12)


def test_packed_is_the_default_and_per_tensor_sites_an_option():
    x, y = torch.randn(2, 1, 8, 8), torch.tensor([0, 2])
    def linear(classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(64, classes))

    for build in (lambda **kw: BayesianClassifier(make_bayesian(linear(3), **kw), 3),
                  lambda **kw: BayesianMLP(64, 3, hidden=(4,), **kw),
                  lambda **kw: BayesianCNN((1, 8, 8), 3, channels=(2,), **kw),
                  lambda **kw: bayesian_transfer(linear(5), 3, **kw)):
        packed, per_tensor = build(), build(packed=False)
        assert is_packed(packed) and latent_names(packed, x, y) == ["net.weights"]
        assert not is_packed(per_tensor) and "net.weights" not in latent_names(per_tensor, x, y)
        layout = unpacked_sites(packed)["net.weights"]
        assert list(layout) == latent_names(per_tensor, x, y)
    assert is_packed(BayesianRegressionMLP(1, hidden=(4,)))
    assert not is_packed(BayesianRegressionMLP(1, hidden=(4,), packed=False))


def test_a_packed_network_prints():
    # print(model) between calls, where the packed weights have no value: torch's extra_repr reads `self.bias`
    for model in (BayesianMLP(4, 3, hidden=(6,)), BayesianCNN((1, 8, 8), 3, channels=(2,))):
        assert is_packed(model)
        text = repr(model)
        assert "bias=True" in text and "bias" not in model.net[1].__dict__  # and no value outlives the print


def test_inference_on_a_packed_resnet_with_batchnorm():
    # SA-ELBO (BatchNorm statistics frozen in the perturbed pass), Predictive, SWAG, HWA, Entropy-MCMC, TensorSVI
    torch.manual_seed(0)
    model = BayesianClassifier(make_bayesian(resnet18(3, width=4), packed=True), 3)
    x, y = torch.randn(24, 3, 8, 8), torch.randint(0, 3, (24,))
    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-3)
    svi = TensorSVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), SharpnessAwareELBO(0.05))
    bn = model.net.bn1
    svi.step(x, y, subsample_size=8)
    tracked = int(bn.num_batches_tracked)
    loss = svi.step(x, y, subsample_size=8)
    assert int(bn.num_batches_tracked) == tracked + 1  # one update per step: the perturbed pass froze them
    assert torch.isfinite(loss)
    model.eval()
    logits = Predictive(model, guide=guide, num_samples=3, return_sites=["logits"])(x)["logits"]
    assert logits.shape == (3, 24, 3)
    swag = SWAGCollector(2)
    hwa = HWA(guide, max_rank=2)
    for draw in guide_draws(guide, 3, x, y):
        assert list(draw) == ["net.weights"]
        swag.collect(draw)
        hwa.collect()
    assert swag.guide(model)(x)["net.weights"].shape == latent_init_values(model)["net.weights"].shape
    model.train()
    kernel = EntropyMCMC(model, eta=1e-3, step_size=1e-6, init_strategy=init_to_network(model))
    kernel.setup(0, x, y, subsample_size=8)
    params = kernel.sample(kernel.initial_params)
    assert all(torch.isfinite(v).all() for v in params.values())


def test_transfer_prior_around_the_pretrained_values_and_a_new_head():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5))
    pretrained = {n: p.detach().clone() for n, p in net.named_parameters()}
    model = bayesian_transfer(net, 3, prior_scale=0.1, head_prior_scale=2.0, packed=True)
    loc, scale = model.net._prior_loc_weights, model.net._prior_scale_weights
    # the norm layer's weight and bias around their pretrained values (scale 0.1), then the new head at 0 (scale 2)
    expected_loc = torch.cat([pretrained["1.weight"], pretrained["1.bias"], torch.zeros(3 * 6 + 3)])
    expected_scale = torch.cat([torch.full((12,), 0.1), torch.full((21,), 2.0)])
    torch.testing.assert_close(loc, expected_loc)
    torch.testing.assert_close(scale, expected_scale)
    assert latent_names(model, torch.randn(4, 4), torch.randint(0, 3, (4,))) == ["net.weights"]


def test_no_sampled_value_outlives_a_call_and_the_network_copies_and_pickles():
    _, packed, x, y = pair()
    guide = AutoNormal(packed)
    svi = TensorSVI(packed, guide, pyro.optim.Adam({"lr": 1e-2}), TensorTrace_ELBO())
    svi.step(x, y, subsample_size=8)
    layer = packed.net[1]
    assert "weight" not in layer.__dict__  # the views are dropped after the forward pass
    with pytest.raises(ValueError), poutine.condition(data={"net.weights": torch.zeros(3)}):
        packed(x, y)  # a wrong-sized value: the views fail, and are dropped anyway
    assert "weight" not in layer.__dict__
    clone = copy.deepcopy(packed)
    buffer = io.BytesIO()
    torch.save(packed.state_dict(), buffer)
    buffer.seek(0)
    clone.load_state_dict(torch.load(buffer, weights_only=True))
    restored = pickle.loads(pickle.dumps(packed))
    with poutine.condition(data={"net.weights": latent_init_values(packed)["net.weights"]}):
        torch.testing.assert_close(restored(x), packed(x))
        torch.testing.assert_close(clone(x), packed(x))


def test_bad_input():
    _, packed, _, _ = pair()
    with pytest.raises(ValueError, match="already packed"):
        pack_latents(packed.net)
    per_tensor = make_bayesian(nn.Linear(2, 2), packed=False)
    with pytest.raises(ValueError, match="`name`"):
        pack_latents(per_tensor, name="weight")  # an attribute of the module
    with pytest.raises(TypeError, match="PyroModule"):
        pack_latents(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="`packed` must be a bool"):
        make_bayesian(nn.Linear(2, 2), packed="yes")
    bare = nn.Linear(2, 2)
    to_pyro_module_(bare)
    with pytest.raises(ValueError, match="no latent parameter"):
        pack_latents(bare)


def test_unpacked_sites_relabel_the_packed_vector_per_tensor():
    per_tensor, packed, x, y = pair()
    names = latent_names(per_tensor, x, y)
    inits = latent_init_values(per_tensor)
    layout = unpacked_sites(packed)
    assert list(layout) == ["net.weights"]
    assert layout["net.weights"] == {n: inits[n].shape for n in names}
    # a SWAG collector of the packed site, relabelled, is the per-tensor collector
    swag = SWAGCollector(2)
    for k in range(3):
        swag.collect({"net.weights": latent_init_values(packed)["net.weights"] * (k + 1)})
    state = swag.state_dict()
    state["sites"] = {n: tuple(s) for n, s in layout["net.weights"].items()}
    relabelled = SWAGCollector(2)
    relabelled.load_state_dict(state)
    for name in names:
        torch.testing.assert_close(relabelled.mean()[name], 2 * inits[name])
