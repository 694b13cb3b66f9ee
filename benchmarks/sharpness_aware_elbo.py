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
from pathlib import Path

import pyro
import torch
from _report import write_markdown
from _svi_steps import BATCH, HIDDEN, INIT_SCALE, PyroStep, TorchBBB, mlp_model, mlp_torch
from _timing import environment, interleaved_times, medians_ms, timing_rows
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_flat.data import load_digits
from pyro_flat.infer import SharpnessAwareELBO
from pyro_flat.nn import init_to_network
from pyro_flat.ops.sam import sam_perturbation

RHO = 0.05


class TorchBBBSAM(TorchBBB):
    """Bayes by backprop plus the SAM step on the sampled weights (the arithmetic of ``SharpnessAwareELBO``)."""

    def likelihood_nll(self, weights, scales, noise, x, y):
        leaves = [w.detach().requires_grad_() for w in weights]
        grads = torch.autograd.grad(self.nll(leaves, x, y), leaves)
        eps = sam_perturbation(grads, RHO)
        return self.nll([w + e for w, e in zip(weights, eps, strict=True)], x, y)


def guide_factory(guide_class):
    return lambda model: guide_class(model, init_loc_fn=init_to_network(model), init_scale=INIT_SCALE)


CONFIGS = {
    # Pyro's defaults: validation on, one AutoNormal site per weight tensor
    "default": {"validation": True, "guide": AutoNormal},
    # the fast configuration: validation off (for every variant, torch loops included) and one flat latent vector
    "fast": {"validation": False, "guide": AutoDiagonalNormal},
}


def measure(data, config, repeats, steps):
    pyro.enable_validation(config["validation"])  # also torch.distributions' argument validation
    guide = config["guide"].__name__

    def pyro_step(loss):
        return PyroStep(mlp_model(), data.x_train, data.y_train, loss, guide_factory(config["guide"]))

    variants = {
        f"Trace_ELBO + {guide}": pyro_step(Trace_ELBO()),
        f"SharpnessAwareELBO + {guide}": pyro_step(SharpnessAwareELBO(RHO)),
        "torch BBB": TorchBBB(data.x_train, data.y_train, *mlp_torch()),
        "torch BBB-SAM": TorchBBBSAM(data.x_train, data.y_train, *mlp_torch()),
    }
    return interleaved_times(variants, repeats, steps)


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
    lines = [
        "# SharpnessAwareELBO step time",
        "",
        f"One SVI step, MLP 64-{HIDDEN[0]}-{HIDDEN[1]}-10 on digits, batch {BATCH}, mean-field Gaussian guide, Adam, "
        f"float32, 1 thread; {args.repeats} repeats x {args.steps} steps per variant, variants interleaved (order "
        "alternating), median.",
        environment(),
    ]
    for config_name, config in CONFIGS.items():
        times = measure(data, config, args.repeats, args.steps)
        med = medians_ms(times)
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
            *timing_rows(times),
        ]
        lines += ["", "| ratio | value | target |", "|---|---|---|"]
        lines += [f"| {name} | {value:.2f} | {target} |" for name, value, target in rows]
    write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    main()
