"""The bSAM two-moons demo (``demo2d.py`` of github.com/team-approx-bayes/bayesian-sam) with pyro_flat's BayesianSAM.

Setup as the authors' demo: two moons, N = 100, noise 0.1, seed 1; an MLP with four hidden layers of 32 ELU units
(biases initialised to 0.05) and one logit; batch 30 (the irregular last batch of 10 is skipped, as in the demo); lr 0.5
with a cosine decay per epoch over 250 epochs; beta1 0.9, beta2 0.999, rho 0.05, damping 0.1, weight decay delta = 1e-4
(prior precision delta N = 0.01), m-sharpness 5 (five sub-batches of 6); float64. Then 20 samples theta ~ N(m, 1/(N s))
and their 0.5 contours. The comparison is the same network trained with SGD (momentum 0.9, lr 0.05, weight decay 1e-4,
same batches and epochs): one boundary.

Numbers reported (so that the picture is backed by a measurement): for grid points near the data (within 0.3 of a
training point) and far from it (more than 1.0 away), the fraction of bSAM samples that disagree with the majority
label, and the mean confidence max(p, 1 - p) of SGD and of bSAM's model average.

Run: ``python benchmarks/bsam_two_moons.py``; writes ``results/bayesian_sam/two_moons.png`` and ``two_moons.md``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from pyro_flat.data import two_moons
from pyro_flat.optim import BayesianSAM


def make_net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers, width = [], 2
    for _ in range(4):
        linear = torch.nn.Linear(width, 32)
        torch.nn.init.constant_(linear.bias, 0.05)
        layers += [linear, torch.nn.ELU()]
        width = 32
    head = torch.nn.Linear(width, 1)
    torch.nn.init.constant_(head.bias, 0.05)
    return torch.nn.Sequential(*layers, head).double()


def bce(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(net(x).squeeze(-1), y.double())


def train(x: torch.Tensor, y: torch.Tensor, method: str, epochs: int, seed: int) -> tuple[torch.nn.Module, object]:
    net = make_net(seed)
    n, batch = len(x), 30
    if method == "bsam":
        opt = BayesianSAM(net.parameters(), lr=0.5, num_data=n, rho=0.05, prior_precision=1e-4 * n, damping=0.1,
                          beta1=0.9, beta2=0.999, generator=torch.Generator().manual_seed(seed))
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    base = [g["lr"] for g in opt.param_groups]
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs + 1):
        factor = 0.5 * (1 + math.cos(math.pi * epoch / epochs))
        for g, lr in zip(opt.param_groups, base, strict=True):
            g["lr"] = lr * factor
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n - batch + 1, batch):  # the irregular last batch is skipped, as in the demo
            idx = perm[start : start + batch]
            if method == "bsam":
                closures = []
                for part in idx.tensor_split(5):  # m-sharpness 5

                    def closure(part: torch.Tensor = part) -> torch.Tensor:
                        loss = bce(net, x[part], y[part])
                        loss.backward()
                        return loss

                    closures.append(closure)
                opt.step(closures)
            else:
                opt.zero_grad()
                bce(net, x[idx], y[idx]).backward()
                opt.step()
    return net, opt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=250)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/bayesian_sam"))
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    data = two_moons(100, noise=0.1, seed=1, dtype=torch.float64)
    x, y = data.x_train, data.y_train
    sgd, _ = train(x, y, "sgd", args.epochs, args.seed)
    net, opt = train(x, y, "bsam", args.epochs, args.seed)

    xs, ys = torch.linspace(-1.5, 2.7, 150), torch.linspace(-1.0, 1.4, 120)
    gx, gy = torch.meshgrid(xs, ys, indexing="xy")
    grid = torch.stack([gx.reshape(-1), gy.reshape(-1)], -1)
    with torch.no_grad():
        p_sgd = torch.sigmoid(sgd(grid).squeeze(-1))
        p_mean = torch.sigmoid(net(grid).squeeze(-1))
        gen = torch.Generator().manual_seed(args.seed + 1)
        samples = []
        for _ in range(args.samples):
            with opt.sampled_params(gen):
                samples.append(torch.sigmoid(net(grid).squeeze(-1)))
        samples = torch.stack(samples)
    p_bma = samples.mean(0)
    std = torch.cat([s.reshape(-1) for s in opt.posterior_std()])

    distance = torch.cdist(grid, x).min(-1).values
    near, far = distance < 0.3, distance > 1.0
    votes = (samples > 0.5).double().mean(0)
    disagree = torch.minimum(votes, 1 - votes)

    def conf(p: torch.Tensor) -> torch.Tensor:
        return torch.maximum(p, 1 - p)

    rows = [
        ("fraction of bSAM samples disagreeing with the majority", disagree[near].mean(), disagree[far].mean()),
        ("mean confidence max(p, 1-p), SGD", conf(p_sgd)[near].mean(), conf(p_sgd)[far].mean()),
        ("mean confidence, bSAM mean network", conf(p_mean)[near].mean(), conf(p_mean)[far].mean()),
        (f"mean confidence, bSAM model average ({args.samples} samples)", conf(p_bma)[near].mean(),
         conf(p_bma)[far].mean()),
    ]
    with torch.no_grad():
        train_acc = {
            "SGD": float(((sgd(x).squeeze(-1) > 0).long() == y).double().mean()),
            "bSAM mean": float(((net(x).squeeze(-1) > 0).long() == y).double().mean()),
        }

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    shape = gx.shape
    panels = ((axes[0], "SGD: one boundary", p_sgd), (axes[1], "bSAM: mean (black) and 20 samples", p_bma))
    for ax, title, prob in panels:
        im = ax.contourf(gx, gy, prob.reshape(shape), levels=torch.linspace(0, 1, 21).tolist(), cmap="RdBu_r",
                         alpha=0.75)
        ax.set_title(title)
        ax.set_xlim(-1.5, 2.7)
        ax.set_ylim(-1.0, 1.4)
    axes[0].contour(gx, gy, p_sgd.reshape(shape), [0.5], colors="black", linewidths=3)
    for p in samples:
        if p.min() < 0.5 < p.max():
            axes[1].contour(gx, gy, p.reshape(shape), [0.5], colors="dimgray", linewidths=0.7)
    axes[1].contour(gx, gy, p_mean.reshape(shape), [0.5], colors="black", linewidths=3)
    for ax in axes:
        ax.scatter(x[y == 0, 0], x[y == 0, 1], c="#435571", marker="o", edgecolors="white", s=30)
        ax.scatter(x[y == 1, 0], x[y == 1, 1], c="#8F5F3F", marker="X", edgecolors="white", s=40)
    fig.colorbar(im, ax=axes, label="predicted p(class 1)")
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "two_moons.png", dpi=110)
    plt.close(fig)

    lines = [
        "# bSAM two-moons demo",
        "",
        f"Command: `python benchmarks/bsam_two_moons.py --epochs {args.epochs} --samples {args.samples} "
        f"--seed {args.seed}`",
        "",
        "![two moons](two_moons.png)",
        "",
        "Setup as `demo2d.py` of github.com/team-approx-bayes/bayesian-sam (see the script's docstring). Training "
        f"accuracy: SGD {train_acc['SGD']:.2f}, bSAM mean network {train_acc['bSAM mean']:.2f}. bSAM posterior "
        f"standard deviations 1/sqrt(N s): median {float(std.median()):.3f}, range "
        f"[{float(std.min()):.3f}, {float(std.max()):.3f}].",
        "",
        f"Grid points near the data: {int(near.sum())} (within 0.3 of a training point); far: {int(far.sum())} "
        "(more than 1.0 away).",
        "",
        "| quantity | near the data | far from the data |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {float(a):.3f} | {float(b):.3f} |" for name, a, b in rows]
    text = "\n".join(lines) + "\n"
    (args.out / "two_moons.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
