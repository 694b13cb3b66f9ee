import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoDelta, AutoNormal

from pyro_flat.infer import bma_predict, guide_draws, latent_sites, predict_logits, sample_draws
from pyro_flat.metrics import bma_probs
from pyro_flat.nn import BayesianCNN, BayesianMLP, init_to_network


def _fitted_guide(model, x, y, guide_cls=AutoNormal):
    guide = guide_cls(model, init_loc_fn=init_to_network(model))
    guide(x, y)
    return guide


def test_guide_draws_are_model_sites_not_auxiliary():
    model = BayesianMLP(3, 2, hidden=(4,), packed=False)  # a site a tensor (packed: tests/nn/test_packed.py)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    guide = _fitted_guide(model, x, y)
    draws = list(guide_draws(guide, 3))
    assert len(draws) == 3
    assert set(draws[0]) == {"net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"}
    assert not torch.equal(draws[0]["net.1.weight"], draws[1]["net.1.weight"])
    assert all(not v.requires_grad for v in draws[0].values())


def test_bma_predict_equals_predictive_with_the_same_draws():
    model = BayesianMLP(3, 4, hidden=(5,))
    x, y = torch.randn(6, 3), torch.randint(0, 4, (6,))
    guide = _fitted_guide(model, x, y)
    pyro.set_rng_seed(1)
    draws = list(guide_draws(guide, 8))
    acc = bma_predict(model, draws, x, batch_size=4)
    stacked = torch.stack([predict_logits(model, d, x) for d in draws])
    assert torch.allclose(acc.probs, bma_probs(stacked), atol=1e-12)
    # Pyro's Predictive on the stacked draws gives the same logits
    samples = {k: torch.stack([d[k] for d in draws]) for k in draws[0]}
    out = Predictive(model, posterior_samples=samples, return_sites=["logits"])(x)
    assert torch.allclose(out["logits"].reshape(stacked.shape), stacked, atol=1e-12)


def test_bma_predict_several_inputs_share_draws():
    model = BayesianMLP(3, 2, hidden=(4,))
    x1, x2 = torch.randn(5, 3), torch.randn(7, 3)
    guide = _fitted_guide(model, x1, torch.zeros(5, dtype=torch.long))
    draws = list(guide_draws(guide, 4))
    both = bma_predict(model, draws, {"a": x1, "b": x2})
    assert torch.allclose(both["b"].probs, bma_predict(model, draws, x2).probs)
    with pytest.raises(ValueError, match="empty"):
        bma_predict(model, [], x1)


def test_sample_draws_thins_evenly():
    samples = {"w": torch.arange(10.0).unsqueeze(-1)}
    assert [d["w"].item() for d in sample_draws(samples, 4)] == [0.0, 3.0, 6.0, 9.0]
    assert len(list(sample_draws(samples))) == 10
    with pytest.raises(ValueError, match="num_samples"):
        list(sample_draws(samples, 11))
    with pytest.raises(ValueError, match="same number"):
        list(sample_draws({"a": torch.zeros(3), "b": torch.zeros(4)}))


def test_mc_dropout_and_eval_mode():
    model = BayesianMLP(3, 2, hidden=(16,), dropout=0.5)
    x = torch.randn(20, 3)
    point = _fitted_guide(model, x, torch.zeros(20, dtype=torch.long), AutoDelta).median()
    deterministic = bma_predict(model, [point, point], x)
    assert torch.allclose(deterministic.probs, torch.softmax(predict_logits(model.eval(), point, x), -1))
    model.train()
    dropped = bma_predict(model, [point, point], x, mc_dropout=True)
    assert not torch.allclose(dropped.probs, deterministic.probs)
    assert model.training  # mode restored


def test_batchnorm_models_need_inputs_and_refresh_per_draw():
    model = BayesianCNN((1, 8, 8), 3, channels=(4, 4))
    x = torch.randn(30, 1, 8, 8)
    tr = poutine.trace(model).get_trace(x)
    draw = {k: v for k, v in latent_sites(tr).items() if k != "obs"}
    with pytest.raises(ValueError, match="batchnorm_inputs"):
        bma_predict(model, [draw], x)
    model.eval()
    with torch.no_grad():
        stale = torch.log_softmax(poutine.condition(model, data=draw)(x), -1)  # initial stats: mean 0, var 1
    acc = bma_predict(model, [draw], x, batchnorm_inputs=x)
    # with statistics refreshed on the same inputs, eval-mode BN equals train-mode BN on the full batch up to the
    # unbiased-variance factor n/(n-1) of the running variance (n = 480 entries per channel in the second layer)
    model.train()
    with torch.no_grad():
        train_mode = torch.log_softmax(poutine.condition(model, data=draw)(x), -1)
    err = (acc.log_probs - train_mode).abs().max()
    assert err < 2e-2
    assert (stale - train_mode).abs().max() > 10 * err
