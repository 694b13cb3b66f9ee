"""Shared SVI steps of the step-time benchmarks (``sharpness_aware_elbo.py``, ``kl_ball_elbo.py``, ``compiled.py``);
timing is ``_timing.py``'s.

* :class:`PyroStep`: one ``SVI.step`` (or, with ``torch_optim=True``, one ``torch.optim.Adam`` step on Pyro's
  ``ELBOModule``) of a Bayesian network in its own parameter-store scope;
* :class:`TorchBBB`: a hand-written mean-field Bayes-by-backprop step with the same arithmetic as ``Trace_ELBO`` +
  ``AutoNormal`` (sampled weights ``loc + softplus(u) * eps``, sampled log prior and log guide, N/B-scaled
  cross-entropy, one backward, Adam); subclasses replace :meth:`TorchBBB.likelihood_nll` to add a flat step;
  :class:`TorchMAP` the same for MAP (``AutoDelta``: the weights themselves, log prior + likelihood), with SAM's
  second pass when ``rho > 0``;
* :func:`packed_torch`: a hand-written network's weights as one flat vector viewed into its tensors (the packed form
  of ``pyro_flat.nn.pack_latents``, written out);
* :func:`mlp_model`, :func:`mlp_torch`: the MLP 64-256-256-10 of digits as a Pyro model and as hand-written torch.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal
from torch import nn
from torch.func import functional_call

from pyro_flat.data import load_digits
from pyro_flat.nn import BayesianClassifier, BayesianMLP, init_to_network, make_bayesian, pack_latents, resnet18

HIDDEN = (256, 256)
BATCH = 128
LR = 1e-3
INIT_SCALE = 1e-3


def mlp_model() -> BayesianMLP:
    """The Bayesian MLP 64-256-256-10 (prior N(0, 1) on every weight)."""
    return BayesianMLP(64, 10, HIDDEN)


def _mlp_forward(weights, x):
    w1, b1, w2, b2, w3, b3 = weights
    return F.linear(F.relu(F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)), w3, b3)


def mlp_torch() -> tuple[list[torch.Tensor], Callable]:
    """The same MLP written by hand: its initial weights and ``forward(weights, x)``."""
    net = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN[0]), torch.nn.ReLU(), torch.nn.Linear(*HIDDEN),
                              torch.nn.ReLU(), torch.nn.Linear(HIDDEN[1], 10))
    return list(net.parameters()), _mlp_forward


class PyroStep:
    """An SVI step in its own parameter-store scope (swapped in and out around each timed block, not per step).

    :param torch_optim: train with ``torch.optim.Adam`` on ``loss(model, guide)`` (Pyro's ``ELBOModule``) instead of
        ``SVI`` with ``pyro.optim.Adam`` (one torch optimiser per parameter).
    :param svi_class: ``pyro.infer.SVI`` (default) or ``pyro_flat.infer.TensorSVI`` (no host read per step).
    :param foreach: ``pyro.optim.Adam``'s ``foreach`` (``None``: torch's default).
    """

    def __init__(self, model, x, y, loss, guide_factory: Callable, batch: int = BATCH, *,
                 torch_optim: bool = False, svi_class: type = SVI, foreach: bool | None = None) -> None:
        self.x, self.y, self.batch = x, y, batch
        self.store = pyro.get_param_store()
        self.store.clear()
        self.model, self.loss = model, loss
        self.guide = guide = guide_factory(model)
        guide(x, y, subsample_size=batch)  # sets the guide up (its parameters at their initial values)
        if torch_optim:
            self.module = loss(model, guide)
            self.optim = torch.optim.Adam(self.module.parameters(), lr=LR)
        else:
            self.svi = svi_class(model, guide, pyro.optim.Adam({"lr": LR, "foreach": foreach}), loss)
        self.state = self.store.get_state()

    def enter(self) -> None:
        self.store.clear()
        self.store.set_state(self.state)

    def exit(self) -> None:
        self.state = self.store.get_state()

    def step(self) -> None:
        if hasattr(self, "svi"):
            self.svi.step(self.x, self.y, subsample_size=self.batch)
            return
        self.optim.zero_grad()
        self.module(self.x, self.y, subsample_size=self.batch).backward()
        self.optim.step()

    def loss_and_grads(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The loss of one step and its gradients with respect to the guide's parameters (unconstrained), in the order
        of the hand-written steps' :meth:`TorchBBB.parameters` (locations, then scales; ``AutoDelta``: the values)."""
        self.enter()
        try:
            loss = self.loss.differentiable_loss(self.model, self.guide, self.x, self.y, subsample_size=self.batch)
            names = list(self.store.keys())
            if any(".locs." in n for n in names):
                names = [n for n in names if ".locs." in n] + [n for n in names if ".scales." in n]
            grads = torch.autograd.grad(loss, [self.store._params[n] for n in names])
        finally:
            self.exit()
        return loss.detach(), list(grads)


def check_same_step(pyro_step, torch_step, seed: int = 11) -> float:
    """The largest relative difference between the loss and the gradients of a Pyro step and a hand-written step, each
    from the same seed (the same minibatch and noise) at its initial parameters: the two compute the same thing when it
    is at rounding level. ``pyro_step`` has ``loss_and_grads()``, ``torch_step`` ``loss()`` and ``parameters()``."""
    pyro.set_rng_seed(seed)
    loss, grads = pyro_step.loss_and_grads()
    pyro.set_rng_seed(seed)
    torch_loss = torch_step.loss()
    torch_grads = torch.autograd.grad(torch_loss, torch_step.parameters())
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch_flat = torch.cat([g.reshape(-1) for g in torch_grads])
    return max(((loss - torch_loss).abs() / torch_loss.abs()).item(),
               ((flat - torch_flat).norm() / torch_flat.norm()).item())


def packed_torch(params: list[torch.Tensor], forward: Callable) -> tuple[list[torch.Tensor], Callable]:
    """A hand-written network with its weights as one flat vector: ``([flat], forward(weights, x))``, the vector split
    and viewed into the tensors of ``params`` at each call (``pyro_flat.nn.pack_latents``'s layout, written out)."""
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]

    def packed_forward(weights, x):
        (flat,) = weights
        return forward([c.unflatten(-1, shape) for c, shape in zip(flat.split(sizes, -1), shapes, strict=True)], x)

    return [torch.cat([p.detach().reshape(-1) for p in params])], packed_forward


class TorchBBB:
    """Mean-field Bayes by backprop written by hand: Trace_ELBO + AutoNormal's arithmetic on the same network.

    :param params: the network's initial weights (the means start there).
    :param forward: ``forward(weights, x) -> logits``.
    :param foreach: ``torch.optim.Adam``'s ``foreach`` (``None``: torch's default, a loop over the tensors on a CPU and
        one multi-tensor kernel per operation on a GPU).
    """

    def __init__(self, x, y, params: list[torch.Tensor], forward: Callable, batch: int = BATCH, *,
                 foreach: bool | None = None) -> None:
        self.x, self.y, self.batch = x, y, batch
        self.num_data = len(self.x)
        self.forward = forward
        inv_softplus = math.log(math.expm1(INIT_SCALE))
        self.locs = [p.detach().clone().requires_grad_() for p in params]
        self.raw_scales = [torch.full_like(p, inv_softplus).requires_grad_() for p in self.locs]
        self.optim = torch.optim.Adam(self.parameters(), lr=LR, foreach=foreach)

    def parameters(self) -> list[torch.Tensor]:
        """The optimised tensors, in the order of Pyro's ``AutoNormal`` parameters (locs, then scales)."""
        return self.locs + self.raw_scales

    def nll(self, weights, x, y):
        return F.cross_entropy(self.forward(weights, x), y, reduction="sum") * (self.num_data / len(x))

    def likelihood_nll(self, weights, scales, noise, x, y):
        """The data term of the step; a flat variant evaluates it at perturbed weights."""
        return self.nll(weights, x, y)

    def loss(self) -> torch.Tensor:
        """The loss of one step: fresh noise, then a fresh minibatch (the order of Pyro's SVI step: the guide draws the
        global weights, then the model's plate its minibatch)."""
        scales = [F.softplus(u) for u in self.raw_scales]
        noise = [torch.randn_like(m) for m in self.locs]
        idx = torch.randperm(self.num_data)[:self.batch]
        x, y = self.x[idx], self.y[idx]
        weights = [m + s * e for m, s, e in zip(self.locs, scales, noise, strict=True)]
        log_prior = sum(torch.distributions.Normal(0.0, 1.0).log_prob(w).sum() for w in weights)
        log_q = sum(torch.distributions.Normal(m, s).log_prob(w).sum()
                    for w, m, s in zip(weights, self.locs, scales, strict=True))
        return self.likelihood_nll(weights, scales, noise, x, y) - log_prior + log_q

    def step(self) -> None:
        loss = self.loss()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()


class TorchMAP(TorchBBB):
    """MAP written by hand, ``AutoDelta`` + ``Trace_ELBO``'s arithmetic: the loss ``-log p(w) - N/B sum log p(y|x, w)``
    at the weights themselves; with ``rho > 0`` SAM's step (the likelihood at ``w + rho g/|g|``, ``g`` its gradient,
    one global norm), i.e. ``SharpnessAwareELBO`` with ``AutoDelta``."""

    def __init__(self, x, y, params: list[torch.Tensor], forward: Callable, batch: int = BATCH, *,
                 foreach: bool | None = None, rho: float = 0.0) -> None:
        self.rho = rho
        self.x, self.y, self.batch = x, y, batch
        self.num_data = len(self.x)
        self.forward = forward
        self.locs = [p.detach().clone().requires_grad_() for p in params]
        self.raw_scales = []
        self.optim = torch.optim.Adam(self.parameters(), lr=LR, foreach=foreach)

    def loss(self) -> torch.Tensor:
        idx = torch.randperm(self.num_data)[:self.batch]
        x, y = self.x[idx], self.y[idx]
        weights = self.locs
        if self.rho > 0:
            leaves = [w.detach().requires_grad_() for w in weights]
            grads = torch.autograd.grad(self.nll(leaves, x, y), leaves)
            norm = torch.sqrt(sum((g * g).sum() for g in grads))
            weights = [w + self.rho * g / (norm + 1e-12) for w, g in zip(weights, grads, strict=True)]
        log_prior = sum(torch.distributions.Normal(0.0, 1.0).log_prob(w).sum() for w in self.locs)
        return self.nll(weights, x, y) - log_prior


class Network:
    """A network as a Pyro model and as hand-written torch, with its data.

    :param name: ``"mlp"`` or ``"resnet18"``.
    :param width: ResNet-18's first-stage width (64: the standard network; small widths for tests).
    :param num_data: ResNet-18's number of synthetic CIFAR-shaped training points.
    :param batch: ResNet-18's minibatch size.
    """

    def __init__(self, name: str, *, width: int = 64, num_data: int = 1024, batch: int = 32,
                 packed: bool = False) -> None:
        self.name, self.packed = name, packed
        if name == "mlp":
            data = load_digits(dtype=torch.float32)
            self.x, self.y, self.batch = data.x_train, data.y_train, 128
            self.describe = "MLP 64-256-256-10 on digits (N = 1257), minibatch 128"
            params, self.torch_forward = mlp_torch()
            net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
            with torch.no_grad():
                for target, value in zip(net.parameters(), params, strict=True):
                    target.copy_(value)
            self.torch_params = list(net.parameters())
            # the Pyro model starts from the hand-written network's weights (same arithmetic, same numbers)
            self.make_model = lambda: BayesianClassifier(make_bayesian(copy.deepcopy(net)), 10)
            self.make_net = lambda: copy.deepcopy(net)
        elif name == "resnet18":
            generator = torch.Generator().manual_seed(0)
            self.x = torch.randn(num_data, 3, 32, 32, generator=generator)
            self.y = torch.randint(0, 10, (num_data,), generator=generator)
            self.batch = batch
            net = resnet18(10, width=width)
            size = sum(p.numel() for p in net.parameters())
            self.describe = (f"ResNet-18{'' if width == 64 else f' (width {width})'}, CIFAR stem, BatchNorm, "
                             f"{size / 1e6:.1f} M latent weights, on CIFAR-shaped synthetic data (N = {num_data}), "
                             f"minibatch {batch}")
            names = [n for n, _ in net.named_parameters()]
            self.make_model = lambda: BayesianClassifier(make_bayesian(copy.deepcopy(net)), 10)
            self.torch_params = list(net.parameters())
            self.torch_forward = lambda weights, x: functional_call(net, dict(zip(names, weights, strict=True)), (x,))
            self.make_net = lambda: copy.deepcopy(net)
        else:
            raise ValueError(f"unknown network {name!r}")
        if packed:
            self.describe += ", packed (one latent site)"

    def model(self) -> BayesianClassifier:
        """The Bayesian network (packed with ``packed``)."""
        model = self.make_model()
        if self.packed:
            pack_latents(model.net)
        return model

    def svi(self, loss, *, torch_optim: bool = False) -> PyroStep:
        def guide(model):
            return AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=INIT_SCALE)

        return PyroStep(self.model(), self.x, self.y, loss, guide, self.batch, torch_optim=torch_optim)

    def torch_step(self, cls: type) -> TorchBBB:
        params, forward = self.torch_params, self.torch_forward
        if self.packed:
            params, forward = packed_torch(params, forward)
        return cls(self.x, self.y, params, forward, self.batch)
