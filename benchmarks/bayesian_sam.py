"""Speed of a Bayesian SAM step against a SAM step and an Adam step, and the cost of SWAG collection.

Everything is timed side by side in one run: each repeat times every variant once (``--steps`` steps each) in turn,
so that the noise of the shared machine hits all variants alike; the table reports the median over repeats.

Two settings, both an MLP 64-256-256-10 on digits with minibatches of 128 (the step-time benchmarks' network):

* **torch network** — the optimizers on a plain ``nn.Sequential`` with a cross-entropy closure, next to
  hand-written plain-torch loops doing the same arithmetic (the reference for the optimizer's own overhead).
* **Pyro model** — the optimizers on the parameters of an ``AutoDelta`` guide of ``BayesianMLP``, the closure being
  the mean NLL of the minibatch through ``model_loss_fn(model, x_B, y_B)(guide())`` (the harness's ``bsam`` form),
  next to Pyro's own ``SVI`` + ``Trace_ELBO`` Adam step (the ``map`` baseline).

SWAG: ``SWAGCollector.collect`` of the full weight dict (K = 20 columns) per call; it runs once per epoch, so the
per-step overhead is the per-call cost divided by the steps per epoch (10 on digits).

Run: ``python benchmarks/bayesian_sam.py [--repeats 15 --steps 20]``; writes ``benchmarks/results/bayesian_sam.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pyro
import torch
from _timing import environment, interleaved_times, medians_ms
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_flat.data import load_digits
from pyro_flat.infer.autoguide import SWAGCollector
from pyro_flat.metrics import model_loss_fn
from pyro_flat.nn import BayesianMLP, init_to_network
from pyro_flat.optim import SAM, BayesianSAM

HIDDEN = (256, 256)
BATCH = 128


def make_net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers, width = [], 64
    for h in HIDDEN:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------------------------------
# plain-torch references: the same arithmetic written out by hand
# ---------------------------------------------------------------------------------------------------------------------


class PlainSAM:
    """SAM around a torch optimizer (default Adam), written out: grad, global norm, perturb, grad (inside
    ``second_pass()``, e.g. with BatchNorm's running statistics kept), restore, base step."""

    def __init__(self, params: list[torch.Tensor], rho: float, lr: float, *, base: type = torch.optim.Adam,
                 second_pass: Callable[[], AbstractContextManager] = nullcontext, **base_kwargs: object) -> None:
        self.params, self.rho, self.second_pass = params, rho, second_pass
        self.base = base(params, lr=lr, **base_kwargs)

    def step(self, loss_fn) -> None:
        for p in self.params:
            p.grad = None
        loss_fn().backward()
        with torch.no_grad():
            norm = torch.sqrt(sum((p.grad**2).sum() for p in self.params))
            eps = [self.rho * p.grad / (norm + 1e-12) for p in self.params]
            for p, e in zip(self.params, eps, strict=True):
                p.add_(e)
        for p in self.params:
            p.grad = None
        with self.second_pass():
            loss_fn().backward()
        with torch.no_grad():
            for p, e in zip(self.params, eps, strict=True):
                p.sub_(e)
        self.base.step()


class PlainBSAM:
    """bSAM written out with per-tensor loops (github.com/team-approx-bayes/bayesian-sam, optim.py); the second
    gradient inside ``second_pass()``."""

    def __init__(self, params: list[torch.Tensor], lr: float, n: int, rho: float, prior: float, *,
                 second_pass: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.params, self.lr, self.n, self.rho, self.delta = params, lr, n, rho, prior / n
        self.second_pass = second_pass
        self.gm = [torch.zeros_like(p) for p in params]
        self.s = [torch.ones_like(p) for p in params]

    def step(self, loss_fn) -> None:
        with torch.no_grad():
            m = [p.detach().clone() for p in self.params]
            for p, mi, si in zip(self.params, m, self.s, strict=True):
                p.copy_(mi + torch.randn_like(mi) / torch.sqrt(self.n * si))
        for p in self.params:
            p.grad = None
        loss_fn().backward()
        with torch.no_grad():
            g = [p.grad for p in self.params]
            for p, mi, gi, si in zip(self.params, m, g, self.s, strict=True):
                p.copy_(mi + self.rho * gi / si)
        for p in self.params:
            p.grad = None
        with self.second_pass():
            loss_fn().backward()
        with torch.no_grad():
            for i, p in enumerate(self.params):
                gs = torch.sqrt(self.s[i] * g[i] ** 2)
                self.gm[i].mul_(0.9).add_(p.grad + self.delta * m[i], alpha=0.1)
                p.copy_(m[i] - self.lr * self.gm[i] / self.s[i])
                self.s[i].mul_(0.999).add_(gs + 0.1 + self.delta, alpha=0.001)


# ---------------------------------------------------------------------------------------------------------------------
# the variants
# ---------------------------------------------------------------------------------------------------------------------


def torch_variants(x: torch.Tensor, y: torch.Tensor) -> dict[str, callable]:
    n = len(x)
    idx = torch.randperm(n, device=x.device)[:BATCH]
    xb, yb = x[idx], y[idx]
    nets = {name: make_net(0) for name in ("adam", "sam", "bsam", "plain_sam", "plain_bsam", "plain_adam")}

    def closure_for(net):
        def closure():
            loss = torch.nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            return loss

        return closure

    def loss_for(net):
        return lambda: torch.nn.functional.cross_entropy(net(xb), yb)

    adam = torch.optim.Adam(nets["adam"].parameters(), lr=1e-3)
    sam = SAM(nets["sam"].parameters(), torch.optim.Adam, rho=0.05, lr=1e-3)
    bsam = BayesianSAM(nets["bsam"].parameters(), lr=0.5, num_data=n, rho=0.05, prior_precision=1.0)
    plain_adam = torch.optim.Adam(nets["plain_adam"].parameters(), lr=1e-3)
    plain_sam = PlainSAM(list(nets["plain_sam"].parameters()), 0.05, 1e-3)
    plain_bsam = PlainBSAM(list(nets["plain_bsam"].parameters()), 0.5, n, 0.05, 1.0)

    def plain_adam_step():
        plain_adam.zero_grad()
        loss_for(nets["plain_adam"])().backward()
        plain_adam.step()

    def adam_step():
        adam.zero_grad()
        adam.step(closure_for(nets["adam"]))

    collector = SWAGCollector(max_rank=20)
    weights = dict(nets["adam"].named_parameters())

    return {
        "torch: plain Adam loop": plain_adam_step,
        "torch: Adam (torch.optim.Adam, closure)": adam_step,
        "torch: plain SAM loop": lambda: plain_sam.step(loss_for(nets["plain_sam"])),
        "torch: SAM(Adam)": lambda: sam.step(closure_for(nets["sam"])),
        "torch: plain bSAM loop": lambda: plain_bsam.step(loss_for(nets["plain_bsam"])),
        "torch: BayesianSAM": lambda: bsam.step(closure_for(nets["bsam"])),
        "torch: SWAGCollector.collect (one call)": lambda: collector.collect(weights),
    }


def pyro_variants(x: torch.Tensor, y: torch.Tensor) -> dict[str, callable]:
    n = len(x)
    idx = torch.randperm(n, device=x.device)[:BATCH]
    xb, yb = x[idx], y[idx]
    out = {}
    guides = {}
    for name in ("svi", "adam", "sam", "bsam"):
        pyro.clear_param_store()
        torch.manual_seed(0)
        model = BayesianMLP(64, 10, HIDDEN, packed=False)  # a site a tensor, as measured in results/bayesian_sam.md
        guide = AutoDelta(model, init_loc_fn=init_to_network(model))
        guide(xb[:2], yb[:2])
        guides[name] = (model, guide)

    model, guide = guides["svi"]
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    out["pyro: SVI Trace_ELBO + Adam (the map baseline)"] = lambda: svi.step(x, y, subsample_size=BATCH)

    def closure_for(model, guide):
        nll = model_loss_fn(model, xb, yb, num_data=n)

        def closure():
            loss = nll(guide())
            loss.backward()
            return loss

        return closure

    m, g = guides["adam"]
    adam = torch.optim.Adam(g.parameters(), lr=1e-3)

    def adam_step():
        adam.zero_grad()
        adam.step(closure_for(m, g))

    out["pyro: Adam (AutoDelta params, NLL closure)"] = adam_step
    m2, g2 = guides["sam"]
    sam = SAM(g2.parameters(), torch.optim.Adam, rho=0.05, lr=1e-3)
    out["pyro: SAM(Adam) (AutoDelta params, NLL closure)"] = lambda: sam.step(closure_for(m2, g2))
    m3, g3 = guides["bsam"]
    bsam = BayesianSAM(g3.parameters(), lr=0.5, num_data=n, rho=0.05, prior_precision=1.0)
    out["pyro: BayesianSAM (AutoDelta params, NLL closure)"] = lambda: bsam.step(closure_for(m3, g3))
    collector = SWAGCollector(max_rank=20)
    out["pyro: SWAGCollector.collect(guide.median())"] = lambda: collector.collect(g.median())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bayesian_sam.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pyro.enable_validation(False)  # Pyro's checks and torch.distributions' argument checks, for every variant
    data = load_digits().to(dtype=torch.float32)
    variants = {**torch_variants(data.x_train, data.y_train), **pyro_variants(data.x_train, data.y_train)}
    # 25 warm-up steps (the SWAG buffers fill up to K = 20)
    times = interleaved_times(variants, args.repeats, args.steps, warmup=25)
    median = medians_ms(times)

    def ratio(a: str, b: str) -> str:
        return f"{median[a] / median[b]:.2f}"

    rows = [
        ("torch: BayesianSAM", "torch: SAM(Adam)", "torch: plain bSAM loop"),
        ("torch: SAM(Adam)", "torch: Adam (torch.optim.Adam, closure)", "torch: plain SAM loop"),
        ("torch: Adam (torch.optim.Adam, closure)", None, "torch: plain Adam loop"),
        ("pyro: BayesianSAM (AutoDelta params, NLL closure)", "pyro: SAM(Adam) (AutoDelta params, NLL closure)", None),
        ("pyro: SAM(Adam) (AutoDelta params, NLL closure)", "pyro: Adam (AutoDelta params, NLL closure)", None),
        ("pyro: Adam (AutoDelta params, NLL closure)", "pyro: SVI Trace_ELBO + Adam (the map baseline)", None),
    ]
    lines = [
        "# Bayesian SAM, SAM and Adam steps; SWAG collection",
        "",
        f"Command: `python benchmarks/bayesian_sam.py --repeats {args.repeats} --steps {args.steps} "
        f"--threads {args.threads}`",
        "",
        f"MLP 64-{'-'.join(map(str, HIDDEN))}-10 on digits (N = {data.num_data}), minibatch {BATCH}, float32, "
        f"{environment()} Median over {args.repeats} interleaved repeats of {args.steps} steps; m-sharpness 1.",
        "",
        "| variant | ms / step | ratio to the row's baseline | ratio to plain torch |",
        "|---|---|---|---|",
    ]
    for name, base, plain in rows:
        lines.append(f"| {name} | {median[name]:.3f} | {ratio(name, base) + ' (' + base + ')' if base else '–'} | "
                     f"{ratio(name, plain) if plain else '–'} |")
    spe = -(-data.num_data // BATCH)
    for name in ("torch: SWAGCollector.collect (one call)", "pyro: SWAGCollector.collect(guide.median())"):
        step = "torch: Adam (torch.optim.Adam, closure)" if name.startswith("torch") else \
            "pyro: SVI Trace_ELBO + Adam (the map baseline)"
        lines.append(f"| {name} | {median[name]:.3f} | {ratio(name, step)} of one Adam step per call; "
                     f"{median[name] / spe / median[step] * 100:.2f} % per step when collected once per epoch "
                     f"({spe} steps) | – |")
    lines += ["", "All medians (ms / step):", ""]
    lines += [f"- {name}: {median[name]:.3f} (min {min(times[name]) * 1e3:.3f}, max {max(times[name]) * 1e3:.3f})"
              for name in variants]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
