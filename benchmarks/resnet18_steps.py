"""Step time of every objective, kernel and optimizer of pyro_flat at ResNet-18 scale, against its non-flat base and
against a hand-written torch loop doing the same arithmetic, all in one run.

ResNet-18 with the CIFAR stem (``pyro_flat.nn.resnet18``: 3x3 stride-1 first convolution, no max-pool, BatchNorm),
every weight latent (11.2 M), on CIFAR-shaped synthetic data (N = 1024 images 3x32x32, 10 classes: nothing
downloads), minibatch 32, float32, one thread, Pyro's validation and torch.distributions' argument checks off for
every variant (the hand-written loops included: no baseline is handicapped), eager (the compiled paths at this scale
are ``compiled.py --network resnet18``); ``--packed``: the latent weights in one site and the hand-written loops' in
one vector. Before timing, each hand-written SVI step and SGLD loop is checked to compute its Pyro step's loss and
gradients from the same seed. Every variant is timed in every repeat, the order alternating between repeats,
and the median over repeats is reported (``_timing.py``): the machine is shared, so drift hits all variants alike.

* **SVI objectives** (``AutoNormal``, init scale 1e-3, ``pyro.optim.Adam`` 1e-3, one ``SVI.step``): the bases
  ``TensorTrace_ELBO`` and ``TensorTraceMeanField_ELBO`` (Pyro's ``Trace_ELBO``, timed beside them, reads every site's
  log-density on the host); ``SharpnessAwareELBO`` and ``SharpnessAwareMeanFieldELBO`` (rho 0.05);
  ``KLBallELBO`` (radius 0.01) with the Fisher and the normalised-score direction. Hand-written (``_svi_steps.py``,
  ``sharpness_aware_elbo.py``, ``kl_ball_elbo.py``): Bayes by backprop, + SAM, + the Fisher KL-ball step, and
  :class:`TorchKLBallScore` (+ the normalised-score step).
* **SG-MCMC kernels** (step size 1e-6, temperature 1; one transition, the kernel's ``sample`` applied to its own
  output): ``SGLD`` (the base), ``SGHMC`` (friction 0.1), ``EntropyMCMC`` (eta 1e-3), ``EntropySGD`` and
  ``EntropySGLD`` (``--inner-steps`` L; one transition is L gradient steps). Hand-written loops on the ``nn.Module``
  (``F.cross_entropy(sum) * N/B + |theta|^2 / 2``, in-place updates): SGLD (``compiled.py``), SGHMC, Entropy-MCMC,
  Entropy-SGLD (nested: L inner Langevin steps around the outer weights, running mean, outer Langevin step).
* **Closure optimizers** on the torch ResNet-18, closure = mean cross-entropy of one minibatch (a fresh one per step):
  ``torch.optim.SGD`` (momentum 0.9, the base), ``pyro_flat.optim.SAM`` around it (rho 0.05), ``BayesianSAM`` (the
  authors' ResNet-18 setting: lr 0.5, rho 0.01, prior precision 40; one sub-batch). Hand-written (``bayesian_sam.py``):
  the two-pass SAM and bSAM steps, BatchNorm's running statistics kept in the second pass as the library keeps them.
* **Averaging**: SWA/SWAG/HWA collect once per epoch (391 steps at batch 128 on CIFAR), so their per-step overhead
  is the per-collection cost divided by that; the per-collection cost is measured: ``SWAGCollector.collect`` (rank 20)
  of the torch network's weights against a torch SGD step, ``HWA.collect`` of an ``AutoNormal`` guide against an SVI
  ``Trace_ELBO`` step, and hand-written collections (flatten, running moments, one deviation column; for HWA also
  the running moments of the scales).

Run: ``python benchmarks/resnet18_steps.py`` (5 repeats x 2 steps, about 13 minutes on one free core; every variant
is alive at once, about 13 GB of memory; writes ``benchmarks/results/resnet18_steps.md``).
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pyro
import torch
import torch.nn.functional as F
from _report import write_markdown
from _svi_steps import INIT_SCALE, TorchBBB, check_same_step
from _timing import environment, interleaved_times, medians_ms, timing_rows
from bayesian_sam import PlainBSAM, PlainSAM
from compiled import STEP_SIZE, KernelSteps, Network, TorchSGLD, check_same_gradient
from kl_ball_elbo import RADIUS, TorchKLBall
from pyro.infer import Trace_ELBO
from sharpness_aware_elbo import RHO, TorchBBBSAM
from torch import nn
from torch.nn.utils import parameters_to_vector

from pyro_flat.infer import (
    HWA,
    KLBallELBO,
    SharpnessAwareELBO,
    SharpnessAwareMeanFieldELBO,
    SWAGCollector,
    TensorTrace_ELBO,
    TensorTraceMeanField_ELBO,
)
from pyro_flat.infer.mcmc import SGHMC, EntropyMCMC, EntropySGD, EntropySGLD
from pyro_flat.ops.fisher import normalized_score_step
from pyro_flat.optim import SAM, BayesianSAM

FRICTION = 0.1
ETA = 1e-3
MEAN_WEIGHT = 0.25  # EntropySGD's defaults: the running-mean weight, the outer step size lambda = eta
OUTER_STEP = ETA
SGD = {"lr": 0.01, "momentum": 0.9}
BSAM = {"lr": 0.5, "rho": 0.01, "prior_precision": 40.0}
MAX_RANK = 20
COLLECTIONS = 5  # collections per timed step (one call is short), reported per call


# ---------------------------------------------------------------------------------------------------------------------
# hand-written loops not in the other scripts
# ---------------------------------------------------------------------------------------------------------------------


class TorchKLBallScore(TorchBBB):
    """Bayes by backprop plus the normalised-score KL-ball step (``KLBallELBO(direction="normalized_score")``): the
    score of ``log q`` at the sample (held fixed) in ``(loc, u)``, each role (all means, all raw scales) normalised by
    its global norm, the likelihood at ``(loc + d_loc) + softplus(u + d_u) * eps``."""

    def likelihood_nll(self, weights, scales, noise, x, y):
        log_q = sum(torch.distributions.Normal(m, F.softplus(u)).log_prob(w.detach()).sum()
                    for m, u, w in zip(self.locs, self.raw_scales, weights, strict=True))
        scores = torch.autograd.grad(log_q, self.locs + self.raw_scales)
        n = len(self.locs)
        d_locs, d_us = normalized_score_step([scores[:n], scores[n:]], RADIUS)
        perturbed = [(m + dm) + F.softplus(u + du) * e for m, u, dm, du, e in
                     zip(self.locs, self.raw_scales, d_locs, d_us, noise, strict=True)]
        return self.nll(perturbed, x, y)


class TorchSGHMC(TorchSGLD):
    """SGHMC: ``v <- (1 - a) v - eps g + sqrt(2 a eps) xi``, ``theta <- theta + v``."""

    def __init__(self, network: Network) -> None:
        super().__init__(network)
        self.momenta = [torch.zeros_like(p) for p in self.params]
        self.noise_scale = math.sqrt(2 * FRICTION * STEP_SIZE)

    @torch.no_grad()
    def update(self, grads):
        for p, v, g in zip(self.params, self.momenta, grads, strict=True):
            v.mul_(1 - FRICTION).add_(g, alpha=-STEP_SIZE).add_(torch.randn_like(v), alpha=self.noise_scale)
            p.add_(v)


class TorchEntropyMCMC(TorchSGLD):
    """Entropy-MCMC: SGLD on the weights and their anchors, coupled by ``|theta - anchor|^2 / (2 eta)`` (one gradient
    of the network, the coupling added by hand, a second Gaussian draw for the anchors)."""

    def __init__(self, network: Network) -> None:
        super().__init__(network)
        self.anchors = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, grads):
        for p, a, g in zip(self.params, self.anchors, grads, strict=True):
            pull = (p - a) / ETA
            a.add_(pull, alpha=STEP_SIZE).add_(torch.randn_like(a), alpha=self.noise_scale)
            p.add_(g + pull, alpha=-STEP_SIZE).add_(torch.randn_like(p), alpha=self.noise_scale)


class TorchEntropySGLD(TorchSGLD):
    """Entropy-SGLD, nested: the network's weights are the inner chain (continued between transitions), ``outer`` the
    outer variable x. A transition: L inner Langevin steps on ``U(x') + |x' - x|^2 / (2 eta)``, their running mean mu
    (weight 0.25), then ``x <- x - lambda (x - mu) / eta + sqrt(2 lambda) xi`` with ``lambda = eta``."""

    def __init__(self, network: Network, inner_steps: int) -> None:
        super().__init__(network)
        self.inner_steps = inner_steps
        self.outer = [p.detach().clone() for p in self.params]

    def step(self) -> None:
        mean = [p.detach().clone() for p in self.params]
        for _ in range(self.inner_steps):
            grads = self.gradients()
            with torch.no_grad():
                for p, x, g, m in zip(self.params, self.outer, grads, mean, strict=True):
                    p.add_(g + (p - x) / ETA, alpha=-STEP_SIZE).add_(torch.randn_like(p), alpha=self.noise_scale)
                    m.lerp_(p, MEAN_WEIGHT)
        with torch.no_grad():
            for x, m in zip(self.outer, mean, strict=True):
                x.add_(x - m, alpha=-OUTER_STEP / ETA).add_(torch.randn_like(x), alpha=math.sqrt(2 * OUTER_STEP))


class TorchMoments:
    """A hand-written SWAG collection of ``params``: flatten, running mean and mean of squares, one deviation column
    in a ring buffer of ``MAX_RANK`` rows."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        size = sum(p.numel() for p in params)
        self.mean, self.sq_mean = torch.zeros(size), torch.zeros(size)
        self.deviations = torch.zeros(MAX_RANK, size)
        self.n = 0

    @torch.no_grad()
    def step(self) -> None:
        theta = parameters_to_vector(self.params)
        self.mean.lerp_(theta, 1 / (self.n + 1))
        self.sq_mean.lerp_(theta.square(), 1 / (self.n + 1))
        self.deviations[self.n % MAX_RANK].copy_(theta - self.mean)
        self.n += 1


class TorchHWA(TorchMoments):
    """A hand-written HWA collection from hand-written Bayes by backprop: the SWAG moments of the means, and the
    running mean and mean of squares of the scales ``softplus(u)``."""

    def __init__(self, bbb: TorchBBB) -> None:
        super().__init__(bbb.locs)
        self.raw_scales = bbb.raw_scales
        self.scale_mean, self.scale_sq_mean = torch.zeros_like(self.mean), torch.zeros_like(self.mean)

    @torch.no_grad()
    def step(self) -> None:
        weight = 1 / (self.n + 1)
        super().step()
        scale = F.softplus(parameters_to_vector(self.raw_scales))
        self.scale_mean.lerp_(scale, weight)
        self.scale_sq_mean.lerp_(scale.square(), weight)


# ---------------------------------------------------------------------------------------------------------------------
# the library's optimizers and collectors as variants
# ---------------------------------------------------------------------------------------------------------------------


@contextmanager
def batchnorm_statistics_kept(net: nn.Module) -> Iterator[None]:
    """BatchNorm normalises with the batch statistics and leaves its running ones alone (the second pass of SAM)."""
    layers = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in layers:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in layers:
            m.track_running_stats = True


class OptimizerStep:
    """One step of an optimizer on its own copy of the torch network, the loss the mean cross-entropy of a fresh
    minibatch: ``"sgd"`` (zero_grad, backward, step), ``"closure"`` (``optimizer.step(closure)``) or ``"plain"``
    (``optimizer.step(loss_fn)`` of the hand-written ones)."""

    def __init__(self, network: Network, make_optimizer, kind: str) -> None:
        self.network, self.kind = network, kind
        self.net = network.make_net()
        self.optimizer = make_optimizer(self.net)

    def step(self) -> None:
        idx = torch.randperm(len(self.network.x), device=self.network.x.device)[: self.network.batch]
        x, y = self.network.x[idx], self.network.y[idx]

        def loss_fn():
            return F.cross_entropy(self.net(x), y)

        def closure():
            loss = loss_fn()
            loss.backward()
            return loss

        if self.kind == "sgd":
            self.optimizer.zero_grad()
            loss_fn().backward()
            self.optimizer.step()
        elif self.kind == "closure":
            self.optimizer.step(closure)
        else:
            self.optimizer.step(loss_fn)


class Repeated:
    """``times`` steps of ``variant`` per step, reported per step of ``variant``."""

    def __init__(self, variant: object, times: int) -> None:
        self.variant, self.units_per_step = variant, times

    def enter(self) -> None:
        getattr(self.variant, "enter", lambda: None)()

    def exit(self) -> None:
        getattr(self.variant, "exit", lambda: None)()

    def step(self) -> None:
        for _ in range(self.units_per_step):
            self.variant.step()


class SWAGCollection:
    """``SWAGCollector.collect`` of a torch network's weights, one call per step."""

    def __init__(self, network: Network) -> None:
        self.weights = dict(network.make_net().named_parameters())
        self.collector = SWAGCollector(MAX_RANK)

    def step(self) -> None:
        self.collector.collect(self.weights)


class HWACollection:
    """``HWA.collect`` of the ``AutoNormal`` guide of an SVI ``Trace_ELBO`` run (in its own parameter-store scope)."""

    def __init__(self, network: Network) -> None:
        self.svi = network.svi(TensorTrace_ELBO())
        self.enter()
        self.hwa = HWA(self.svi.svi.guide, max_rank=MAX_RANK)
        self.exit()

    def enter(self) -> None:
        self.svi.enter()

    def exit(self) -> None:
        self.svi.exit()

    def step(self) -> None:
        self.hwa.collect()


def variants(network: Network, inner_steps: int) -> dict[str, object]:
    n = len(network.x)
    entropy = {"eta": ETA, "num_inner_steps": inner_steps}
    bbb = network.torch_step(TorchBBB)
    return {
        # SVI objectives
        "Trace_ELBO (Pyro)": network.svi(Trace_ELBO()),
        "TensorTrace_ELBO": network.svi(TensorTrace_ELBO()),
        "TensorTraceMeanField_ELBO": network.svi(TensorTraceMeanField_ELBO()),
        "SharpnessAwareELBO": network.svi(SharpnessAwareELBO(RHO)),
        "SharpnessAwareMeanFieldELBO": network.svi(SharpnessAwareMeanFieldELBO(RHO)),
        "KLBallELBO (fisher)": network.svi(KLBallELBO(RADIUS)),
        "KLBallELBO (normalized_score)": network.svi(KLBallELBO(RADIUS, direction="normalized_score")),
        "torch BBB": bbb,
        "torch BBB-SAM": network.torch_step(TorchBBBSAM),
        "torch KL-ball (fisher)": network.torch_step(TorchKLBall),
        "torch KL-ball (normalized score)": network.torch_step(TorchKLBallScore),
        # SG-MCMC kernels: one transition
        "SGLD": KernelSteps(network, 0),
        "SGHMC": KernelSteps(network, 0, kernel=SGHMC, friction=FRICTION),
        "EntropyMCMC": KernelSteps(network, 0, kernel=EntropyMCMC, eta=ETA),
        f"EntropySGD (L={inner_steps})": KernelSteps(network, 0, kernel=EntropySGD, **entropy),
        f"EntropySGLD (L={inner_steps})": KernelSteps(network, 0, kernel=EntropySGLD, **entropy),
        "torch SGLD": TorchSGLD(network),
        "torch SGHMC": TorchSGHMC(network),
        "torch Entropy-MCMC": TorchEntropyMCMC(network),
        f"torch Entropy-SGLD (L={inner_steps})": TorchEntropySGLD(network, inner_steps),
        # closure optimizers on the torch network
        "torch SGD": OptimizerStep(network, lambda net: torch.optim.SGD(net.parameters(), **SGD), "sgd"),
        "SAM(SGD)": OptimizerStep(network, lambda net: SAM(net.parameters(), torch.optim.SGD, rho=RHO, **SGD),
                                  "closure"),
        "BayesianSAM": OptimizerStep(network, lambda net: BayesianSAM(net.parameters(), num_data=n, **BSAM),
                                     "closure"),
        "torch SAM(SGD)": OptimizerStep(network, lambda net: PlainSAM(
            list(net.parameters()), RHO, SGD["lr"], base=torch.optim.SGD, momentum=SGD["momentum"],
            second_pass=partial(batchnorm_statistics_kept, net)), "plain"),
        "torch bSAM": OptimizerStep(network, lambda net: PlainBSAM(
            list(net.parameters()), BSAM["lr"], n, BSAM["rho"], BSAM["prior_precision"],
            second_pass=partial(batchnorm_statistics_kept, net)), "plain"),
        # averaging: per collection
        "SWAGCollector.collect": Repeated(SWAGCollection(network), COLLECTIONS),
        "HWA.collect": Repeated(HWACollection(network), COLLECTIONS),
        "torch SWAG collection": Repeated(TorchMoments(list(network.make_net().parameters())), COLLECTIONS),
        "torch HWA collection": Repeated(TorchHWA(bbb), COLLECTIONS),
    }


def ratio_rows(inner_steps: int) -> list[tuple[str, str | None, str, str | None]]:
    """``(method, base, hand-written loop, the loop's base)`` of every row of the ratio table."""
    esgld = f"torch Entropy-SGLD (L={inner_steps})"
    return [
        ("Trace_ELBO (Pyro)", None, "torch BBB", None),
        ("TensorTrace_ELBO", "Trace_ELBO (Pyro)", "torch BBB", None),
        ("TensorTraceMeanField_ELBO", "TensorTrace_ELBO", "torch BBB", None),
        ("SharpnessAwareELBO", "TensorTrace_ELBO", "torch BBB-SAM", "torch BBB"),
        ("SharpnessAwareMeanFieldELBO", "TensorTraceMeanField_ELBO", "torch BBB-SAM", "torch BBB"),
        ("KLBallELBO (fisher)", "TensorTrace_ELBO", "torch KL-ball (fisher)", "torch BBB"),
        ("KLBallELBO (normalized_score)", "TensorTrace_ELBO", "torch KL-ball (normalized score)", "torch BBB"),
        ("SGLD", None, "torch SGLD", None),
        ("SGHMC", "SGLD", "torch SGHMC", "torch SGLD"),
        ("EntropyMCMC", "SGLD", "torch Entropy-MCMC", "torch SGLD"),
        (f"EntropySGD (L={inner_steps})", "SGLD", esgld, "torch SGLD"),
        (f"EntropySGLD (L={inner_steps})", "SGLD", esgld, "torch SGLD"),
        ("SAM(SGD)", "torch SGD", "torch SAM(SGD)", "torch SGD"),
        ("BayesianSAM", "SAM(SGD)", "torch bSAM", "torch SAM(SGD)"),
        ("BayesianSAM", "torch SGD", "torch bSAM", "torch SGD"),
        ("SWAGCollector.collect", "torch SGD", "torch SWAG collection", "torch SGD"),
        ("HWA.collect", "TensorTrace_ELBO", "torch HWA collection", "torch BBB"),
    ]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of every variant first")
    parser.add_argument("--inner-steps", type=int, default=5, help="L of EntropySGD / EntropySGLD")
    parser.add_argument("--width", type=int, default=64, help="ResNet-18's first-stage width (64: the network)")
    parser.add_argument("--num-data", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--packed", action="store_true", help="the latent weights packed in one site")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path(__file__).parent / "results" / f"resnet18_steps{'_packed' if args.packed else ''}.md"
    start = time.perf_counter()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)  # Pyro's checks and torch.distributions' argument checks, for every variant
    pyro.set_rng_seed(0)
    warnings.filterwarnings("ignore", "`torch.jit.trace` is deprecated", FutureWarning)
    network = Network("resnet18", width=args.width, num_data=args.num_data, batch=args.batch, packed=args.packed)
    timed = variants(network, args.inner_steps)
    checks = {f"{a} vs {b}": check_same_step(timed[a], timed[b]) for a, b in (
        ("TensorTrace_ELBO", "torch BBB"), ("SharpnessAwareELBO", "torch BBB-SAM"),
        ("KLBallELBO (fisher)", "torch KL-ball (fisher)"), ("KLBallELBO (normalized_score)",
                                                            "torch KL-ball (normalized score)"))}
    checks["SGLD vs torch SGLD"] = check_same_gradient(timed["SGLD"], timed["torch SGLD"])
    times = interleaved_times(timed, args.repeats, args.steps, warmup=args.warmup)
    med = medians_ms(times)
    lines = [
        "# Every objective, kernel and optimizer at ResNet-18 scale: against its base and a hand-written torch loop",
        "",
        f"{network.describe}; float32, Pyro's validation and torch.distributions' argument checks off for every "
        f"variant, eager. {args.repeats} repeats x {args.steps} steps per "
        f"variant after {args.warmup} untimed warm-up step(s), **all {len(timed)} variants interleaved in one run** "
        "(every variant in every repeat, the order reversed every other repeat, so that the drift of the shared "
        f"2-core machine, where another job may run, hits all alike), median over repeats. {environment()}",
        "",
        f"SVI: AutoNormal (init scale {INIT_SCALE}), `pyro.optim.Adam` 1e-3, rho {RHO}, KL radius {RADIUS}. Kernels: "
        f"one transition of `kernel.sample`, step size {STEP_SIZE}, friction {FRICTION}, eta {ETA}, "
        f"L = {args.inner_steps} inner steps (an Entropy-SGD/SGLD transition is L gradient evaluations; its "
        f"expected ratio to SGLD is about L). Optimizers on the torch network, closure = mean cross-entropy of one "
        f"minibatch: SGD (lr {SGD['lr']}, momentum {SGD['momentum']}), SAM(SGD) rho {RHO}, BayesianSAM {BSAM}. "
        f"Collections: SWAG rank {MAX_RANK}, {COLLECTIONS} calls per timed step, reported per call. Times are per "
        "SVI step, kernel transition, optimizer step or collection.",
        "",
        "| method | base | method / base | hand-written loop | method / loop | loop / its base |",
        "|---|---|---|---|---|---|",
    ]
    for method, base, loop, loop_base in ratio_rows(args.inner_steps):
        lines.append(
            f"| {method} | {base or '–'} | {f'{med[method] / med[base]:.2f}' if base else '–'} | {loop} | "
            f"{med[method] / med[loop]:.2f} | "
            f"{f'{med[loop] / med[loop_base]:.2f} ({loop_base})' if loop_base else '–'} |")
    lines += ["", "Same arithmetic, checked before timing (largest relative difference of the loss and the gradients, "
              "one step from the same seed; float32 rounding is about 1e-6 to 1e-5):", "",
              *[f"- {pair}: {value:.1e}" for pair, value in checks.items()]]
    lines += ["", *timing_rows(times), "", f"Wall time of the run: {time.perf_counter() - start:.0f} s."]
    return write_markdown(lines, out, __file__, argv)


if __name__ == "__main__":
    main()
