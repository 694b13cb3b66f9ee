"""Step time of KLBallELBO (SA-BMA) against Trace_ELBO with the same guide and batch, and against plain-torch loops.

One SVI step on the MLP 64-256-256-10 of sklearn's digits (1257 training points), batch 128 drawn inside the model by
``pyro.plate(subsample_size=128)``, Adam, float32, one thread, Pyro's validation and torch.distributions' argument
checks off for every variant (no baseline handicapped; each hand-written step checked first to compute its Pyro
step's loss and gradients from the same seed). Variants, interleaved
inside every repeat (the machine is shared and noisy; the order alternates between repeats), median over repeats:

* ``Trace_ELBO`` with ``AutoNormal`` and with ``AutoLowRankPlusDiagonalNormal`` (rank 5) — the non-flat baselines;
* ``KLBallELBO`` (radius 0.01) with the same guides: Fisher direction (the paper) and, for ``AutoNormal``, the
  normalised-score direction (the authors' code);
* ``torch BBB``: hand-written Bayes by backprop for the mean-field Gaussian doing Trace_ELBO's arithmetic (sampled
  weights ``loc + softplus(u) * eps``, sampled log prior and log guide, N/B-scaled cross-entropy, one backward, Adam);
* ``torch KL-ball``: the same plus the KL-ball step — the gradient of the NLL in ``(loc, u)``, the closed-form
  Fisher-preconditioned perturbation, a second forward at ``(loc + d_loc) + softplus(u + d_u) * eps`` with the same
  ``eps``, the likelihood there and prior/guide at the unperturbed sample: the arithmetic of ``KLBallELBO``; and the
  same step ``torch.compile``'d in one graph (``--jit-backend``), the limit of a step. The hand-written steps are
  ``_svi_steps.py``'s: log densities in closed form, fused Adam.

Run: ``python benchmarks/kl_ball_elbo.py [--repeats 15] [--steps 20]``; writes ``benchmarks/results/kl_ball_elbo.md``.
"""

import argparse
from pathlib import Path

import pyro
import torch
import torch.nn.functional as F
from _report import write_markdown
from _svi_steps import BATCH, HIDDEN, INIT_SCALE, Network, PyroStep, TorchBBB, check_same_step
from _timing import environment, interleaved_times, medians_ms, timing_rows
from pyro.infer.autoguide import AutoNormal

from pyro_flat.infer import AutoLowRankPlusDiagonalNormal, KLBallELBO, TensorTrace_ELBO
from pyro_flat.nn import init_to_network
from pyro_flat.ops.fisher import diagonal_gaussian_inverse_fisher_product, kl_ball_step

RADIUS = 0.01
RANK = 5


class TorchKLBall(TorchBBB):
    """Bayes by backprop plus the Fisher-preconditioned KL-ball step of ``KLBallELBO``."""

    def likelihood_nll(self, weights, scales, noise, x, y):
        n = len(self.locs)

        def nll_at(variational):  # the likelihood at the sample of (locs, raw scales) with this step's noise
            return self.inner_nll([m + F.softplus(u) * e for m, u, e in
                                   zip(variational[:n], variational[n:], noise, strict=True)], x, y)

        grads = self.grad(nll_at, self.locs + self.raw_scales)
        directions = [
            diagonal_gaussian_inverse_fisher_product(m_grad, u_grad, s.detach(), torch.sigmoid(u.detach()))
            for m_grad, u_grad, u, s in zip(grads[:n], grads[n:], self.raw_scales, scales, strict=True)
        ]
        steps = kl_ball_step(list(grads), [d[0] for d in directions] + [d[1] for d in directions], RADIUS)
        perturbed = [(m + dm) + F.softplus(u + du) * e for m, u, dm, du, e in
                     zip(self.locs, self.raw_scales, steps[:n], steps[n:], noise, strict=True)]
        return self.nll(perturbed, x, y)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--jit-backend", default="inductor", help="torch.compile backend of the compiled torch step")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kl_ball_elbo.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)  # Pyro's checks and torch.distributions' argument checks, for every variant
    pyro.set_rng_seed(0)
    network = Network("mlp")

    def normal(model):
        return AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=INIT_SCALE)

    def low_rank(model):
        return AutoLowRankPlusDiagonalNormal(model, init_loc_fn=init_to_network(model), init_scale=INIT_SCALE,
                                             rank=RANK)

    def pyro_step(loss, guide):
        return PyroStep(network.model(), network.x, network.y, loss, guide)

    variants = {
        "Trace_ELBO + AutoNormal": pyro_step(TensorTrace_ELBO(), normal),
        "KLBallELBO (fisher) + AutoNormal": pyro_step(KLBallELBO(RADIUS), normal),
        "KLBallELBO (normalized_score) + AutoNormal": pyro_step(
            KLBallELBO(RADIUS, direction="normalized_score"), normal),
        f"Trace_ELBO + AutoLowRankPlusDiagonalNormal (K={RANK})": pyro_step(TensorTrace_ELBO(), low_rank),
        f"KLBallELBO (fisher) + AutoLowRankPlusDiagonalNormal (K={RANK})": pyro_step(KLBallELBO(RADIUS), low_rank),
        "torch BBB": network.torch_step(TorchBBB),
        "torch KL-ball": network.torch_step(TorchKLBall),
        "torch KL-ball, compiled": network.torch_step(TorchKLBall, {"backend": args.jit_backend, "fullgraph": True}),
    }
    checks = {f"{a} vs {b}": check_same_step(variants[a], variants[b]) for a, b in (
        ("Trace_ELBO + AutoNormal", "torch BBB"), ("KLBallELBO (fisher) + AutoNormal", "torch KL-ball"),
        ("KLBallELBO (fisher) + AutoNormal", "torch KL-ball, compiled"))}
    times = interleaved_times(variants, args.repeats, args.steps, warmup=2)
    med = medians_ms(times)
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
        ("KLBallELBO (fisher) + AutoNormal / torch KL-ball compiled", med["KLBallELBO (fisher) + AutoNormal"],
         med["torch KL-ball, compiled"], "(the limit of a step)"),
        ("torch KL-ball / torch BBB", med["torch KL-ball"], med["torch BBB"], "(the two-pass floor, ≈ 2)"),
        ("Trace_ELBO + AutoNormal / torch BBB", med["Trace_ELBO + AutoNormal"], med["torch BBB"],
         "(Pyro's overhead on the baseline)"),
    ]
    lines = [
        "# KLBallELBO step time",
        "",
        f"One SVI step, MLP 64-{HIDDEN[0]}-{HIDDEN[1]}-10 on digits, batch {BATCH}, Adam, float32, 1 thread, radius "
        f"{RADIUS}; {args.repeats} repeats x {args.steps} steps, variants interleaved (order alternating), median; "
        "validation off for every variant; `Trace_ELBO` is `pyro_flat.infer.TensorTrace_ELBO` (Pyro's values, no host "
        "read per site).",
        environment(),
        "",
        "Same arithmetic, checked before timing (largest relative difference of the loss and gradients, one step from "
        "the same seed): " + "; ".join(f"{pair} {value:.1e}" for pair, value in checks.items()) + ".",
        "",
        *timing_rows(times),
    ]
    lines += ["", "| ratio | value | target |", "|---|---|---|"]
    for name, a, b, target in rows:
        lines.append(f"| {name} | {a / b:.2f} | {target} |")
    write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    main()
