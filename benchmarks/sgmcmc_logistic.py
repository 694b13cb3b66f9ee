"""Entropy-MCMC's logistic-regression claim (MNIST 1 vs 7 in the paper), on sklearn's digits 1 vs 7: test accuracy
against gradient evaluations and against wall time for SGD, SGLD, Entropy-SGD, Entropy-SGLD and Entropy-MCMC.

Setup, after the authors' ``exp/mnist_logistic_reg_emcmc.py`` (github.com/lblaoke/EMCMC) where it fits: a linear
sigmoid classifier without bias, float64, batch 64 drawn inside the model's ``pyro.plate``, mean-loss learning rate
0.03 (step size 0.03 / N on Pyro's full-data scale), weight decay 1e-5 as a Gaussian prior of precision N * 1e-5 on
the weights, temperature 1, eta = 1, Entropy-SGD/SGLD with L = 20 inner steps (outer step eta, i.e. x <- mu for
Entropy-SGD; Entropy-SGLD also with the outer step L * eps, the time its inner chain covered). SGD is SGLD at
temperature 0; Entropy-MCMC's theta and theta_a are both reported. Digits 1 vs 7 has only 252 training and 109
test images (MNIST has 13k), so the budget is ``--budget`` gradient evaluations (default 4000, about as many as the
paper's 20 MNIST epochs) rather than epochs. Every kernel runs through ``pyro.infer.MCMC``; one draw every 20 gradient
evaluations.

Reported per method, mean ± std over ``--seeds`` train/test splits (``load_digits(seed=s)``): the test accuracy of
the current iterate (the weights theta; the outer variable x for Entropy-SGD/SGLD) and of the Bayesian model average
of all draws so far, at several gradient budgets, the NLL of that average at the end, and the sampling wall time
(prediction excluded). Plots: accuracy against gradient evaluations and against seconds.

Run: ``python benchmarks/sgmcmc_logistic.py [--smoke]``; writes ``results/sgmcmc/logistic_digits.{md,json,png}``.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import matplotlib
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC

from pyro_flat.data import load_digits
from pyro_flat.infer.mcmc import SGLD, EntropyMCMC, EntropySGD, EntropySGLD

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

INNER = 20
BATCH = 64
LR = 0.03
ETA = 1.0
WEIGHT_DECAY = 1e-5


class LogisticRegression:
    """w ~ N(0, (N wd)^-1 I); y_i ~ Bernoulli(sigmoid(x_i . w)) in a subsampled plate."""

    def __init__(self, num_data, dim):
        self.prior_scale = (num_data * WEIGHT_DECAY) ** -0.5
        self.dim = dim

    def __call__(self, x, y, subsample_size=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(self.dim, dtype=x.dtype), self.prior_scale).to_event(1))
        with pyro.plate("data", len(x), subsample_size=subsample_size) as idx:
            pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx].to(x.dtype))


class Clock:
    """An MCMC hook recording the sampling wall time of every draw (warm-up and sampling stages alike)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times = []

    def __call__(self, kernel, params, stage, i):
        self.times.append(time.perf_counter() - self.start)


def kernels(model, num_data):
    """``{run name: (kernel, {reported label: site})}``."""
    step = LR / num_data
    slow = INNER * step  # an outer step covering the time of its L inner steps
    return {
        "SGD": (SGLD(model, step_size=step, temperature=0.0, thinning=INNER), {"SGD": "w"}),
        "SGLD": (SGLD(model, step_size=step, thinning=INNER), {"SGLD": "w"}),
        "Entropy-SGD": (EntropySGD(model, eta=ETA, step_size=step, num_inner_steps=INNER), {"Entropy-SGD": "w"}),
        "Entropy-SGLD": (EntropySGLD(model, eta=ETA, step_size=step, num_inner_steps=INNER), {"Entropy-SGLD": "w"}),
        "Entropy-SGLD slow": (
            EntropySGLD(model, eta=ETA, step_size=step, num_inner_steps=INNER, outer_step_size=slow),
            {"Entropy-SGLD (outer step L eps)": "w"},
        ),
        "Entropy-MCMC": (
            EntropyMCMC(model, eta=ETA, step_size=step, thinning=INNER, collect="both"),
            {"Entropy-MCMC (theta)": "w", "Entropy-MCMC (theta_a)": "w_anchor"},
        ),
    }


def evaluate(draws, x_test, y_test):
    """Accuracy of each draw and of the running BMA (mean probability of the draws so far), and the BMA's NLL."""
    probs = torch.sigmoid(draws @ x_test.T)  # [draws, test]
    y = y_test.to(probs.dtype)
    current = ((probs > 0.5).to(y.dtype) == y).double().mean(1)
    running = probs.cumsum(0) / torch.arange(1, len(probs) + 1, dtype=probs.dtype)[:, None]
    bma = ((running > 0.5).to(y.dtype) == y).double().mean(1)
    p_final = running[-1].clamp(1e-12, 1 - 1e-12)
    nll = float(-(y * p_final.log() + (1 - y) * (1 - p_final).log()).mean())
    return current, bma, nll


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=4000, help="gradient evaluations per run")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a tiny run (CI)")
    parser.add_argument("--out", type=Path, default=Path("results/sgmcmc"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.budget, args.seeds = 200, 1
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    num_draws = args.budget // INNER
    evals = torch.arange(1, num_draws + 1) * INNER
    results = {}
    for seed in range(args.seeds):
        data = load_digits(seed=seed, dtype=torch.float64).subset(classes=[1, 7])
        model = LogisticRegression(data.num_data, data.x_train.shape[1])
        for kernel, labels in kernels(model, data.num_data).values():
            pyro.set_rng_seed(seed)
            kernel.initial_params = {"w": torch.zeros(data.x_train.shape[1])}
            clock = Clock()
            mcmc = MCMC(kernel, num_samples=num_draws, warmup_steps=0, hook_fn=clock, disable_progbar=True)
            clock.start = time.perf_counter()
            mcmc.run(data.x_train, data.y_train, subsample_size=BATCH)
            for label, site in labels.items():
                current, bma, nll = evaluate(mcmc.get_samples()[site], data.x_test, data.y_test)
                entry = results.setdefault(label, {"current": [], "bma": [], "nll": [], "times": []})
                entry["current"].append(current)
                entry["bma"].append(bma)
                entry["nll"].append(nll)
                entry["times"].append(torch.tensor(clock.times))
    checkpoints = [c for c in (100, 200, 500, 1000, 2000, 4000) if c <= args.budget]
    header = "| method | " + " | ".join(f"acc @ {c} (iterate / BMA)" for c in checkpoints) + \
        " | BMA NLL at the end | seconds per 1000 gradient evaluations |"
    rows = [header, "|" + "---|" * (len(checkpoints) + 3)]
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "gradient_evaluations": evals.tolist(),
              "methods": {}}
    for name, entry in results.items():
        current, bma = torch.stack(entry["current"]) * 100, torch.stack(entry["bma"]) * 100  # [seeds, draws]
        times = torch.stack(entry["times"])
        cells = []
        for c in checkpoints:
            i = c // INNER - 1
            cells.append(f"{current[:, i].mean():.1f} ± {_std(current[:, i]):.1f} / "
                         f"{bma[:, i].mean():.1f} ± {_std(bma[:, i]):.1f}")
        nll = torch.tensor(entry["nll"])
        per_k = times[:, -1] / args.budget * 1000
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {nll.mean():.4f} ± {_std(nll):.4f} | "
                    f"{per_k.mean():.2f} ± {_std(per_k):.2f} |")
        record["methods"][name] = {"current_acc_mean": current.mean(0).tolist(), "bma_acc_mean": bma.mean(0).tolist(),
                                   "bma_nll": entry["nll"], "seconds_mean": times.mean(0).tolist()}
    command = "python benchmarks/sgmcmc_logistic.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = (f"`{command.strip()}`\n\nDigits 1 vs 7 (252 train / 109 test per split), linear sigmoid without bias, "
            f"float64, batch {BATCH}, lr {LR} (step {LR}/N), prior precision N x {WEIGHT_DECAY}, T = 1 (SGD: 0), "
            f"eta {ETA}, L = {INNER}; {args.seeds} splits (mean ± std); accuracies in %.\n\n" + "\n".join(rows) + "\n")
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_smoke" if args.smoke else ""
    (args.out / f"logistic_digits{suffix}.md").write_text(text)
    (args.out / f"logistic_digits{suffix}.json").write_text(json.dumps(record, indent=2))
    plot(results, evals, args.out / f"logistic_digits{suffix}.png")


def _std(values):
    return float(values.std()) if len(values) > 1 else math.nan


def plot(results, evals, path):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k, (name, entry) in enumerate(results.items()):
        current = torch.stack(entry["current"]).mean(0) * 100
        bma = torch.stack(entry["bma"]).mean(0) * 100
        seconds = torch.stack(entry["times"]).mean(0)
        axes[0].plot(evals, current, color=f"C{k}", label=name)
        axes[1].plot(evals, bma, color=f"C{k}", label=name)
        axes[2].plot(seconds, bma, color=f"C{k}", label=name)
    axes[0].set(xlabel="gradient evaluations", ylabel="test accuracy of the current iterate (%)")
    axes[1].set(xlabel="gradient evaluations", ylabel="test accuracy of the BMA so far (%)")
    axes[2].set(xlabel="sampling wall time (s)", ylabel="test accuracy of the BMA so far (%)")
    for ax in axes:
        ax.set_ylim(40, 100.5)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("digits 1 vs 7, logistic regression (mean over splits)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
