"""Step time of the SG-MCMC kernels inside ``pyro.infer.MCMC`` against plain-torch SGLD loops.

The model is the Bayesian MLP 64-256-256-10 on sklearn's digits (1257 training points, prior N(0, 1) on every
weight), minibatch 128 drawn inside the model by ``pyro.plate(subsample_size=128)``, float32, one thread. Variants,
interleaved inside every repeat (the machine is shared and noisy), median over repeats of the time per gradient step:

* ``MCMC(SGLD)``: ``MCMC(SGLD(model, ...), num_samples=n, warmup_steps=0).run(x, y, subsample_size=128)`` divided
  by n (the set-up trace is included, amortised over the n steps);
* ``SGLD.sample loop``: the same kernel applied to its own output by hand (no ``MCMC`` wrapper);
* ``MCMC(EntropyMCMC)``: SGLD on ``local_entropy(model, eta)`` (a second copy of the weights);
* ``MCMC(EntropySGLD, L)``: one draw per outer step of L inner steps; reported per outer step and per gradient
  evaluation;
* ``torch SGLD, same arithmetic``: the potential written with ``torch.func.functional_call`` and
  ``torch.distributions`` exactly as the Pyro model computes it (``Normal(0, 1).expand(shape)`` prior log density,
  ``Categorical(logits)`` likelihood scaled by N/B, indices from ``randperm``), autograd, the out-of-place Langevin
  update;
* ``torch SGLD, idiomatic``: what one would write by hand: ``nn.Sequential``, ``F.cross_entropy(sum) * N/B +
  |theta|^2 / 2``, in-place ``add_`` updates;
* ``torch Entropy-MCMC``: the idiomatic loop plus the anchor copy, the coupling term and the anchors' noise.

Run: ``python benchmarks/sgmcmc.py [--repeats 9] [--steps 100]``; writes ``benchmarks/results/sgmcmc.md``.
"""

import argparse
import math
import sys
from pathlib import Path

import pyro
import torch
import torch.nn.functional as F
from _timing import environment, interleaved_times, medians_ms
from pyro.infer import MCMC
from torch.func import functional_call

from pyro_flat.data import load_digits
from pyro_flat.infer.mcmc import SGLD, EntropyMCMC, EntropySGLD
from pyro_flat.nn import BayesianMLP, init_to_network
from pyro_flat.nn.bayesian import latent_init_values

HIDDEN = (256, 256)
BATCH = 128
STEP = 1e-5
ETA = 1e-3
INNER = 10


def _net():
    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN[0]), torch.nn.ReLU(), torch.nn.Linear(*HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN[1], 10))


class MCMCRun:
    """``steps`` gradient steps of a kernel inside ``pyro.infer.MCMC``."""

    def __init__(self, data, build, steps, steps_per_draw=1):
        self.data, self.build, self.steps, self.per_draw = data, build, steps, steps_per_draw
        self.units_per_step = steps  # one call runs `steps` gradient steps

    def __call__(self):
        model = BayesianMLP(64, 10, HIDDEN, packed=False).float()  # a site a tensor, as the torch baselines
        kernel = self.build(model)
        mcmc = MCMC(kernel, num_samples=self.steps // self.per_draw, warmup_steps=0, disable_progbar=True)
        mcmc.run(self.data.x_train, self.data.y_train, subsample_size=BATCH)


class KernelLoop:
    """The SGLD kernel applied to its own output by hand."""

    def __init__(self, data, steps):
        self.model = BayesianMLP(64, 10, HIDDEN, packed=False).float()
        self.kernel = SGLD(self.model, step_size=STEP, init_strategy=init_to_network(self.model))
        self.kernel.setup(0, data.x_train, data.y_train, subsample_size=BATCH)
        self.params = self.kernel.initial_params
        self.steps = self.units_per_step = steps

    def __call__(self):
        for _ in range(self.steps):
            self.params = self.kernel.sample(self.params)


class TorchSameArithmetic:
    """The Pyro model's potential written with torch.distributions and functional_call."""

    def __init__(self, data, steps):
        self.x, self.y, self.steps = data.x_train, data.y_train, steps
        self.units_per_step = steps
        self.n = len(self.x)
        self.net = _net()
        init = latent_init_values(BayesianMLP(64, 10, HIDDEN, packed=False).float())
        self.params = {name.replace("net.", "", 1): v.clone() for name, v in init.items()}
        self.params = {f"{int(k.split('.')[0]) - 1}.{k.split('.')[1]}": v for k, v in self.params.items()}

    def potential(self, params):
        idx = torch.randperm(self.n, device=self.x.device)[:BATCH]
        logits = functional_call(self.net, params, (self.x[idx],))
        log_lik = torch.distributions.Categorical(logits=logits).log_prob(self.y[idx]).sum() * (self.n / BATCH)
        log_prior = sum(
            torch.distributions.Independent(
                torch.distributions.Normal(torch.zeros((), dtype=v.dtype), torch.ones((), dtype=v.dtype)).expand(
                    v.shape), v.dim()).log_prob(v)
            for v in params.values())
        return -(log_lik + log_prior)

    def __call__(self):
        scale = math.sqrt(2 * STEP)
        for _ in range(self.steps):
            leaves = {k: v.detach().requires_grad_() for k, v in self.params.items()}
            grads = torch.autograd.grad(self.potential(leaves), list(leaves.values()))
            self.params = {k: torch.add(v, g, alpha=-STEP).add_(torch.randn_like(v), alpha=scale)
                           for (k, v), g in zip(leaves.items(), grads, strict=True)}


class TorchIdiomatic:
    """Hand-written SGLD (and, with ``entropy=True``, Entropy-MCMC) on an nn.Module with in-place updates."""

    def __init__(self, data, steps, entropy=False):
        self.x, self.y, self.steps, self.entropy = data.x_train, data.y_train, steps, entropy
        self.units_per_step = steps
        self.n = len(self.x)
        self.params = list(_net().parameters())
        self.net = torch.nn.Sequential(*_net())
        for p, q in zip(self.net.parameters(), self.params, strict=True):
            p.data.copy_(q.data)
        self.params = list(self.net.parameters())
        self.anchors = [p.detach().clone() for p in self.params]

    def __call__(self):
        scale = math.sqrt(2 * STEP)
        for _ in range(self.steps):
            idx = torch.randperm(self.n, device=self.x.device)[:BATCH]
            loss = F.cross_entropy(self.net(self.x[idx]), self.y[idx], reduction="sum") * (self.n / BATCH)
            loss = loss + 0.5 * sum((p * p).sum() for p in self.params)
            grads = torch.autograd.grad(loss, self.params)
            with torch.no_grad():
                for p, g, a in zip(self.params, grads, self.anchors, strict=True):
                    if self.entropy:
                        diff = (p - a) / ETA
                        a.add_(diff, alpha=STEP).add_(torch.randn_like(a), alpha=scale)
                        g = g + diff
                    p.add_(g, alpha=-STEP).add_(torch.randn_like(p), alpha=scale)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=100, help="gradient steps per timed block")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sgmcmc.md")
    args = parser.parse_args(argv)
    if args.steps < INNER or args.steps % INNER:
        parser.error(f"--steps must be a positive multiple of L = {INNER}, got {args.steps}")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)  # Pyro's checks and torch.distributions' argument checks, every variant
    pyro.set_rng_seed(0)
    data = load_digits(dtype=torch.float32)
    steps = args.steps
    variants = {
        "MCMC(SGLD)": MCMCRun(data, lambda m: SGLD(m, step_size=STEP, init_strategy=init_to_network(m)), steps),
        "SGLD.sample loop": KernelLoop(data, steps),
        "MCMC(EntropyMCMC)": MCMCRun(
            data, lambda m: EntropyMCMC(m, eta=ETA, step_size=STEP, init_strategy=init_to_network(m)), steps),
        f"MCMC(EntropySGLD, L={INNER})": MCMCRun(
            data, lambda m: EntropySGLD(m, eta=ETA, step_size=STEP, num_inner_steps=INNER,
                                        init_strategy=init_to_network(m)), steps, steps_per_draw=INNER),
        "torch SGLD, same arithmetic": TorchSameArithmetic(data, steps),
        "torch SGLD, idiomatic": TorchIdiomatic(data, steps),
        "torch Entropy-MCMC, idiomatic": TorchIdiomatic(data, steps, entropy=True),
    }
    times = interleaved_times(variants, args.repeats, 1, warmup=1)  # one call = `steps` gradient steps
    med = medians_ms(times)
    names = list(variants)
    sgld, same, idiom = med["MCMC(SGLD)"], med["torch SGLD, same arithmetic"], med["torch SGLD, idiomatic"]
    esgld = med[f"MCMC(EntropySGLD, L={INNER})"]
    rows = [
        "| variant | ms / gradient step (median) | min | max |",
        "|---|---|---|---|",
    ]
    for name in names:
        rows.append(f"| {name} | {med[name]:.3f} | {min(times[name]) * 1e3:.3f} | {max(times[name]) * 1e3:.3f} |")
    ratios = [
        ("MCMC(SGLD) / torch SGLD, same arithmetic", sgld / same, "<= 1.5"),
        ("MCMC(SGLD) / torch SGLD, idiomatic", sgld / idiom, "<= 1.5"),
        ("SGLD.sample loop / torch SGLD, idiomatic", med["SGLD.sample loop"] / idiom, ""),
        ("MCMC(EntropyMCMC) / MCMC(SGLD)", med["MCMC(EntropyMCMC)"] / sgld, "<= 1.15"),
        ("torch Entropy-MCMC / torch SGLD (idiomatic)", med["torch Entropy-MCMC, idiomatic"] / idiom, ""),
        (f"MCMC(EntropySGLD) outer step (L={INNER}) / MCMC(SGLD) step", esgld * INNER / sgld, f"~ {INNER}"),
    ]
    rows += ["", "| ratio | value | target |", "|---|---|---|"]
    rows += [f"| {name} | {value:.2f} | {target} |" for name, value, target in ratios]
    command = "python benchmarks/sgmcmc.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (
        f"# SG-MCMC step time\n\n`{command.strip()}`\n\n"
        f"MLP 64-256-256-10 on digits (N = 1257), batch {BATCH}, float32, 1 thread, {steps} gradient steps per timed "
        f"block, {args.repeats} interleaved repeats; {environment()}\n\n"
    )
    text = header + "\n".join(rows) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
