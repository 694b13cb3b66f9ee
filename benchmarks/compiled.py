"""Step time of the flat objectives and kernels, eager and compiled, against hand-written torch steps, eager and
compiled.

The ratios of issue 14, measured side by side in one run (every variant timed in every repeat, the order alternating,
median over repeats), for one network:

* ``--network mlp``: the MLP 64-256-256-10 on sklearn's digits (1257 training points), minibatch 128;
* ``--network resnet18``: ResNet-18 with the CIFAR stem (3x3 stride-1 first convolution, no max-pool; BatchNorm),
  all 11.2 M weights latent, on CIFAR-shaped synthetic data (1024 points, 3x32x32, 10 classes: nothing downloads),
  minibatch 32.

Variants (float32, one thread, Pyro's validation and torch.distributions' argument checks off on every side, so that
no baseline is handicapped; each hand-written step is checked first to compute its Pyro step's loss and gradients from
the same seed): SVI steps with ``AutoNormal`` and ``pyro.optim.Adam`` — ``Trace_ELBO`` and Pyro's
``JitTrace_ELBO``, ``SharpnessAwareELBO`` (rho 0.05) and ``JitSharpnessAwareELBO``, ``KLBallELBO`` (radius 0.01,
Fisher direction) and ``JitKLBallELBO``; the SA-ELBO also with ``torch.optim.Adam`` on Pyro's ``ELBOModule`` (one
optimiser instead of Pyro's one per parameter); the hand-written torch steps doing the same arithmetic as a user
writes them (Bayes by backprop, + SAM, + the KL-ball step, see ``_svi_steps.py``: log densities in closed form, fused
Adam), eager and with their loss ``torch.compile``'d in one graph (inner gradients by ``torch.func.grad``, random
numbers drawn eagerly: the compiled hand-written step is the limit a compiled Pyro step can reach); SGLD eager and
with ``jit_compile=True``, as the kernel's ``sample`` applied to its own output and (MLP only) inside
``pyro.infer.MCMC`` (one ``MCMC.run`` of ``--draws`` gradient steps per timed step, its set-up included, every step
kept as a draw or every 10th), and an idiomatic hand-written torch SGLD loop (``nn.Module``, ``F.cross_entropy``,
in-place updates), eager and with ``torch.compile(net)``.

The warm-up (``--warmup`` steps, untimed) includes each compiled variant's capture and compilation, reported beside
the step times. ``--packed`` packs the network's latent weights into one site (``pyro_flat.nn.pack_latents``) and the
hand-written steps' weights into one vector alike.

Run: ``python benchmarks/compiled.py --network mlp`` (writes ``benchmarks/results/compiled_mlp.md``) and
``python benchmarks/compiled.py --network resnet18 --repeats 3 --steps 2`` (``compiled_resnet18.md``).
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import pyro
import torch
import torch.nn.functional as F
from _report import write_markdown
from _svi_steps import INIT_SCALE, Network, TorchBBB, check_same_step
from _timing import environment, fresh_compile_cache, interleaved_times, medians_ms, timing_rows, warm_up
from kl_ball_elbo import RADIUS, TorchKLBall
from pyro.infer import MCMC, JitTrace_ELBO, Trace_ELBO
from sharpness_aware_elbo import RHO, TorchBBBSAM

from pyro_flat.infer import (
    JitKLBallELBO,
    JitSharpnessAwareELBO,
    KLBallELBO,
    SharpnessAwareELBO,
)
from pyro_flat.infer.mcmc import SGLD
from pyro_flat.nn import init_to_network

STEP_SIZE = 1e-6


class TorchSGLD:
    """Idiomatic hand-written SGLD: ``nn.Module`` forward, ``F.cross_entropy(sum) * N/B + |theta|^2 / 2`` (the N(0, 1)
    prior), autograd, in-place Langevin updates; with ``compile_options`` the network is ``torch.compile(net,
    **compile_options)``, as a user compiles it. Subclasses (the other kernels' loops) replace :meth:`update`."""

    def __init__(self, network: Network, compile_options: dict | None = None) -> None:
        self.x, self.y, self.batch = network.x, network.y, network.batch
        self.net = network.make_net()
        self.params = list(self.net.parameters())
        self.model = self.net if compile_options is None else torch.compile(self.net, **compile_options)
        self.noise_scale = math.sqrt(2 * STEP_SIZE)

    def gradients(self) -> tuple[torch.Tensor, ...]:
        """The gradient of the minibatch potential at the network's weights (a fresh minibatch)."""
        idx = torch.randperm(len(self.x), device=self.x.device)[: self.batch]
        loss = F.cross_entropy(self.model(self.x[idx]), self.y[idx], reduction="sum") * (len(self.x) / self.batch)
        loss = loss + 0.5 * sum((p * p).sum() for p in self.params)
        return torch.autograd.grad(loss, self.params)

    @torch.no_grad()
    def update(self, grads: tuple[torch.Tensor, ...]) -> None:
        for p, g in zip(self.params, grads, strict=True):
            p.add_(g, alpha=-STEP_SIZE).add_(torch.randn_like(p), alpha=self.noise_scale)

    def step(self) -> None:
        self.update(self.gradients())


def check_same_gradient(kernel_steps: KernelSteps, torch_sgld: TorchSGLD, seed: int = 11) -> float:
    """The relative difference between the gradient of the SGLD kernel's potential and the hand-written loop's at the
    same weights, from the same seed (the same minibatch)."""
    kernel = kernel_steps.kernel
    leaves = {name: value.detach().clone().requires_grad_() for name, value in kernel_steps.params.items()}
    pyro.set_rng_seed(seed)
    grads = torch.autograd.grad(kernel.potential_fn(leaves), list(leaves.values()))
    pyro.set_rng_seed(seed)
    torch_grads = torch_sgld.gradients()
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch_flat = torch.cat([g.reshape(-1) for g in torch_grads])
    return ((flat - torch_flat).norm() / torch_flat.norm()).item()


class KernelSteps:
    """Gradient steps of an SG-MCMC kernel (default SGLD): one ``MCMC.run`` of ``draws`` draws, each ``thinning``
    transitions apart, per ``step()`` (``draws > 0``, set-up included, every draw kept), or one transition, the
    kernel's ``sample`` applied to its own output (``draws = 0``)."""

    def __init__(self, network: Network, draws: int, thinning: int = 1, kernel: type = SGLD,
                 **options: object) -> None:
        self.network, self.draws = network, draws
        model = network.model()
        self.kernel = kernel(model, step_size=STEP_SIZE, init_strategy=init_to_network(model), thinning=thinning,
                             **options)
        self.units_per_step = max(draws * thinning, 1)
        if not draws:
            self.kernel.setup(0, network.x, network.y, subsample_size=network.batch)
            self.params = self.kernel.initial_params

    def step(self) -> None:
        if self.draws:
            mcmc = MCMC(self.kernel, num_samples=self.draws, warmup_steps=0, disable_progbar=True)
            mcmc.run(self.network.x, self.network.y, subsample_size=self.network.batch)
        else:
            self.params = self.kernel.sample(self.params)


def compile_times(variant: object) -> str:
    """``capture s / compile s`` of a compiled pyro_flat variant."""
    owner = getattr(variant, "loss", None) or getattr(variant, "kernel", None)
    captures = owner._compiled.captures() if hasattr(owner, "_compiled") else []
    if not captures:
        return "–"
    return " + ".join(f"{c.capture_seconds:.1f} / " + ("not compiled" if c.compile_seconds is None else
                                                      f"{c.compile_seconds:.1f}") for c in captures)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", choices=["mlp", "resnet18"], default="mlp")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first (capture and compilation)")
    parser.add_argument("--draws", type=int, default=100,
                        help="draws per MCMC.run, one timed SGLD step of the MLP (0: kernel.sample instead)")
    parser.add_argument("--jit-backend", default="inductor",
                        help="torch.compile backend of the compiled variants ('none': Pyro's captured graphs run "
                        "uncompiled, the hand-written steps traced and run by dynamo's 'eager' backend)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use TorchInductor's on-disk cache (default: a fresh one, so compile times are cold)")
    parser.add_argument("--packed", action="store_true", help="the latent weights packed in one site")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    suffix = "_packed" if args.packed else ""
    out = args.out or Path(__file__).parent / "results" / f"compiled_{args.network}{suffix}.md"
    if not args.warm_cache:
        fresh_compile_cache()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)  # Pyro's checks and torch.distributions' argument checks, for every variant
    pyro.set_rng_seed(0)
    warnings.filterwarnings("ignore", "`torch.jit.trace` is deprecated", FutureWarning)  # JitTrace_ELBO's tracer
    warnings.filterwarnings("ignore", "`torch.jit.trace` is deprecated", DeprecationWarning)  # torch < 2.14
    network = Network(args.network, packed=args.packed)
    jit = {"backend": None if args.jit_backend == "none" else args.jit_backend}
    # the hand-written steps' torch.compile ("none": traced by dynamo, run uncompiled: its "eager" backend)
    torch_jit = {"backend": "eager" if args.jit_backend == "none" else args.jit_backend, "fullgraph": True}
    draws = args.draws if args.network == "mlp" else 0
    variants = {
        "Trace_ELBO": network.svi(Trace_ELBO()),
        "JitTrace_ELBO (Pyro)": network.svi(JitTrace_ELBO(ignore_jit_warnings=True)),
        "SharpnessAwareELBO": network.svi(SharpnessAwareELBO(RHO)),
        "JitSharpnessAwareELBO": network.svi(JitSharpnessAwareELBO(RHO, jit_options=jit)),
        "SharpnessAwareELBO, torch.optim on ELBOModule": network.svi(SharpnessAwareELBO(RHO), torch_optim=True),
        "JitSharpnessAwareELBO, torch.optim on ELBOModule": network.svi(JitSharpnessAwareELBO(RHO, jit_options=jit),
                                                                        torch_optim=True),
        "KLBallELBO": network.svi(KLBallELBO(RADIUS)),
        "JitKLBallELBO": network.svi(JitKLBallELBO(RADIUS, jit_options=jit)),
        "torch BBB": network.torch_step(TorchBBB),
        "torch BBB-SAM": network.torch_step(TorchBBBSAM),
        "torch KL-ball": network.torch_step(TorchKLBall),
        "torch BBB, compiled": network.torch_step(TorchBBB, torch_jit),
        "torch BBB-SAM, compiled": network.torch_step(TorchBBBSAM, torch_jit),
        "torch KL-ball, compiled": network.torch_step(TorchKLBall, torch_jit),
        "SGLD.sample": KernelSteps(network, 0),
        "SGLD.sample, jit_compile=True": KernelSteps(network, 0, jit_compile=True, jit_options=jit),
        "torch SGLD (idiomatic)": TorchSGLD(network),
        "torch SGLD (idiomatic), compiled": TorchSGLD(network, {"backend": torch_jit["backend"]}),
    }
    if draws:
        for thinning in (1, 10):
            name = "MCMC(SGLD)" if thinning == 1 else f"MCMC(SGLD, thinning={thinning})"
            variants[name] = KernelSteps(network, draws // thinning, thinning)
            variants[name[:-1] + ", jit_compile=True)"] = KernelSteps(network, draws // thinning, thinning,
                                                                       jit_compile=True, jit_options=jit)
    checks = {  # the same arithmetic: loss and gradients from the same seed, before any step
        f"{pyro_name} vs {torch_name}": check_same_step(variants[pyro_name], variants[torch_name])
        for pyro_name, torch_name in (("Trace_ELBO", "torch BBB"), ("SharpnessAwareELBO", "torch BBB-SAM"),
                                      ("KLBallELBO", "torch KL-ball"), ("Trace_ELBO", "torch BBB, compiled"),
                                      ("SharpnessAwareELBO", "torch BBB-SAM, compiled"),
                                      ("KLBallELBO", "torch KL-ball, compiled"))
    }
    for name in ("torch SGLD (idiomatic)", "torch SGLD (idiomatic), compiled"):
        checks[f"SGLD.sample vs {name}"] = check_same_gradient(variants["SGLD.sample"], variants[name])
    warmup = warm_up(variants, args.warmup)
    times = interleaved_times(variants, args.repeats, args.steps)
    med = medians_ms(times)
    table = [  # (label, Pyro eager, Pyro compiled, hand-written eager, goal)
        ("SharpnessAwareELBO / torch BBB-SAM", "SharpnessAwareELBO", "JitSharpnessAwareELBO", "torch BBB-SAM",
         "≤ 1.3 eager, ≤ 1.0 compiled"),
        ("SharpnessAwareELBO / torch BBB-SAM, torch.optim on ELBOModule",
         "SharpnessAwareELBO, torch.optim on ELBOModule", "JitSharpnessAwareELBO, torch.optim on ELBOModule",
         "torch BBB-SAM", "(Pyro's one optimiser per parameter removed)"),
        ("Trace_ELBO / torch BBB (Pyro's own cost)", "Trace_ELBO", "JitTrace_ELBO (Pyro)", "torch BBB",
         "measured alongside"),
        ("KLBallELBO / torch KL-ball", "KLBallELBO", "JitKLBallELBO", "torch KL-ball", "≤ 1.0 compiled"),
        ("SGLD kernel steps (SGLD.sample) / torch SGLD (idiomatic)", "SGLD.sample", "SGLD.sample, jit_compile=True",
         "torch SGLD (idiomatic)", "≤ 1.0 compiled"),
    ]
    if draws:
        table[3:3] = [
            ("MCMC(SGLD) / torch SGLD (idiomatic)", "MCMC(SGLD)", "MCMC(SGLD, jit_compile=True)",
             "torch SGLD (idiomatic)", "≤ 1.0 compiled"),
            ("MCMC(SGLD, thinning=10) / torch SGLD (idiomatic)", "MCMC(SGLD, thinning=10)",
             "MCMC(SGLD, thinning=10, jit_compile=True)", "torch SGLD (idiomatic)", "(every 10th step kept)"),
        ]
    lines = [
        f"# Eager and compiled step times: {args.network}",
        "",
        f"{network.describe}; AutoNormal guides (init scale {INIT_SCALE}), Adam 1e-3, float32, Pyro's validation and "
        f"torch.distributions' argument checks off for every variant. {args.repeats} repeats x {args.steps} steps "
        "per variant, variants "
        f"interleaved (order alternating), median; {args.warmup} untimed warm-up steps first. Compiled variants: "
        f"torch.compile backend `{args.jit_backend}`, "
        f"{'warm' if args.warm_cache else 'fresh (cold)'} TorchInductor cache. {environment()}",
        "",
        "| ratio | eager / eager hand-written | compiled / eager hand-written | compiled / compiled hand-written "
        "(the limit) | goal |",
        "|---|---|---|---|---|",
    ]
    for label, eager, compiled, base, goal in table:
        lines.append(f"| {label} | {med[eager] / med[base]:.2f} | {med[compiled] / med[base]:.2f} | "
                     f"{med[compiled] / med[base + ', compiled']:.2f} | {goal} |")
    lines += ["", "What `torch.compile` buys the hand-written steps (compiled / eager, the same step):", "",
              "| hand-written step | compiled / eager |", "|---|---|"]
    for base in ("torch BBB", "torch BBB-SAM", "torch KL-ball", "torch SGLD (idiomatic)"):
        lines.append(f"| {base} | {med[base + ', compiled'] / med[base]:.2f} |")
    lines += ["", "Same arithmetic, checked before timing (largest relative difference of the loss and the gradients, "
              "one step from the same seed; float32 rounding is about 1e-6):", "",
              *[f"- {pair}: {value:.1e}" for pair, value in checks.items()],
              "", *timing_rows(times), "", "| variant | warm-up (s) | capture / compile (s) |", "|---|---|---|"]
    for name, variant in variants.items():
        lines.append(f"| {name} | {warmup[name]:.1f} | {compile_times(variant)} |")
    return write_markdown(lines, out, __file__, argv)


if __name__ == "__main__":
    main()
