"""Step time of KLBallELBO (SA-BMA) against Trace_ELBO with the same guide and batch, and against plain-torch loops.

One SVI step on the MLP 64-256-256-10 of sklearn's digits (1257 training points), batch 128 drawn inside the model by
``pyro.plate(subsample_size=128)``, Adam, float32, one thread, Pyro's default validation. Variants, interleaved
inside every repeat (the machine is shared and noisy; the order alternates between repeats), median over repeats:

* ``Trace_ELBO`` with ``AutoNormal`` and with ``AutoLowRankPlusDiagonalNormal`` (rank 5) — the non-flat baselines;
* ``KLBallELBO`` (radius 0.01) with the same guides: Fisher direction (the paper) and, for ``AutoNormal``, the
  normalised-score direction (the authors' code);
* ``torch BBB``: hand-written Bayes by backprop for the mean-field Gaussian doing Trace_ELBO's arithmetic (sampled
  weights ``loc + softplus(u) * eps``, sampled log prior and log guide, N/B-scaled cross-entropy, one backward, Adam);
* ``torch KL-ball``: the same plus the KL-ball step — the gradient of the NLL in ``(loc, u)``, the closed-form
  Fisher-preconditioned perturbation, a second forward at ``(loc + d_loc) + softplus(u + d_u) * eps`` with the same
  ``eps``, the likelihood there and prior/guide at the unperturbed sample: the arithmetic of ``KLBallELBO``.

Run: ``python benchmarks/kl_ball_elbo.py [--repeats 15] [--steps 20]``; writes ``benchmarks/results/kl_ball_elbo.md``.
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
from pyro.infer.autoguide import AutoNormal

from pyro_flat.data import load_digits
from pyro_flat.infer import AutoLowRankPlusDiagonalNormal, KLBallELBO
from pyro_flat.nn import BayesianMLP, init_to_network
from pyro_flat.ops.fisher import diagonal_gaussian_inverse_fisher_product, kl_ball_step

RADIUS = 0.01
HIDDEN = (256, 256)
BATCH = 128
LR = 1e-3
RANK = 5


class PyroStep:
    """An SVI step in its own parameter-store scope (swapped in and out around each timed block, not per step)."""

    def __init__(self, data, loss, guide_factory):
        self.data = data
        self.store = pyro.get_param_store()
        self.store.clear()
        self.model = BayesianMLP(64, 10, HIDDEN)
        guide = guide_factory(self.model)
        self.svi = SVI(self.model, guide, pyro.optim.Adam({"lr": LR}), loss)
        self.step()  # sets the guide up
        self.state = self.store.get_state()

    def enter(self):
        self.store.clear()
        self.store.set_state(self.state)

    def exit(self):
        self.state = self.store.get_state()

    def step(self):
        self.svi.step(self.data.x_train, self.data.y_train, subsample_size=BATCH)


class TorchStep:
    """Mean-field Bayes by backprop written by hand; ``kl_ball=True`` adds the Fisher-preconditioned KL-ball step."""

    def __init__(self, data, kl_ball):
        self.x, self.y, self.kl_ball = data.x_train, data.y_train, kl_ball
        self.num_data = len(self.x)
        net = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN[0]), torch.nn.ReLU(), torch.nn.Linear(*HIDDEN),
                                  torch.nn.ReLU(), torch.nn.Linear(HIDDEN[1], 10))
        inv_softplus = math.log(math.expm1(1e-3))
        self.locs = [p.detach().clone().requires_grad_() for p in net.parameters()]
        self.raw_scales = [torch.full_like(p, inv_softplus).requires_grad_() for p in self.locs]
        self.optim = torch.optim.Adam(self.locs + self.raw_scales, lr=LR)

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
        scales = [F.softplus(u) for u in self.raw_scales]
        noise = [torch.randn_like(m) for m in self.locs]
        weights = [m + s * e for m, s, e in zip(self.locs, scales, noise, strict=True)]
        log_prior = sum(torch.distributions.Normal(0.0, 1.0).log_prob(w).sum() for w in weights)
        log_q = sum(torch.distributions.Normal(m, s).log_prob(w).sum()
                    for w, m, s in zip(weights, self.locs, scales, strict=True))
        nll = self.nll(weights, x, y)
        if self.kl_ball:
            grads = torch.autograd.grad(nll, self.locs + self.raw_scales, retain_graph=True)
            n = len(self.locs)
            directions = []
            for m_grad, u_grad, u, s in zip(grads[:n], grads[n:], self.raw_scales, scales, strict=True):
                directions.append(diagonal_gaussian_inverse_fisher_product(m_grad, u_grad, s.detach(),
                                                                           torch.sigmoid(u.detach())))
            steps = kl_ball_step(list(grads), [d[0] for d in directions] + [d[1] for d in directions], RADIUS)
            perturbed = [(m + dm) + F.softplus(u + du) * e for m, u, dm, du, e in
                         zip(self.locs, self.raw_scales, steps[:n], steps[n:], noise, strict=True)]
            nll = self.nll(perturbed, x, y)
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kl_ball_elbo.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.set_rng_seed(0)
    data = load_digits()

    def normal(model):
        return AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-3)

    def low_rank(model):
        return AutoLowRankPlusDiagonalNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-3, rank=RANK)

    variants = {
        "Trace_ELBO + AutoNormal": PyroStep(data, Trace_ELBO(), normal),
        "KLBallELBO (fisher) + AutoNormal": PyroStep(data, KLBallELBO(RADIUS), normal),
        "KLBallELBO (normalized_score) + AutoNormal": PyroStep(
            data, KLBallELBO(RADIUS, direction="normalized_score"), normal
        ),
        f"Trace_ELBO + AutoLowRankPlusDiagonalNormal (K={RANK})": PyroStep(data, Trace_ELBO(), low_rank),
        f"KLBallELBO (fisher) + AutoLowRankPlusDiagonalNormal (K={RANK})": PyroStep(data, KLBallELBO(RADIUS), low_rank),
        "torch BBB": TorchStep(data, kl_ball=False),
        "torch KL-ball": TorchStep(data, kl_ball=True),
    }
    times = {name: [] for name in variants}
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))  # alternate who runs first
        for name in order:
            times[name].append(time_steps(variants[name], args.steps))
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    lr = f"(K={RANK})"
    rows = [
        ("KLBallELBO (fisher) / Trace_ELBO, AutoNormal", med["KLBallELBO (fisher) + AutoNormal"],
         med["Trace_ELBO + AutoNormal"], "≤ 2.2"),
        ("KLBallELBO (normalized_score) / Trace_ELBO, AutoNormal", med["KLBallELBO (normalized_score) + AutoNormal"],
         med["Trace_ELBO + AutoNormal"], "≤ 2.2"),
        ("KLBallELBO (fisher) / Trace_ELBO, low-rank guide",
         med[f"KLBallELBO (fisher) + AutoLowRankPlusDiagonalNormal {lr}"],
         med[f"Trace_ELBO + AutoLowRankPlusDiagonalNormal {lr}"], "≤ 2.2"),
        ("KLBallELBO (fisher) + AutoNormal / torch KL-ball", med["KLBallELBO (fisher) + AutoNormal"],
         med["torch KL-ball"], "(Pyro's overhead on the flat step)"),
        ("torch KL-ball / torch BBB", med["torch KL-ball"], med["torch BBB"], "(the two-pass floor, ≈ 2)"),
        ("Trace_ELBO + AutoNormal / torch BBB", med["Trace_ELBO + AutoNormal"], med["torch BBB"],
         "(Pyro's overhead on the baseline)"),
    ]
    command = "python benchmarks/kl_ball_elbo.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# KLBallELBO step time",
        "",
        f"One SVI step, MLP 64-{HIDDEN[0]}-{HIDDEN[1]}-10 on digits, batch {BATCH}, Adam, float32, 1 thread, radius "
        f"{RADIUS}; {args.repeats} repeats x {args.steps} steps, variants interleaved (order alternating), median.",
        f"torch {torch.__version__}, pyro {pyro.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, shared 2-core machine.",
        "",
        "| variant | median step (ms) | min | max |",
        "|---|---|---|---|",
    ]
    for name, t in times.items():
        lines.append(f"| {name} | {med[name]:.2f} | {min(t) * 1e3:.2f} | {max(t) * 1e3:.2f} |")
    lines += ["", "| ratio | value | target |", "|---|---|---|"]
    for name, a, b, target in rows:
        lines.append(f"| {name} | {a / b:.2f} | {target} |")
    lines += ["", "Command:", "", "```bash", command.strip(), "```", ""]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
