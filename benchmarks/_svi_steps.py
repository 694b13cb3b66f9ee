"""Shared SVI steps of the step-time benchmarks (``sharpness_aware_elbo.py``, ``kl_ball_elbo.py``, ``compiled.py``);
timing is ``_timing.py``'s.

* :class:`PyroStep`: one ``SVI.step`` (or, with ``torch_optim=True``, one ``torch.optim.Adam`` step on Pyro's
  ``ELBOModule``) of a Bayesian network in its own parameter-store scope;
* :class:`TorchBBB`: a hand-written mean-field Bayes-by-backprop step with the same arithmetic as ``Trace_ELBO`` +
  ``AutoNormal`` (sampled weights ``loc + softplus(u) * eps``, sampled log prior and log guide, N/B-scaled
  cross-entropy, one backward, Adam), written as a user writes it: log densities in closed form (not
  ``torch.distributions`` objects, whose ``Normal(m, s).log_prob(w)`` makes about eight passes over the tensor forward
  and twenty operations backward, the closed form two and four), fused Adam, random numbers drawn on the data's
  device; eager or ``torch.compile``'d; subclasses replace :meth:`TorchBBB.likelihood_nll` to add a flat step;
  :class:`TorchMAP` the same for MAP (``AutoDelta``: the weights themselves, log prior + likelihood), with SAM's
  second pass when ``rho > 0``;
* :func:`check_same_step`: a Pyro step and a hand-written step compute the same loss and gradients from the same seed
  (and draw the same random numbers on the same devices: :class:`RandomDraws`);
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
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_flat.data import load_digits
from pyro_flat.nn import BayesianClassifier, BayesianMLP, init_to_network, make_bayesian, pack_latents, resnet18

HIDDEN = (256, 256)
BATCH = 128
LR = 1e-3
INIT_SCALE = 1e-3
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def mlp_model() -> BayesianMLP:
    """The Bayesian MLP 64-256-256-10 (prior N(0, 1) on every weight)."""
    return BayesianMLP(64, 10, HIDDEN, packed=False)


def _mlp_forward(weights, x, update_stats: bool = True):
    w1, b1, w2, b2, w3, b3 = weights
    return F.linear(F.relu(F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)), w3, b3)


def mlp_torch() -> tuple[list[torch.Tensor], Callable]:
    """The same MLP written by hand: its initial weights and ``forward(weights, x, update_stats=True)`` (no
    statistics to update)."""
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


class RandomDraws(TorchDispatchMode):
    """Records every random draw dispatched inside it (ATen operations tagged ``nondeterministic_seeded``) as ``(device,
    number of values)``, in order: two steps draw the same random numbers from the same seed only if their records are
    equal (a draw on another device uses another generator)."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.draws.append((str(out.device), out.numel()))
        return out


def check_same_draws(pyro_draws: list, torch_draws: list) -> None:
    """Raise ``ValueError`` unless a Pyro step's first random draws (records of :class:`RandomDraws`) are the
    hand-written step's: the same devices and sizes in the same order. Pyro may draw again after them (a replayed pass,
    e.g. ``KLBallELBO``'s, restores the generator's state and draws the same numbers again)."""
    if pyro_draws[: len(torch_draws)] != torch_draws:
        raise ValueError("the Pyro step and the hand-written step do not draw the same random numbers, so their loss "
                         f"and gradients cannot be compared: (device, values) in order, Pyro {pyro_draws}, "
                         f"hand-written {torch_draws}")


def check_same_step(pyro_step, torch_step, seed: int = 11) -> float:
    """The largest relative difference between the loss and the gradients of a Pyro step and a hand-written step, each
    from the same seed (the same minibatch and noise) at its initial parameters: the two compute the same thing when it
    is at rounding level. ``pyro_step`` has ``loss_and_grads()``; ``torch_step`` has ``draw()`` (its random numbers),
    ``objective(*draws)`` (its loss, eager or compiled) and ``parameters()``.

    :raises ValueError: if the two sides do not draw the same random numbers, on the same devices, in the same order
        (:class:`RandomDraws`): their difference would say nothing (on CUDA, a minibatch drawn on the CPU's generator
        while Pyro's plate draws on the data's device gave differences of order 1).
    """
    pyro.set_rng_seed(seed)
    with RandomDraws() as pyro_draws:
        loss, grads = pyro_step.loss_and_grads()
    pyro.set_rng_seed(seed)
    with RandomDraws() as torch_draws:
        draws = torch_step.draw()
    check_same_draws(pyro_draws.draws, torch_draws.draws)
    torch_loss = torch_step.objective(*draws)
    torch_grads = torch.autograd.grad(torch_loss, torch_step.parameters())
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch_flat = torch.cat([g.reshape(-1) for g in torch_grads])
    return max(((loss - torch_loss).abs() / torch_loss.abs()).item(),
               ((flat - torch_flat).norm() / torch_flat.norm()).item())


def functional_forward(net: nn.Module) -> Callable:
    """``forward(weights, x, update_stats=True)``: ``net`` at the given weights (in ``net.parameters()``'s order).
    With ``update_stats=False`` its buffers are fresh copies, so that BatchNorm's running statistics stay as they are
    (a gradient taken with ``torch.func.grad`` cannot mutate tensors from outside it)."""
    names = [n for n, _ in net.named_parameters()]

    def forward(weights, x, update_stats: bool = True):
        tensors = dict(zip(names, weights, strict=True))
        if not update_stats:
            tensors.update((n, b.clone()) for n, b in net.named_buffers())
        return functional_call(net, tensors, (x,))

    return forward


def packed_torch(params: list[torch.Tensor], forward: Callable) -> tuple[list[torch.Tensor], Callable]:
    """A hand-written network with its weights as one flat vector: ``([flat], forward(weights, x))``, the vector split
    and viewed into the tensors of ``params`` at each call (``pyro_flat.nn.pack_latents``'s layout, written out)."""
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]

    def packed_forward(weights, x, update_stats: bool = True):
        (flat,) = weights
        return forward([c.unflatten(-1, shape) for c, shape in zip(flat.split(sizes, -1), shapes, strict=True)], x,
                       update_stats)

    return [torch.cat([p.detach().reshape(-1) for p in params])], packed_forward


def adam(params: list[torch.Tensor], foreach: bool | None = None) -> torch.optim.Adam:
    """``torch.optim.Adam`` at the benchmarks' rate: fused (one kernel per step) where the device has the fused kernel
    (CPU and CUDA do), unless ``foreach`` is given (``True``: one multi-tensor kernel per operation, as
    ``pyro.optim.Adam`` with ``foreach=True``; ``False``: a loop over the tensors)."""
    if foreach is None and params[0].device.type in _get_fused_kernels_supported_devices():
        return torch.optim.Adam(params, lr=LR, fused=True)
    return torch.optim.Adam(params, lr=LR, foreach=foreach)


def gradient(fn: Callable, tensors: list[torch.Tensor], functional: bool) -> list[torch.Tensor]:
    """The gradient of ``fn(list of tensors) -> scalar`` at ``tensors``, held fixed (no graph back to them): with
    autograd, or with ``torch.func.grad`` (``functional``; what ``torch.compile`` traces in one graph)."""
    if functional:
        return torch.func.grad(fn)([t.detach() for t in tensors])
    leaves = [t.detach().requires_grad_() for t in tensors]
    return list(torch.autograd.grad(fn(leaves), leaves))


def sam_ascent(grads: list[torch.Tensor], rho: float) -> list[torch.Tensor]:
    """SAM's ascent step ``rho g / |g|`` (one global norm over every tensor, 1e-12 added to it)."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return torch._foreach_mul(grads, rho / (norm + 1e-12))


def log_prior(weights: list[torch.Tensor]) -> torch.Tensor:
    """``sum log N(w; 0, 1)`` over every weight, in closed form (the prior of the benchmarks' networks)."""
    return -sum(0.5 * w.square().sum() + HALF_LOG_2PI * w.numel() for w in weights)


def log_guide(noise: list[torch.Tensor], scales: list[torch.Tensor]) -> torch.Tensor:
    """``sum log N(w; m, s)`` at the sample ``w = m + s * noise``, in closed form: ``-noise^2 / 2 - log s - log(2 pi) /
    2`` per weight (the same value and gradients as ``Normal(m, s).log_prob(w)``, with two passes over the tensor
    instead of about eight)."""
    return -sum(0.5 * e.square().sum() + s.log().sum() + HALF_LOG_2PI * e.numel()
                for e, s in zip(noise, scales, strict=True))


class TorchBBB:
    """Mean-field Bayes by backprop written by hand: Trace_ELBO + AutoNormal's arithmetic on the same network, as a
    user writes it (log densities in closed form, fused Adam).

    A step: :meth:`draw` (this step's noise and minibatch), :meth:`objective` (the loss at them), one backward, Adam.
    With ``compile_options`` the objective is ``torch.compile``'d with them (the draws stay eager, so that a compiled
    step draws the same numbers as an eager one); the inner gradients of the flat variants are then
    ``torch.func.grad`` (:func:`gradient`), which ``torch.compile`` traces into the same graph.

    :param params: the network's initial weights (the means start there).
    :param forward: ``forward(weights, x) -> logits``.
    :param foreach: see :func:`adam` (default: fused).
    :param compile_options: ``torch.compile``'s options for the objective (``None``: eager).
    """

    def __init__(self, x, y, params: list[torch.Tensor], forward: Callable, batch: int = BATCH, *,
                 foreach: bool | None = None, compile_options: dict | None = None) -> None:
        self.x, self.y, self.batch = x, y, batch
        self.num_data = len(self.x)
        self.forward = forward
        inv_softplus = math.log(math.expm1(INIT_SCALE))
        self.locs = [p.detach().clone().requires_grad_() for p in params]
        self.raw_scales = [torch.full_like(p, inv_softplus).requires_grad_() for p in self.locs]
        self.optim = adam(self.parameters(), foreach)
        self._compile(compile_options)

    def _compile(self, options: dict | None) -> None:
        self.compiled = options is not None
        self.objective = self._objective if options is None else torch.compile(self._objective, **options)

    def parameters(self) -> list[torch.Tensor]:
        """The optimised tensors, in the order of Pyro's ``AutoNormal`` parameters (locs, then scales)."""
        return self.locs + self.raw_scales

    def nll(self, weights, x, y, update_stats: bool = True):
        """``-N/B sum log p(y | x, w)``; ``update_stats=False``: BatchNorm's running statistics left alone (the
        inner pass of a flat step)."""
        return F.cross_entropy(self.forward(weights, x, update_stats), y, reduction="sum") * (self.num_data / len(x))

    def inner_nll(self, weights, x, y):
        """The NLL of a flat step's inner (ascent) pass. Compiled, BatchNorm's running statistics are left alone
        (``torch.func.grad`` cannot update them, and in the graph their copies cost nothing); eager, the pass updates
        them as a hand-written SAM loop does (cheaper than copying them; they do not enter the loss)."""
        return self.nll(weights, x, y, update_stats=not self.compiled)

    def grad(self, fn: Callable, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """:func:`gradient`, functional when the objective is compiled."""
        return gradient(fn, tensors, self.compiled)

    def likelihood_nll(self, weights, scales, noise, x, y):
        """The data term of the step; a flat variant evaluates it at perturbed weights."""
        return self.nll(weights, x, y)

    def minibatch(self) -> torch.Tensor:
        """A minibatch's indices, drawn on the data's device as Pyro's plate draws them (``randperm(N,
        device=x.device)``): another device's generator would give another minibatch."""
        return torch.randperm(self.num_data, device=self.x.device)[: self.batch]

    def draw(self) -> tuple:
        """This step's random numbers in the order of Pyro's SVI step: the guide draws the weights' noise, then the
        model's plate its minibatch."""
        return [torch.randn_like(m) for m in self.locs], self.minibatch()

    def _objective(self, noise, idx) -> torch.Tensor:
        x, y = self.x[idx], self.y[idx]
        scales = [F.softplus(u) for u in self.raw_scales]
        weights = [m + s * e for m, s, e in zip(self.locs, scales, noise, strict=True)]
        return self.likelihood_nll(weights, scales, noise, x, y) - log_prior(weights) + log_guide(noise, scales)

    def loss(self) -> torch.Tensor:
        """The loss of one step (fresh noise and minibatch)."""
        return self.objective(*self.draw())

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
                 foreach: bool | None = None, rho: float = 0.0, compile_options: dict | None = None) -> None:
        self.rho = rho
        self.x, self.y, self.batch = x, y, batch
        self.num_data = len(self.x)
        self.forward = forward
        self.locs = [p.detach().clone().requires_grad_() for p in params]
        self.raw_scales = []
        self.optim = adam(self.parameters(), foreach)
        self._compile(compile_options)

    def draw(self) -> tuple:
        return (self.minibatch(),)

    def _objective(self, idx) -> torch.Tensor:
        x, y = self.x[idx], self.y[idx]
        weights = self.locs
        if self.rho > 0:
            grads = self.grad(lambda w: self.inner_nll(w, x, y), weights)
            weights = torch._foreach_add(weights, sam_ascent(grads, self.rho))
        return self.nll(weights, x, y) - log_prior(self.locs)


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
            self.make_model = lambda: BayesianClassifier(make_bayesian(copy.deepcopy(net), packed=False), 10)
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
            self.make_model = lambda: BayesianClassifier(make_bayesian(copy.deepcopy(net), packed=False), 10)
            self.torch_params = list(net.parameters())
            self.torch_forward = functional_forward(net)
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

    def torch_step(self, cls: type, compile_options: dict | None = None) -> TorchBBB:
        """A hand-written step of class ``cls`` on this network (packed with ``packed``), eager or compiled."""
        params, forward = self.torch_params, self.torch_forward
        if self.packed:
            params, forward = packed_torch(params, forward)
        return cls(self.x, self.y, params, forward, self.batch, compile_options=compile_options)
