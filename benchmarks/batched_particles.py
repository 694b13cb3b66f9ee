"""Batched particles (torch.func.vmap) against a Python loop over K chains / ensemble members, side by side.

For K in ``--particles`` (default 4 8 16) and two Bayesian MLPs on sklearn's digits (64-64-10 and 64-256-256-10), a
fixed minibatch of 128 with ``num_data=N``, float32, one thread; the time of advancing all K particles by one step:

* SGLD chains: K ``pyro_flat.infer.mcmc.SGLD`` kernels stepped one after the other (``kernel.sample``) against one
  ``BatchedSGLD.step``;
* ensemble members (MAP): K ``SVI(model, AutoDelta, Adam, Trace_ELBO)`` steps one after the other against one
  ``BatchedMAP.step`` (the same Adam arithmetic), and the SAM members (F-ensemble, ``rho=0.05``) of ``BatchedMAP``.

Every variant runs ``--steps`` steps per timed block; the variants alternate inside each of ``--repeats`` repeats
(order reversed every other repeat), median over repeats. Run: ``python benchmarks/batched_particles.py``; writes
``benchmarks/results/batched_particles.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyro
import torch
from _report import write_markdown
from _timing import environment, interleaved_times, medians_ms
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from pyro.nn import PyroModule
from torch import nn

from pyro_flat.data import load_digits
from pyro_flat.infer.mcmc import SGLD
from pyro_flat.infer.particles import BatchedMAP, BatchedSGLD, init_particles
from pyro_flat.nn import BayesianMLP, init_to_network

BATCH = 128
NETWORKS = {"MLP 64-64-10": (64,), "MLP 64-256-256-10": (256, 256)}


def variants(hidden: tuple[int, ...], k: int, x: torch.Tensor, y: torch.Tensor, n: int) -> dict:
    """name -> a function advancing K particles by one step."""
    pyro.clear_param_store()
    models = [BayesianMLP(64, 10, hidden, packed=False) for _ in range(k)]  # as in results/batched_particles.md
    particles, transforms = init_particles(models, x, y, init_strategy=[init_to_network(m) for m in models],
                                           num_data=n)
    model = models[0]
    kernels, states = [], []
    for j in range(k):
        kernel = SGLD(model, step_size=1e-5, init_strategy=init_to_network(models[j]))
        kernel.setup(0, x, y, num_data=n)
        kernels.append(kernel)
        states.append(kernel.initial_params)
    # one PyroModule container, so that each member's AutoDelta has its own parameter names ("members.j....")
    guides = PyroModule[nn.ModuleList]([AutoDelta(model, init_loc_fn=init_to_network(m)) for m in models])
    svis = [SVI(model, g, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO()) for g in guides]
    batched_sgld = BatchedSGLD(model, particles, step_size=1e-5, transforms=transforms)
    batched_map = BatchedMAP(model, particles, lr=1e-3, transforms=transforms)
    batched_sam = BatchedMAP(model, particles, lr=1e-3, rho=0.05, transforms=transforms)

    def loop_sgld() -> None:
        for j, kernel in enumerate(kernels):
            states[j] = kernel.sample(states[j])

    def loop_map() -> None:
        for svi in svis:
            svi.step(x, y, num_data=n)

    return {
        "SGLD: loop over K kernels": loop_sgld,
        "SGLD: BatchedSGLD": lambda: batched_sgld.step(x, y, num_data=n),
        "MAP: loop over K SVI(AutoDelta)": loop_map,
        "MAP: BatchedMAP": lambda: batched_map.step(x, y, num_data=n),
        "SAM members: BatchedMAP(rho=0.05)": lambda: batched_sam.step(x, y, num_data=n),
    }


def measure(fns: dict, repeats: int, steps: int) -> dict[str, float]:
    """Median ms per step of every variant (one warm-up step each: guide set-up, first vmap)."""
    return medians_ms(interleaved_times(fns, repeats, steps, warmup=1))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "batched_particles.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)  # Pyro's checks and torch.distributions' argument checks, every variant
    pyro.set_rng_seed(0)
    data = load_digits()
    x, y = data.x_train[:BATCH], data.y_train[:BATCH]
    lines = [
        "# Batched particles (vmap) vs a Python loop over K",
        "",
        f"Bayesian MLPs on digits, minibatch {BATCH} with num_data={data.num_data}, float32, one thread; ms to advance "
        f"all K particles by one step, median of {args.repeats} interleaved repeats x {args.steps} steps. "
        f"{environment()}",
        "",
        "| network | K | SGLD loop | BatchedSGLD | speed-up | MAP loop (SVI) | BatchedMAP | speed-up | "
        "BatchedMAP rho=0.05 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for network, hidden in NETWORKS.items():
        for k in args.particles:
            med = measure(variants(hidden, k, x, y, data.num_data), args.repeats, args.steps)
            sgld_loop, sgld_vmap = med["SGLD: loop over K kernels"], med["SGLD: BatchedSGLD"]
            map_loop, map_vmap = med["MAP: loop over K SVI(AutoDelta)"], med["MAP: BatchedMAP"]
            lines.append(
                f"| {network} | {k} | {sgld_loop:.2f} | {sgld_vmap:.2f} | {sgld_loop / sgld_vmap:.2f} | "
                f"{map_loop:.2f} | {map_vmap:.2f} | {map_loop / map_vmap:.2f} | "
                f"{med['SAM members: BatchedMAP(rho=0.05)']:.2f} |"
            )
    return write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    main()
