"""Step time of SharpnessAwareELBO against Trace_ELBO and against plain-torch Bayes-by-backprop loops.

One SVI step on the MLP 64-256-256-10 of sklearn's digits (1257 training points), mean-field Gaussian guide, batch 128
drawn inside the model by ``pyro.plate(subsample_size=128)``, Adam, float32, one thread. Variants, interleaved inside
every repeat (the machine is shared and noisy), two untimed warm-up steps first (the compilation), median over
repeats:

* ``Trace_ELBO``: ``SVI(model, AutoNormal(model), Adam, Trace_ELBO())`` — the non-flat baseline;
* ``SharpnessAwareELBO``: the same with ``SharpnessAwareELBO(rho=0.05)`` (two forward/backward passes);
* ``torch BBB``: a hand-written Bayes-by-backprop step doing Trace_ELBO's arithmetic (sampled weights
  ``loc + softplus(s) * eps``, sampled log prior and log guide, N/B-scaled cross-entropy, one backward, Adam);
* ``torch BBB-SAM``: the same plus the SAM step on the sampled weights (gradient of the NLL in the weights, global
  norm, a second forward at the perturbed weights, the likelihood there, prior and guide at the sample) — the
  arithmetic of ``SharpnessAwareELBO``; and the same step ``torch.compile``'d in one graph (``--jit-backend``), the
  limit of a step. The hand-written steps are ``_svi_steps.py``'s: log densities in closed form, fused Adam.

Two configurations, both with Pyro's validation and torch.distributions' argument checks off for every variant (a
hand-written loop with argument checks on would be a handicapped baseline): one sample site per weight tensor, and
the network packed in one site (``pyro_flat.nn.pack_latents``; the hand-written loops then keep one flat vector too).
``Trace_ELBO`` is ``pyro_flat.infer.TensorTrace_ELBO`` (Pyro's values, no host read per site). Each hand-written step
is checked to compute its Pyro step's loss and gradients from the same seed before it is timed.

Run: ``python benchmarks/sharpness_aware_elbo.py [--repeats 15] [--steps 20]``; writes
``benchmarks/results/sharpness_aware_elbo.md``.
"""

import argparse
from pathlib import Path

import pyro
import torch
from _report import write_markdown
from _svi_steps import BATCH, HIDDEN, Network, TorchBBB, check_same_step, sam_ascent
from _timing import environment, interleaved_times, medians_ms, timing_rows

from pyro_flat.infer import SharpnessAwareELBO, TensorTrace_ELBO

RHO = 0.05


class TorchBBBSAM(TorchBBB):
    """Bayes by backprop plus the SAM step on the sampled weights (the arithmetic of ``SharpnessAwareELBO``)."""

    def likelihood_nll(self, weights, scales, noise, x, y):
        grads = self.grad(lambda w: self.inner_nll(w, x, y), weights)
        return self.nll(torch._foreach_add(weights, sam_ascent(grads, RHO)), x, y)


CONFIGS = {"per tensor": False, "packed": True}  # configuration: the network packed in one latent site


def measure(packed: bool, repeats: int, steps: int, backend: str) -> tuple[dict, dict]:
    network = Network("mlp", packed=packed)
    variants = {
        "Trace_ELBO": network.svi(TensorTrace_ELBO()),
        "SharpnessAwareELBO": network.svi(SharpnessAwareELBO(RHO)),
        "torch BBB": network.torch_step(TorchBBB),
        "torch BBB-SAM": network.torch_step(TorchBBBSAM),
        "torch BBB-SAM, compiled": network.torch_step(TorchBBBSAM, {"backend": backend, "fullgraph": True}),
    }
    checks = {f"{a} vs {b}": check_same_step(variants[a], variants[b])
              for a, b in (("Trace_ELBO", "torch BBB"), ("SharpnessAwareELBO", "torch BBB-SAM"),
                           ("SharpnessAwareELBO", "torch BBB-SAM, compiled"))}
    return interleaved_times(variants, repeats, steps, warmup=2), checks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--jit-backend", default="inductor", help="torch.compile backend of the compiled torch step")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sharpness_aware_elbo.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)  # Pyro's checks and torch.distributions' argument checks, for every variant
    pyro.set_rng_seed(0)
    lines = [
        "# SharpnessAwareELBO step time",
        "",
        f"One SVI step, MLP 64-{HIDDEN[0]}-{HIDDEN[1]}-10 on digits, batch {BATCH}, mean-field Gaussian guide, Adam, "
        f"float32, 1 thread; {args.repeats} repeats x {args.steps} steps per variant, variants interleaved (order "
        "alternating), median.",
        environment(),
    ]
    for config_name, packed in CONFIGS.items():
        times, checks = measure(packed, args.repeats, args.steps, args.jit_backend)
        med = medians_ms(times)
        sa, base = med["SharpnessAwareELBO"], med["Trace_ELBO"]
        rows = [
            ("SharpnessAwareELBO / Trace_ELBO", sa / base, "≤ 2.1"),
            ("SharpnessAwareELBO / torch BBB-SAM", sa / med["torch BBB-SAM"], "≤ 1.5"),
            ("SharpnessAwareELBO / torch BBB-SAM compiled (the limit of a step)", sa / med["torch BBB-SAM, compiled"],
             ""),
            ("torch BBB-SAM / torch BBB (the SAM cost in plain torch)", med["torch BBB-SAM"] / med["torch BBB"], ""),
            ("Trace_ELBO / torch BBB (Pyro's own overhead)", base / med["torch BBB"], ""),
        ]
        lines += [
            "",
            f"## {config_name}: AutoNormal, validation off",
            "",
            *timing_rows(times),
            "",
            "Same arithmetic, checked before timing (largest relative difference of the loss and gradients, one step "
            "from the same seed): " + "; ".join(f"{pair} {value:.1e}" for pair, value in checks.items()) + ".",
        ]
        lines += ["", "| ratio | value | target |", "|---|---|---|"]
        lines += [f"| {name} | {value:.2f} | {target} |" for name, value, target in rows]
    write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    main()
