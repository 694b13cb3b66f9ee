"""Shared SVI steps of the step-time benchmarks (``sharpness_aware_elbo.py``, ``kl_ball_elbo.py``); timing is
``_timing.py``'s.

* :class:`PyroStep`: one ``SVI.step`` of a :class:`~pyro_flat.nn.BayesianMLP` on digits in its own parameter-store
  scope;
* :class:`TorchBBB`: a hand-written mean-field Bayes-by-backprop step with the same arithmetic as ``Trace_ELBO`` +
  ``AutoNormal`` (sampled weights ``loc + softplus(u) * eps``, sampled log prior and log guide, N/B-scaled
  cross-entropy, one backward, Adam); subclasses replace :meth:`TorchBBB.likelihood_nll` to add a flat step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import SVI

from pyro_flat.nn import BayesianMLP

HIDDEN = (256, 256)
BATCH = 128
LR = 1e-3
INIT_SCALE = 1e-3


class PyroStep:
    """An SVI step in its own parameter-store scope (swapped in and out around each timed block, not per step)."""

    def __init__(self, data, loss, guide_factory: Callable) -> None:
        self.data = data
        self.store = pyro.get_param_store()
        self.store.clear()
        self.model = BayesianMLP(64, 10, HIDDEN)
        self.svi = SVI(self.model, guide_factory(self.model), pyro.optim.Adam({"lr": LR}), loss)
        self.step()  # sets the guide up
        self.state = self.store.get_state()

    def enter(self) -> None:
        self.store.clear()
        self.store.set_state(self.state)

    def exit(self) -> None:
        self.state = self.store.get_state()

    def step(self) -> None:
        self.svi.step(self.data.x_train, self.data.y_train, subsample_size=BATCH)


class TorchBBB:
    """Mean-field Bayes by backprop written by hand: Trace_ELBO + AutoNormal's arithmetic on the same MLP."""

    def __init__(self, data) -> None:
        self.x, self.y = data.x_train, data.y_train
        self.num_data = len(self.x)
        net = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN[0]), torch.nn.ReLU(), torch.nn.Linear(*HIDDEN),
                                  torch.nn.ReLU(), torch.nn.Linear(HIDDEN[1], 10))
        inv_softplus = math.log(math.expm1(INIT_SCALE))
        self.locs = [p.detach().clone().requires_grad_() for p in net.parameters()]
        self.raw_scales = [torch.full_like(p, inv_softplus).requires_grad_() for p in self.locs]
        self.optim = torch.optim.Adam(self.locs + self.raw_scales, lr=LR)

    def enter(self) -> None:
        pass

    def exit(self) -> None:
        pass

    @staticmethod
    def forward(weights, x):
        w1, b1, w2, b2, w3, b3 = weights
        return F.linear(F.relu(F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)), w3, b3)

    def nll(self, weights, x, y):
        return F.cross_entropy(self.forward(weights, x), y, reduction="sum") * (self.num_data / len(x))

    def likelihood_nll(self, weights, scales, noise, x, y):
        """The data term of the step; a flat variant evaluates it at perturbed weights."""
        return self.nll(weights, x, y)

    def step(self) -> None:
        idx = torch.randperm(self.num_data)[:BATCH]
        x, y = self.x[idx], self.y[idx]
        scales = [F.softplus(u) for u in self.raw_scales]
        noise = [torch.randn_like(m) for m in self.locs]
        weights = [m + s * e for m, s, e in zip(self.locs, scales, noise, strict=True)]
        log_prior = sum(torch.distributions.Normal(0.0, 1.0).log_prob(w).sum() for w in weights)
        log_q = sum(torch.distributions.Normal(m, s).log_prob(w).sum()
                    for w, m, s in zip(weights, self.locs, scales, strict=True))
        loss = self.likelihood_nll(weights, scales, noise, x, y) - log_prior + log_q
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
