"""Few-shot Bayesian transfer learning on bundled data: SA-BMA (KLBallELBO) against MAP, SAM, VI and SWAG.

The paper's claim under test (Lim et al. 2024, arXiv:2406.15664): in few-shot transfer, SA-BMA gives the lowest
lambda_max of the BMA samples and the best or equal NLL/ECE.

Protocol, per dataset and seed (everything on bundled data, nothing downloaded):

1. **Source task**: a small CNN with GroupNorm (two conv-GN-ReLU-pool blocks, global average pool, linear head) is
   trained with Adam on the *source* classes 0-4 (all their training examples).
2. **Target task**: classes 5-9, ``--shots`` examples per class (10: a 50-example training set), the full test set
   of those classes. :func:`pyro_flat.nn.bayesian_transfer` replaces the head (5 new classes, prior N(0, 1)) and
   makes the GroupNorm affine parameters latent with the prior N(pretrained, 0.1^2); the conv layers are frozen.
   Only these 261 parameters are inferred.
3. **Methods** (full-batch steps; ``T = --steps``):

   * ``map``: MAP, SGD (momentum 0.9, minibatches of 10) for T steps (the point of the SWAG run below);
   * ``sam``: MAP with the SAM step (rho 0.05, ascent on the likelihood only, global norm), T steps — *our own
     baseline* written here with ``pyro_flat.ops.sam`` (the step of ``pyro_flat.optim.SAM``, on the latent values);
   * ``swag``: SWAG moments (mean, diagonal variance, last K = 5 deviations) of the MAP iterates collected every 10
     steps over the second half of the run by ``pyro_flat.infer.autoguide.SWAGCollector`` (float64 moments),
     sampled with scale 0.5;
   * ``f_swag``: F-SWAG, the same SWAG collection from the ``sam`` iterates (run and evaluated last, so that adding
     it leaves the random streams of the other methods unchanged);
   * ``vi``: mean-field VI, ``AutoNormal`` + ``Trace_ELBO``, Adam, 2T steps (the budget of SWAG + SA-BMA);
   * ``swag_vi``: the low-rank-plus-diagonal guide started at the SWAG Gaussian and trained with ``Trace_ELBO`` for
     T steps — SA-BMA with radius 0, the ablation that isolates the KL-ball perturbation;
   * ``sa_bma``: the same guide and start, trained with ``KLBallELBO(radius, direction="fisher")`` (the paper);
   * ``sa_bma_score``: the same with ``direction="normalized_score"`` (the authors' code variant, rho = sqrt(2 radius));
   * ``sa_bma_code``: the authors' code defaults: normalised score and ``kl_weight=0`` (no prior, no entropy term:
     the expected adversarial NLL alone);
   * ``nll_only``: ``kl_weight=0`` and radius 0 — the expected NLL alone, without any perturbation: the ablation
     that isolates what the perturbation adds to ``sa_bma_code``.

4. **Evaluation** (:func:`pyro_flat.bench.runner.evaluate_posterior`): BMA of 30 draws on the target test set:
   accuracy, NLL, ECE (15 bins), Brier, OOD AUROC (feature-shuffled test inputs); lambda_max = top eigenvalue of the
   Hessian of the mean training NLL (all 50 few-shot points) with respect to the 261 latent parameters, averaged
   over 10 posterior draws (a point for map and sam); σ = the median over the 261 parameters of their standard
   deviation across the 30 BMA draws (0 for a point). No temperature scaling (the paper applies it).

Run: ``python benchmarks/sa_bma_transfer.py [--seeds 5] [--datasets digits mnist1d] [--smoke]``; writes
``results/kl_ball/transfer_table.md`` and ``transfer_table.json``. With ``--sweep 0 0.01 0.1 1 10`` it runs only
SA-BMA (Fisher direction) at those radii, all from the same SWAG fit (radius 0 is ``swag_vi``), and writes
``transfer_radius_sweep.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

from pyro_flat.bench import Posterior, RunConfig
from pyro_flat.bench.runner import evaluate_posterior
from pyro_flat.data import load_digits, load_mnist1d
from pyro_flat.infer import AutoLowRankPlusDiagonalNormal, KLBallELBO, latent_sites
from pyro_flat.infer.autoguide import SWAGCollector
from pyro_flat.nn import bayesian_transfer, init_to_network, latent_init_values
from pyro_flat.ops.sam import sam_perturbation

SOURCE, TARGET = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)
LOADERS = {"digits": load_digits, "mnist1d": load_mnist1d}
BATCH = 10  # minibatch of the SGD runs (MAP, SAM, SWAG): SWAG needs gradient noise
METHODS = ("map", "sam", "swag", "f_swag", "vi", "swag_vi", "sa_bma", "sa_bma_score", "sa_bma_code", "nll_only")


def source_network(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """Two conv-GroupNorm-ReLU-pool blocks, global average pooling and a linear head (1-D or 2-D inputs)."""
    two_d = len(input_shape) == 3
    conv, pool, avg = (nn.Conv2d, nn.MaxPool2d, nn.AdaptiveAvgPool2d) if two_d else (nn.Conv1d, nn.MaxPool1d,
                                                                                    nn.AdaptiveAvgPool1d)
    return nn.Sequential(
        conv(input_shape[0], 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), pool(2),
        conv(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(), pool(2),
        avg(1), nn.Flatten(), nn.Linear(32, num_classes),
    )


def pretrain(net: nn.Module, data, epochs: int) -> float:
    """Adam on the source task (batch 64, lr 3e-3, weight decay 1e-4); returns the source test accuracy."""
    optim = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=1e-4)
    net.train()
    for _ in range(epochs):
        for x, y in data.train_loader(64, shuffle=True, seed=int(torch.randint(1 << 30, ())), drop_last=False):
            optim.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optim.step()
    net.eval()
    with torch.no_grad():
        return (net(data.x_test).argmax(-1) == data.y_test).float().mean().item()


def _terms(model, theta, x, y, num_data):
    """(-log p(y | theta), -log p(theta)) with the latent sites fixed to ``theta``; the minibatch ``(x, y)`` is
    scaled to ``num_data`` examples by the model's plate."""
    trace = poutine.trace(poutine.condition(model, data=theta)).get_trace(x, y, num_data=num_data)
    trace.compute_log_prob()
    nll = -sum(s["log_prob_sum"] for n, s in trace.nodes.items()
               if s["type"] == "sample" and s["is_observed"] and n not in theta)
    neg_prior = -sum(s["log_prob_sum"] for n, s in trace.nodes.items() if n in theta)
    return nll, neg_prior


def fit_point(model, data, steps: int, *, rho: float = 0.0, swag: SWAGCollector | None = None) -> dict:
    """MAP (``rho = 0``) or MAP with SAM's step (ascent on the likelihood only): SGD with momentum 0.9 and learning
    rate 3e-4 on the summed objective (0.015 per example), minibatches of ``BATCH``. With ``swag``, the iterates of the
    second half are collected once per epoch (flattened in the model's latent-site order)."""
    theta = {k: v.detach().clone().requires_grad_() for k, v in latent_init_values(model).items()}
    order = list(latent_sites(poutine.trace(model).get_trace(data.x_train, data.y_train)))
    theta = {k: theta[k] for k in order}
    optim = torch.optim.SGD(theta.values(), lr=3e-4, momentum=0.9)
    n = data.num_data
    epoch = math.ceil(n / BATCH)
    for step in range(steps):
        idx = torch.randperm(n, device=data.x_train.device)[:BATCH]
        x, y = data.x_train[idx], data.y_train[idx]
        optim.zero_grad()
        if rho > 0:
            nll, _ = _terms(model, theta, x, y, n)
            grads = torch.autograd.grad(nll, list(theta.values()))
            eps = sam_perturbation(grads, rho)
            nll, _ = _terms(model, {k: v + e for (k, v), e in zip(theta.items(), eps, strict=True)}, x, y, n)
            _, neg_prior = _terms(model, theta, x, y, n)
        else:
            nll, neg_prior = _terms(model, theta, x, y, n)
        (nll + neg_prior).backward()
        optim.step()
        if swag is not None and step >= steps // 2 and (step - steps // 2) % epoch == 0:
            swag.collect(theta)
    return {k: v.detach() for k, v in theta.items()}


def fit_svi(model, guide, loss, data, steps: int, lr: float) -> list[float]:
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), loss)
    losses = []
    for step in range(steps):
        value = svi.step(data.x_train, data.y_train)
        if not math.isfinite(value):
            raise FloatingPointError(f"loss {value} at step {step}")
        losses.append(value)
    return losses


def run_seed(dataset: str, seed: int, args) -> list[dict]:
    full = LOADERS[dataset](flatten=False)
    pyro.set_rng_seed(seed)
    source = full.subset(classes=SOURCE)
    target = full.subset(classes=TARGET).few_shot(args.shots, seed=seed)
    net = source_network(tuple(full.input_shape), len(SOURCE))
    source_acc = pretrain(net, source, args.pretrain_epochs)
    config = RunConfig(num_bma_samples=30, lambda_max_draws=2 if args.smoke else 10,
                       lambda_max_points=len(target.x_train), lambda_max_iters=10 if args.smoke else 30)
    records = []

    def new_model():
        pyro.clear_param_store()
        return bayesian_transfer(net, len(TARGET), prior_scale=0.1, head_prior_scale=1.0, packed=False)

    def record(method, posterior, seconds):
        pyro.set_rng_seed(10_000 + seed)
        metrics, _ = evaluate_posterior(posterior, target, config)
        draws = [torch.cat([v.reshape(-1) for v in d.values()]) for d in posterior.draw(30)]
        metrics["posterior_std"] = torch.stack(draws).std(0).median().item() if len(draws) > 1 else 0.0
        records.append({"dataset": dataset, "seed": seed, "method": method, "fit_seconds": seconds,
                        "source_acc": source_acc, **metrics})
        print(f"{dataset} seed {seed} {method:>12}: acc {metrics['acc']:.3f} nll {metrics['nll']:.3f} "
              f"ece {metrics['ece']:.3f} lambda_max {metrics['lambda_max']:.3g} ({seconds:.1f} s)", flush=True)

    T = args.steps
    start = time.perf_counter()
    model = new_model()
    swag = SWAGCollector(max_rank=5, dtype=torch.float64)
    point = fit_point(model, target, T, swag=swag)
    seconds = time.perf_counter() - start
    if args.sweep:  # only SA-BMA (Fisher direction), one run per radius, all from the same SWAG fit
        for radius in args.sweep:
            start = time.perf_counter()
            model = new_model()
            guide = AutoLowRankPlusDiagonalNormal.from_swag(model, swag, scale=0.5)
            fit_svi(model, guide, KLBallELBO(radius), target, T, args.lr)
            record(f"sa_bma (radius {radius:g})", Posterior.from_guide(model, guide, 30),
                   seconds + time.perf_counter() - start)
        return records
    record("map", Posterior.from_points(model, [point]), seconds)
    swag_guide = AutoLowRankPlusDiagonalNormal.from_swag(model, swag, scale=0.5)
    swag_guide(target.x_train, target.y_train)
    record("swag", Posterior.from_guide(model, swag_guide, 30), seconds)

    start = time.perf_counter()
    sam_model = new_model()
    sam_swag = SWAGCollector(max_rank=5, dtype=torch.float64)
    point = fit_point(sam_model, target, T, rho=args.sam_rho, swag=sam_swag)
    sam_seconds = time.perf_counter() - start
    record("sam", Posterior.from_points(sam_model, [point]), sam_seconds)

    start = time.perf_counter()
    model = new_model()
    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-2)
    fit_svi(model, guide, Trace_ELBO(), target, 2 * T, args.lr)
    record("vi", Posterior.from_guide(model, guide, 30), time.perf_counter() - start)

    for method, loss in (("swag_vi", Trace_ELBO()),
                         ("sa_bma", KLBallELBO(args.radius)),
                         ("sa_bma_score", KLBallELBO(args.radius, direction="normalized_score")),
                         ("sa_bma_code", KLBallELBO(args.radius, direction="normalized_score", kl_weight=0.0)),
                         ("nll_only", KLBallELBO(0.0, kl_weight=0.0))):
        start = time.perf_counter()
        model = new_model()  # the same network and prior; the guide starts at the SWAG Gaussian
        guide = AutoLowRankPlusDiagonalNormal.from_swag(model, swag, scale=0.5)
        fit_svi(model, guide, loss, target, T, args.lr)
        record(method, Posterior.from_guide(model, guide, 30), seconds + time.perf_counter() - start)

    pyro.clear_param_store()
    f_swag_guide = AutoLowRankPlusDiagonalNormal.from_swag(sam_model, sam_swag, scale=0.5)
    f_swag_guide(target.x_train, target.y_train)
    record("f_swag", Posterior.from_guide(sam_model, f_swag_guide, 30), sam_seconds)
    return records


def table(records: list[dict]) -> str:
    columns = (("acc", "acc (%)", 100, "{:.2f}"), ("nll", "NLL", 1, "{:.4f}"), ("ece", "ECE", 1, "{:.4f}"),
               ("brier", "Brier", 1, "{:.4f}"), ("ood_auroc_entropy", "OOD AUROC", 1, "{:.3f}"),
               ("lambda_max", "λ_max", 1, "{:.3g}"), ("posterior_std", "σ", 1, "{:.3f}"),
               ("fit_seconds", "fit (s)", 1, "{:.1f}"))
    lines = []
    for dataset in dict.fromkeys(r["dataset"] for r in records):
        rows = [r for r in records if r["dataset"] == dataset]
        seeds = sorted({r["seed"] for r in rows})
        src = list({r["seed"]: r["source_acc"] for r in rows}.values())  # one pretrained network per seed
        lines += [f"**{dataset}** ({len(seeds)} seeds {seeds}; source-task test accuracy of the pretrained network "
                  f"{100 * statistics.mean(src):.1f} %)", "",
                  "| method | " + " | ".join(c[1] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for method in dict.fromkeys(r["method"] for r in rows):
            cells = []
            for key, _, factor, fmt in columns:
                values = [factor * r[key] for r in rows if r["method"] == method]
                if not values:
                    cells.append("–")
                    continue
                text = fmt.format(statistics.mean(values))
                if len(values) > 1:
                    text += " ± " + fmt.format(statistics.stdev(values))
                cells.append(text)
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def describe(command: str, args: argparse.Namespace) -> str:
    """The header of a results file: the command and the settings."""
    if args.sweep:
        settings = f"SA-BMA (Fisher direction, kl_weight 1) at radii {args.sweep}, all from the same SWAG fit"
    else:
        settings = f"radius {args.radius} (sa_bma, sa_bma_score, sa_bma_code), SAM rho {args.sam_rho}"
    return (f"`{command.strip()}`\n\nFew-shot transfer ({args.shots} shots per class, source classes {SOURCE}, "
            f"target classes {TARGET}); T = {args.steps} steps; {settings}; Adam lr {args.lr} for the SVI methods; "
            f"mean ± std over seeds. λ_max: top Hessian eigenvalue of the mean training NLL (the "
            f"{args.shots * len(TARGET)} few-shot points) in the latent parameters, mean over 10 draws; σ: median "
            f"over the parameters of their standard deviation across the 30 BMA draws.\n\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "mnist1d"], choices=sorted(LOADERS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--shots", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1000, help="T, full-batch steps (see the module docstring)")
    parser.add_argument("--pretrain-epochs", type=int, default=30)
    parser.add_argument("--radius", type=float, default=0.1, help="KL radius of sa_bma / sa_bma_score")
    parser.add_argument("--sam-rho", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate of the SVI methods")
    parser.add_argument("--sweep", type=float, nargs="+", default=None, metavar="RADIUS",
                        help="instead of the comparison: SA-BMA (Fisher) at each of these radii")
    parser.add_argument("--smoke", action="store_true", help="a few steps, one seed, digits (for tests)")
    parser.add_argument("--out", type=Path, default=Path("results/kl_ball"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.datasets, args.seeds, args.steps, args.pretrain_epochs = ["digits"], 1, 40, 1
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)  # the networks are tiny: more threads only contend on the shared machine
    pyro.enable_validation(False)  # ~25 % faster; fit_svi still stops on a non-finite loss
    records = []
    for dataset in args.datasets:
        for seed in range(args.seeds):
            records += run_seed(dataset, seed, args)
    command = "python benchmarks/sa_bma_transfer.py " + " ".join(sys.argv[1:] if argv is None else argv)
    name = "transfer_radius_sweep" if args.sweep else "transfer_table"
    text = describe(command, args) + table(records)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(text)
    (args.out / f"{name}.json").write_text(json.dumps({"command": command, "args": {
        k: str(v) for k, v in vars(args).items()}, "records": records}, indent=1))
    return records


if __name__ == "__main__":
    main()
