"""Step time of SharpnessAwareELBO against Trace_ELBO and against plain-torch Bayes-by-backprop loops.

One SVI step on the MLP 64-256-256-10 of sklearn's digits (1257 training points), mean-field Gaussian guide, batch 128
drawn inside the model by ``pyro.plate(subsample_size=128)``, Adam, float32, one thread. Variants, interleaved inside
every repeat (the machine is shared and noisy), median over repeats:

* ``Trace_ELBO``: ``SVI(model, AutoNormal(model), Adam, Trace_ELBO())`` — the non-flat baseline;
* ``SharpnessAwareELBO``: the same with ``SharpnessAwareELBO(rho=0.05)`` (two forward/backward passes);
* ``torch BBB``: a hand-written Bayes-by-backprop step doing Trace_ELBO's arithmetic (sampled weights
  ``loc + softplus(s) * eps``, sampled log prior and log guide, N/B-scaled cross-entropy, one backward, Adam);
* ``torch BBB-SAM``: the same plus the SAM step on the sampled weights (gradient of the NLL in the weights, global
  norm, a second forward at the perturbed weights, the likelihood there, prior and guide at the sample) — the
  arithmetic of ``SharpnessAwareELBO``.

Two configurations: Pyro's defaults (validation on, ``AutoNormal``) and a fast one (validation off for every variant,
one flat latent vector with ``AutoDiagonalNormal``).

Run: ``python benchmarks/sharpness_aware_elbo.py [--repeats 15] [--steps 20]``; writes
``benchmarks/results/sharpness_aware_elbo.md``.
"""

import argparse
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_flat.data import load_digits
from pyro_flat.infer import SharpnessAwareELBO
from pyro_flat.nn import BayesianMLP, init_to_network
from pyro_flat.ops.sam import sam_perturbation

RHO = 0.05
HIDDEN = (256, 256)
BATCH = 128
LR = 1e-3


class PyroStep:
    """An SVI step in its own parameter-store scope (swapped in and out around each timed block, not per step)."""

    def __init__(self, data, loss, guide_class):
        self.data = data
        self.store = pyro.get_param_store()
        self.store.clear()
        self.model = BayesianMLP(64, 10, HIDDEN)
        guide = guide_class(self.model, init_loc_fn=init_to_network(self.model), init_scale=1e-3)
        self.svi = SVI(self.model, guide, pyro.optim.Adam({"lr": LR}), loss)
        self.step()  # sets the guide up (and compiles the JIT variants)
        self.state = self.store.get_state()

    def enter(self):
        self.store.clear()
        self.store.set_state(self.state)

    def exit(self):
        self.state = self.store.get_state()

    def step(self):
        self.svi.step(self.data.x_train, self.data.y_train, subsample_size=BATCH)


class TorchBBB:
    """Bayes by backprop written by hand; ``sam=True`` adds the SAM step on the sampled weights."""

    def __init__(self, data, sam):
        self.x, self.y, self.sam = data.x_train, data.y_train, sam
        self.num_data = len(self.x)
        net = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN[0]), torch.nn.ReLU(), torch.nn.Linear(*HIDDEN),
                                  torch.nn.ReLU(), torch.nn.Linear(HIDDEN[1], 10))
        inv_softplus = math.log(math.expm1(1e-3))
        self.locs = [p.detach().clone().requires_grad_() for p in net.parameters()]
        self.scales = [torch.full_like(p, inv_softplus).requires_grad_() for p in self.locs]
        self.optim = torch.optim.Adam(self.locs + self.scales, lr=LR)

    def enter(self):
        pass

    def exit(self):
        pass

    @staticmethod
    def forward(weights, x):
        w1, b1, w2, b2, w3, b3 = weights
        return F.linear(F.relu(F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)), w3, b3)

    def nll(self, weights, x, y):
        return F.cross_entropy(self.forward(weights, x), y, reduction="sum") * (self.num_data / len(x))

    def step(self):
        idx = torch.randperm(self.num_data)[:BATCH]
        x, y = self.x[idx], self.y[idx]
        scales = [F.softplus(s) for s in self.scales]
        weights = [m + s * torch.randn_like(m) for m, s in zip(self.locs, scales, strict=True)]
        log_prior = sum(torch.distributions.Normal(0.0, 1.0).log_prob(w).sum() for w in weights)
        log_q = sum(torch.distributions.Normal(m, s).log_prob(w).sum()
                    for w, m, s in zip(weights, self.locs, scales, strict=True))
        if self.sam:
            leaves = [w.detach().requires_grad_() for w in weights]
            grads = torch.autograd.grad(self.nll(leaves, x, y), leaves)
            eps = sam_perturbation(grads, RHO)
            nll = self.nll([w + e for w, e in zip(weights, eps, strict=True)], x, y)
        else:
            nll = self.nll(weights, x, y)
        loss = nll - log_prior + log_q
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()


def time_steps(variant, steps):
    variant.enter()
    start = time.perf_counter()
    for _ in range(steps):
        variant.step()
    elapsed = time.perf_counter() - start
    variant.exit()
    return elapsed / steps


CONFIGS = {
    # Pyro's defaults: validation on, one AutoNormal site per weight tensor
    "default": {"validation": True, "guide": AutoNormal},
    # the fast configuration: validation off (for every variant, torch loops included) and one flat latent vector
    "fast": {"validation": False, "guide": AutoDiagonalNormal},
}


def measure(data, config, repeats, steps):
    pyro.enable_validation(config["validation"])  # also torch.distributions' argument validation
    guide = config["guide"].__name__
    variants = {
        f"Trace_ELBO + {guide}": PyroStep(data, Trace_ELBO(), config["guide"]),
        f"SharpnessAwareELBO + {guide}": PyroStep(data, SharpnessAwareELBO(RHO), config["guide"]),
        "torch BBB": TorchBBB(data, sam=False),
        "torch BBB-SAM": TorchBBB(data, sam=True),
    }
    times = {name: [] for name in variants}
    for repeat in range(repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))  # alternate who runs first
        for name in order:
            times[name].append(time_steps(variants[name], steps))
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sharpness_aware_elbo.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.set_rng_seed(0)
    data = load_digits()
    command = "python benchmarks/sharpness_aware_elbo.py " + " ".join(sys.argv[1:])
    lines = [
        "# SharpnessAwareELBO step time",
        "",
        f"One SVI step, MLP 64-{HIDDEN[0]}-{HIDDEN[1]}-10 on digits, batch {BATCH}, mean-field Gaussian guide, Adam, "
        f"float32, 1 thread; {args.repeats} repeats x {args.steps} steps per variant, variants interleaved (order "
        "alternating), median.",
        f"torch {torch.__version__}, pyro {pyro.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, shared 2-core machine.",
    ]
    for config_name, config in CONFIGS.items():
        times = measure(data, config, args.repeats, args.steps)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        guide = config["guide"].__name__
        sa, base = med[f"SharpnessAwareELBO + {guide}"], med[f"Trace_ELBO + {guide}"]
        rows = [
            ("SharpnessAwareELBO / Trace_ELBO", sa / base, "≤ 2.1"),
            ("SharpnessAwareELBO / torch BBB-SAM", sa / med["torch BBB-SAM"], "≤ 1.5"),
            ("torch BBB-SAM / torch BBB (the SAM cost in plain torch)", med["torch BBB-SAM"] / med["torch BBB"], ""),
            ("Trace_ELBO / torch BBB (Pyro's own overhead)", base / med["torch BBB"], ""),
        ]
        lines += [
            "",
            f"## {config_name}: validation {'on' if config['validation'] else 'off'}, {guide}",
            "",
            "| variant | median step (ms) | min | max |",
            "|---|---|---|---|",
        ]
        for name, t in times.items():
            lines.append(f"| {name} | {med[name]:.2f} | {min(t) * 1e3:.2f} | {max(t) * 1e3:.2f} |")
        lines += ["", "| ratio | value | target |", "|---|---|---|"]
        lines += [f"| {name} | {value:.2f} | {target} |" for name, value, target in rows]
    lines += ["", "Command:", "", "```bash", command.strip(), "```", ""]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
