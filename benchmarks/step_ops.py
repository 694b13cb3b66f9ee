"""Operations and host reads per training step — the CPU proxies of what a step costs on a GPU — for every objective
and kernel, on its Bayesian network with one sample site per weight tensor and packed (``pyro_flat.nn.pack_latents``:
one site), against a hand-written torch step doing the same arithmetic.

On a GPU a step's time is set by the kernels it launches and the host reads that stall them, not by CPU arithmetic;
both are counted here on a CPU, deterministically, with a ``TorchDispatchMode``: **ops** is every ATen operation a step
dispatches (forward, backward, optimiser; ``launching`` leaves out views, which launch no kernel), **reads** every host
synchronisation (:class:`pyro_flat.testing.HostSyncCounter`: scalar reads, host copies, data-dependent shapes,
tensors made from Python data for a device; torch optimisers' host-resident step counters excluded).

Pyro steps: ``TensorSVI.step`` (``pyro.optim.Adam``, ``foreach=True`` as on a GPU) with Pyro's validation off —
MAP (``AutoDelta`` + ``TensorTrace_ELBO``), VI (``AutoNormal`` + ``TensorTrace_ELBO``), SAM (``AutoDelta`` +
``SharpnessAwareELBO(0.05)``), F-VI (``AutoNormal`` + ``SharpnessAwareELBO(0.05)``), KL ball (``AutoNormal`` +
``KLBallELBO(0.01)``); ``SGLD`` and ``EntropyMCMC`` kernel transitions. ``SVI.step`` makes one read more per step
(the float it hands back). Hand-written steps (``_svi_steps.py``, :class:`TorchSGLDStep`; log densities in closed
form; ``torch.optim.Adam``, ``foreach=True``): MAP, SAM, Bayes by backprop, + SAM, + the KL-ball step, SGLD; each per
tensor and packed (one flat vector viewed into the network: the same arithmetic as the packed Pyro step), the ratio
taken against the cheaper of the two. Before counting, each Pyro step and its hand-written steps are checked to draw
the same random numbers and compute the same loss and gradients (one step from the same seed; SGLD: the same
gradient and transition).

Run: ``python benchmarks/step_ops.py`` (MLP 64-256-256-10, batch 128, and ResNet-18 width 8, batch 16; about two
minutes; writes ``benchmarks/results/step_ops.md``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyro
import torch
import torch.nn.functional as F
from _report import write_markdown
from _svi_steps import (
    PyroStep,
    RandomDraws,
    TorchBBB,
    TorchMAP,
    check_same_draws,
    check_same_step,
    packed_torch,
)
from _timing import environment
from compiled import STEP_SIZE, Network
from kl_ball_elbo import RADIUS, TorchKLBall
from pyro.infer.autoguide import AutoDelta, AutoNormal
from sharpness_aware_elbo import RHO, TorchBBBSAM
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_flat.infer import KLBallELBO, SharpnessAwareELBO, TensorSVI, TensorTrace_ELBO
from pyro_flat.infer.mcmc import SGLD, EntropyMCMC
from pyro_flat.nn import init_to_network, pack_latents
from pyro_flat.testing import HostSyncCounter

ETA = 1e-3
GOALS = {"KL ball": 2.0}  # the ops-per-step goal against the hand-written step; 1.5 for the others
DEFAULT_GOAL = 1.5


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it (``ops``) and those that are not views (``launching``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.launching = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.launching += not func.is_view
        return func(*args, **(kwargs or {}))


@dataclass
class Count:
    ops: float
    launching: float
    reads: float


def count(step: Callable[[], object], steps: int = 2) -> Count:
    """Operations and host reads per call of ``step`` (after one warm-up call)."""
    step()
    with OpCounter() as ops:
        for _ in range(steps):
            step()
    with HostSyncCounter(depth=0) as reads:
        for _ in range(steps):
            step()
    return Count(ops.ops / steps, ops.launching / steps, reads.count / steps)


# ---------------------------------------------------------------------------------------------------------------------
# the steps


def pyro_model(network: Network, packed: bool):
    model = network.make_model()
    if packed:
        pack_latents(model.net)
    return model


def pyro_svi(network: Network, loss, guide_class: type, packed: bool) -> PyroStep:
    """One ``TensorSVI`` step (``pyro.optim.Adam`` with ``foreach=True``, as on a GPU)."""
    options = {} if guide_class is AutoDelta else {"init_scale": 1e-3}
    return PyroStep(pyro_model(network, packed), network.x, network.y, loss,
                    lambda model: guide_class(model, init_loc_fn=init_to_network(model), **options), network.batch,
                    svi_class=TensorSVI, foreach=True)


class KernelStep:
    """One transition of an SG-MCMC kernel (its ``sample`` on its own output)."""

    def __init__(self, network: Network, kernel: type, packed: bool, **options: object) -> None:
        model = pyro_model(network, packed)
        self.kernel = kernel(model, step_size=STEP_SIZE, init_strategy=init_to_network(model),
                             divergence_check_every=10**9, **options)
        self.kernel.setup(0, network.x, network.y, subsample_size=network.batch)
        self.params = self.kernel.initial_params

    def __call__(self) -> None:
        self.params = self.kernel.sample(self.params)


class TorchSGLDStep:
    """Hand-written SGLD on a list of weight tensors (per tensor or one packed vector): the potential
    ``F.cross_entropy(sum) * N/B + |w|^2 / 2`` (the N(0, 1) prior), its gradient, the Langevin update. :meth:`draw`
    draws the minibatch, then the noise, on the data's device (the kernel's order and generator); with
    ``compile_options`` the potential is ``torch.compile``'d (its forward and backward graphs, as
    ``jit_compile=True`` compiles the kernel's gradient evaluation), the draws and the update staying eager."""

    def __init__(self, x, y, params: list[torch.Tensor], forward: Callable, batch: int, *,
                 compile_options: dict | None = None) -> None:
        self.x, self.y, self.batch, self.forward = x, y, batch, forward
        self.params = [p.detach().clone() for p in params]
        self.noise_scale = (2 * STEP_SIZE) ** 0.5
        self.potential = self._potential if compile_options is None else torch.compile(self._potential,
                                                                                         **compile_options)

    def draw(self) -> tuple:
        idx = torch.randperm(len(self.x), device=self.x.device)[: self.batch]
        return idx, [torch.randn_like(p) for p in self.params]

    def _potential(self, weights: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        x, y = self.x[idx], self.y[idx]
        nll = F.cross_entropy(self.forward(weights, x), y, reduction="sum") * (len(self.x) / len(x))
        return nll + 0.5 * sum((w * w).sum() for w in weights)

    def transition(self, params: list[torch.Tensor], idx: torch.Tensor, noise: list[torch.Tensor]) -> list:
        leaves = [p.detach().requires_grad_() for p in params]
        grads = torch.autograd.grad(self.potential(leaves, idx), leaves)
        with torch.no_grad():
            moved = torch._foreach_add(leaves, grads, alpha=-STEP_SIZE)
            return torch._foreach_add(moved, noise, alpha=self.noise_scale)

    def __call__(self) -> None:
        self.params = self.transition(self.params, *self.draw())


def check_same_transition(kernel_step: KernelStep, torch_step: TorchSGLDStep, seed: int = 11) -> float:
    """The largest relative difference between an SGLD kernel and the hand-written SGLD step, from the same weights and
    seed (the same minibatch and noise): of the gradients of their potentials, and of one transition's moves
    ``new - old`` (which the noise dominates).

    :raises ValueError: if the two do not draw the same random numbers on the same devices (:func:`check_same_draws`).
    """
    start = {name: value.detach().clone() for name, value in kernel_step.params.items()}
    pyro.set_rng_seed(seed)
    leaves = [value.clone().requires_grad_() for value in start.values()]
    grads = torch.autograd.grad(kernel_step.kernel.potential_fn(dict(zip(start, leaves, strict=True))), leaves)
    pyro.set_rng_seed(seed)
    torch_leaves = [p.detach().clone().requires_grad_() for p in torch_step.params]
    torch_grads = torch.autograd.grad(torch_step.potential(torch_leaves, torch_step.draw()[0]), torch_leaves)
    pyro.set_rng_seed(seed)
    with RandomDraws() as kernel_draws:
        new = kernel_step.kernel.sample(start)
    pyro.set_rng_seed(seed)
    with RandomDraws() as torch_draws:
        draws = torch_step.draw()
    check_same_draws(kernel_draws.draws, torch_draws.draws)
    torch_new = torch_step.transition(torch_step.params, *draws)

    def flat(tensors) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    move, torch_move = flat(new[n] - start[n] for n in start), flat(torch_new) - flat(torch_step.params)
    return max(((flat(grads) - flat(torch_grads)).norm() / flat(torch_grads).norm()).item(),
               ((move - torch_move).norm() / torch_move.norm()).item())


def torch_step(network: Network, cls: type, packed: bool, **options: object) -> TorchBBB:
    params, forward = network.torch_params, network.torch_forward
    if packed:
        params, forward = packed_torch(params, forward)
    return cls(network.x, network.y, params, forward, network.batch, foreach=True, **options)


def torch_sgld(network: Network, packed: bool) -> TorchSGLDStep:
    params, forward = network.torch_params, network.torch_forward
    if packed:
        params, forward = packed_torch(params, forward)
    return TorchSGLDStep(network.x, network.y, params, forward, network.batch)


METHODS: dict[str, tuple] = {
    # name: (Pyro step factory (network, packed), hand-written class and options)
    "MAP": (lambda n, p: pyro_svi(n, TensorTrace_ELBO(), AutoDelta, p), TorchMAP, {}),
    "VI": (lambda n, p: pyro_svi(n, TensorTrace_ELBO(), AutoNormal, p), TorchBBB, {}),
    "SAM": (lambda n, p: pyro_svi(n, SharpnessAwareELBO(RHO), AutoDelta, p), TorchMAP, {"rho": RHO}),
    "F-VI": (lambda n, p: pyro_svi(n, SharpnessAwareELBO(RHO), AutoNormal, p), TorchBBBSAM, {}),
    "KL ball": (lambda n, p: pyro_svi(n, KLBallELBO(RADIUS), AutoNormal, p), TorchKLBall, {}),
    "SGLD": (lambda n, p: KernelStep(n, SGLD, p), "sgld", {}),
    "Entropy-MCMC": (lambda n, p: KernelStep(n, EntropyMCMC, p, eta=ETA), None, {}),
}


def measure(network: Network, methods: list[str], steps: int = 2) -> list[dict]:
    rows = []
    for name in methods:
        make_pyro, torch_cls, options = METHODS[name]
        row = {"method": name}
        for packed in (False, True):
            key = "packed" if packed else "per tensor"
            step = make_pyro(network, packed)
            hand = None
            if torch_cls == "sgld":
                hand = torch_sgld(network, packed)
                row[f"check {key}"] = check_same_transition(step, hand)  # from the same start, before any step
            elif torch_cls is not None:
                hand = torch_step(network, torch_cls, packed, **options)
                row[f"check {key}"] = check_same_step(step, hand)  # from the same start, before any step
            row[f"pyro {key}"] = count(getattr(step, "step", step), steps)
            if isinstance(step, PyroStep):
                row[f"svi reads {key}"] = count(lambda s=step: float(s.svi.step(s.x, s.y, subsample_size=s.batch)),
                                                1).reads
            if hand is not None:
                row[f"torch {key}"] = count(getattr(hand, "step", hand), steps)
        rows.append(row)
    return rows


def ratio(row: dict) -> float | None:
    """Packed Pyro ops per step / the cheaper hand-written step's."""
    torch_counts = [row[k].ops for k in ("torch per tensor", "torch packed") if k in row]
    return row["pyro packed"].ops / min(torch_counts) if torch_counts else None


def table(network: Network, rows: list[dict]) -> list[str]:
    lines = [
        f"## {network.describe}",
        "",
        "| step | Pyro per tensor: ops (launching) | Pyro packed: ops (launching) | torch per tensor | torch packed | "
        "packed / torch | goal | host reads: TensorSVI / SVI | same loss and gradients (max rel. diff.) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = ratio(row)
        goal = GOALS.get(row["method"], DEFAULT_GOAL)

        def fmt(key: str, row: dict = row) -> str:
            c = row.get(key)
            return "–" if c is None else f"{c.ops:.0f} ({c.launching:.0f})"

        reads = f"{row['pyro packed'].reads:.0f}" + (f" / {row['svi reads packed']:.0f}" if "svi reads packed" in row
                                                     else " (kernel)")
        checks = [row[k] for k in ("check per tensor", "check packed") if k in row]
        lines.append(
            f"| {row['method']} | {fmt('pyro per tensor')} | {fmt('pyro packed')} | {fmt('torch per tensor')} | "
            f"{fmt('torch packed')} | {'–' if r is None else f'{r:.2f}'} | "
            f"{'–' if r is None else f'≤ {goal}'} | {reads} | "
            f"{', '.join(f'{c:.1e}' for c in checks) or '–'} |"
        )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", nargs="+", default=["mlp", "resnet18"], choices=["mlp", "resnet18"])
    parser.add_argument("--width", type=int, default=8, help="ResNet-18's first-stage width (default 8)")
    parser.add_argument("--batch", type=int, default=16, help="ResNet-18's minibatch (default 16)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "step_ops.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)  # Pyro's checks and torch.distributions' argument checks, on both sides
    pyro.set_rng_seed(0)
    lines = ["# Operations and host reads per step", "", __doc__.split("\n\n")[1].replace("\n", " "), "",
             environment(), ""]
    for name in args.networks:
        network = Network(name, width=args.width, num_data=256, batch=args.batch)
        lines += table(network, measure(network, args.methods))
    return write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    main()

