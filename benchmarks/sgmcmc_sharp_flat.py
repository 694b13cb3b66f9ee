"""Entropy-MCMC's synthetic claim: on a 2-D mixture with a sharp and a flat mode, started in the sharp mode, which
samplers reach the flat mode within a fixed gradient budget?

Target: :class:`pyro_flat.data.SharpFlatEnergy` (defaults: sharp component N((-2, 0), 0.15^2 I), flat component
N((2, 0), I), half the mass each). Every chain starts at the sharp mode (-2, 0) and may spend ``--budget`` gradient
evaluations. Methods (all at temperature 1, through ``pyro.infer.MCMC`` with a ``potential_fn`` summed over
``--chains`` independent chains, so the chains run vectorised):

* SGLD, step ``--step``;
* Entropy-SGD and Entropy-SGLD (L = 20 inner steps of size ``--step`` per outer step, outer step eta, i.e.
  x <- mu (+ noise); and with the outer step L * step, the time covered by the inner chain);
* Entropy-MCMC, step ``--step``, coupling ``--eta``; both theta and theta_a are reported.

Reported: the fraction of draws (after the first 10 % of the budget) in the flat basin, i.e. closer (Euclidean) to
the flat mode's centre than to the sharp one's (first coordinate > 0), mean and standard error over chains, the
fraction of chains that ever reached it, and the first gradient evaluation at which a chain's draw was there (median
over the chains that reached it); a trace plot of one chain and a scatter of the final draws. (``SharpFlatEnergy
.in_flat_mode`` measures distances in units of each component's scale, which labels any point 4 sharp standard
deviations away from the sharp centre "flat": right for exact draws, wrong for the smoothed variables theta_a and
x, which spread around the sharp mode with variance eta.) The exact answers at stationarity are 48.9 % for theta (the
target itself, which is also the theta-marginal of Entropy-MCMC) and, for eta = 0.5, 47.6 % for theta_a and for
Entropy-SGLD's x (the target convolved with N(0, eta I)); a flat bias is a finite-budget effect.

Run: ``python benchmarks/sgmcmc_sharp_flat.py [--smoke]``; writes ``results/sgmcmc/sharp_flat.{md,json,png}``.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import matplotlib
import pyro
import torch
from pyro.infer import MCMC

from pyro_flat.data import SharpFlatEnergy
from pyro_flat.infer.mcmc import SGLD, EntropyMCMC, EntropySGD, EntropySGLD

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

INNER = 20


class Potential:
    """U summed over chains: params["x"] is [chains, 2]."""

    def __init__(self, energy):
        self.energy = energy

    def __call__(self, params):
        return self.energy.potential(params["x"]).sum()


def run(name, kernel, start, budget, steps_per_draw):
    num_draws = budget // steps_per_draw
    mcmc = MCMC(kernel, num_samples=num_draws, warmup_steps=0, initial_params={"x": start}, disable_progbar=True)
    t0 = time.perf_counter()
    mcmc.run()
    seconds = time.perf_counter() - t0
    samples = mcmc.get_samples()  # {site: [draws, chains, 2]}
    grad_evals = torch.arange(1, num_draws + 1) * steps_per_draw
    return {"name": name, "samples": samples, "grad_evals": grad_evals, "seconds": seconds}


def summarise(energy, draws, grad_evals, budget):
    """Flat-basin statistics of draws [num_draws, chains, 2]."""
    keep = grad_evals > budget // 10
    to_flat = (draws - energy.flat_mode).norm(dim=-1)
    to_sharp = (draws - energy.sharp_mode).norm(dim=-1)
    flat = (to_flat < to_sharp).double()  # [draws, chains]
    per_chain = flat[keep].mean(0)
    reached = flat.any(0)
    first = torch.where(flat.bool(), grad_evals[:, None].expand_as(flat), torch.full_like(flat, float("inf")))
    first = first.min(0).values
    chains = per_chain.numel()
    return {
        "flat_fraction": float(per_chain.mean()),
        "flat_fraction_se": float(per_chain.std() / chains**0.5),
        "chains_reaching_flat": float(reached.double().mean()),
        "median_first_flat_grad_eval": float(first[reached].median()) if reached.any() else None,
    }


def _smoothed_flat_mass(energy, eta):
    """P(first coordinate > 0) under the target convolved with N(0, eta I)."""
    normal = torch.distributions.Normal(0.0, 1.0)
    w = energy.sharp_weight
    sharp = 1 - normal.cdf(-energy.sharp_mode[0] / (energy.sharp_scale**2 + eta) ** 0.5)
    flat = 1 - normal.cdf(-energy.flat_mode[0] / (energy.flat_scale**2 + eta) ** 0.5)
    return float(w * sharp + (1 - w) * flat)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=10_000, help="gradient evaluations per chain")
    parser.add_argument("--chains", type=int, default=100)
    parser.add_argument("--step", type=float, default=1e-3)
    parser.add_argument("--eta", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="", help="suffix of the output files")
    parser.add_argument("--smoke", action="store_true", help="a tiny run (CI)")
    parser.add_argument("--out", type=Path, default=Path("results/sgmcmc"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.budget, args.chains = 400, 4
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.set_rng_seed(args.seed)
    energy = SharpFlatEnergy()
    potential = Potential(energy)
    start = energy.sharp_mode.expand(args.chains, 2).clone()
    eta, step, budget = args.eta, args.step, args.budget
    runs = [
        run("SGLD", SGLD(potential_fn=potential, step_size=step, thinning=INNER), start, budget, INNER),
        run("Entropy-SGD", EntropySGD(potential_fn=potential, eta=eta, step_size=step, num_inner_steps=INNER),
            start, budget, INNER),
        run("Entropy-SGLD", EntropySGLD(potential_fn=potential, eta=eta, step_size=step, num_inner_steps=INNER),
            start, budget, INNER),
        run("Entropy-SGD (outer step L eps)", EntropySGD(potential_fn=potential, eta=eta, step_size=step,
                                                         num_inner_steps=INNER, outer_step_size=INNER * step),
            start, budget, INNER),
        run("Entropy-SGLD (outer step L eps)", EntropySGLD(potential_fn=potential, eta=eta, step_size=step,
                                                           num_inner_steps=INNER, outer_step_size=INNER * step),
            start, budget, INNER),
        run("Entropy-MCMC", EntropyMCMC(potential_fn=potential, eta=eta, step_size=step, collect="both",
                                        thinning=INNER), start, budget, INNER),
    ]
    rows, record = [], {"args": {k: str(v) for k, v in vars(args).items()}, "methods": {}}
    for r in runs:
        sites = [("x", r["name"])] + ([("x_anchor", r["name"] + " (theta_a)")] if "x_anchor" in r["samples"] else [])
        if r["name"] == "Entropy-MCMC":
            sites[0] = ("x", "Entropy-MCMC (theta)")
        for site, label in sites:
            stats = summarise(energy, r["samples"][site], r["grad_evals"], budget)
            stats["seconds"] = r["seconds"]
            record["methods"][label] = stats
            first = stats["median_first_flat_grad_eval"]
            rows.append(
                f"| {label} | {100 * stats['flat_fraction']:.1f} ± {100 * stats['flat_fraction_se']:.1f} | "
                f"{100 * stats['chains_reaching_flat']:.0f} | {'-' if first is None else f'{first:.0f}'} | "
                f"{r['seconds']:.1f} |"
            )
    command = "python benchmarks/sgmcmc_sharp_flat.py " + " ".join(sys.argv[1:] if argv is None else argv)
    table = (
        f"`{command.strip()}`\n\n"
        f"SharpFlatEnergy (sharp N((-2,0), 0.15²I), flat N((2,0), I), equal mass), start at the sharp mode, "
        f"{args.chains} chains, budget {budget} gradient evaluations per chain, step {step}, eta {eta}, T = 1, "
        f"Entropy-SGD/SGLD with L = {INNER}; one draw every {INNER} gradient evaluations; the first 10 % dropped. "
        f"Flat basin: closer to (2, 0) than to (-2, 0); exact fraction at stationarity 48.9 % for theta, "
        f"{100 * _smoothed_flat_mass(energy, eta):.1f} % for theta_a and Entropy-SGLD's x.\n\n"
        "| method | % draws in the flat basin (± se over chains) | % chains that reached it | median first "
        "gradient evaluation in it | seconds |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = ("_smoke" if args.smoke else "") + (f"_{args.tag}" if args.tag else "")
    (args.out / f"sharp_flat{suffix}.md").write_text(table)
    (args.out / f"sharp_flat{suffix}.json").write_text(json.dumps(record, indent=2))
    plot(energy, runs, args.out / f"sharp_flat{suffix}.png")


def plot(energy, runs, path):
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    ax = axes[0]
    colors = {"SGLD": "C0", "Entropy-SGD": "C1", "Entropy-SGLD": "C2", "Entropy-MCMC": "C3"}
    runs = [r for r in runs if r["name"] in colors]
    for r in runs:
        evals = r["grad_evals"]
        ax.plot(evals, r["samples"]["x"][:, 0, 0], color=colors[r["name"]], lw=0.8,
                label=r["name"] + (" theta" if r["name"] == "Entropy-MCMC" else ""))
        if "x_anchor" in r["samples"]:
            ax.plot(evals, r["samples"]["x_anchor"][:, 0, 0], color=colors[r["name"]], lw=0.8, ls="--",
                    label="Entropy-MCMC theta_a")
    ax.axhline(-2, color="k", lw=0.5, ls=":")
    ax.axhline(2, color="k", lw=0.5, ls=":")
    ax.set_xlabel("gradient evaluations")
    ax.set_ylabel("first coordinate of chain 0 (sharp mode -2, flat mode +2)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("trace of one chain")
    ax = axes[1]
    grid = torch.linspace(-4, 5, 200)
    xx, yy = torch.meshgrid(grid, torch.linspace(-3.5, 3.5, 160), indexing="xy")
    logp = energy.log_prob(torch.stack([xx, yy], -1))
    ax.contour(xx, yy, logp.clamp(min=-12), levels=15, cmap="Greys", linewidths=0.6)
    for r in runs:
        last = r["samples"]["x"][-1]
        ax.scatter(last[:, 0], last[:, 1], s=8, color=colors[r["name"]], label=r["name"], alpha=0.7)
    ax.set_title("final draw of every chain")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
