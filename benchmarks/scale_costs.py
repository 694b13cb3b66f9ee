"""CPU step costs at paper scale, and the GPU hours of each recipe estimated from them.

Measured here (one thread, float32, random CIFAR-format images): the seconds of a plain ``torch.optim.SGD`` step of
each recipe network at ``--batch`` images, and of one harness step of each recipe method on the CIFAR ResNet-18 at
the same batch (the method's own training loop, timed by the harness's per-epoch log over the second and third
epochs). Their ratio is the method's cost in plain SGD steps; the harness's overhead per step (Pyro's tracing,
Python) is measured on a width-2 ResNet-18 with 8 images, where the arithmetic is negligible.

**The estimate** (not a measurement: no GPU here). One GPU step of a method costs ``ratio x t_SGD + overhead``, with
``t_SGD`` the SGD step of the network at the recipe's batch on one A100-class GPU, assumed from a throughput of
``--gpu-images-per-second`` images/s for the CIFAR ResNet-18 (bf16 autocast, channels-last; default 10 000) and
scaled for the other networks by their measured CPU cost per image relative to ResNet-18. A recipe's GPU hours sum
the steps of every (stage, dataset, method) job: ``epochs x ceil(N / B)`` steps (times the members of an ensemble;
bSAM's and SAM's sub-batches are in their measured ratio), plus 10 % for evaluation (30 BMA draws, each a
BatchNorm refresh over the training set and a test pass, and λ_max).

Run: ``OMP_NUM_THREADS=1 nice -n 5 python benchmarks/scale_costs.py``; writes
``benchmarks/results/scale_costs.md``. (Step-time *ratios* as a benchmark of the methods are issue 14's
``benchmarks/``; this script only needs them for the estimate.)
"""

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

from _report import write_markdown

METHODS = ["map", "vi", "sam", "sam_torch", "f_swag", "bsam", "mc_dropout", "sgld", "emcmc", "hwa", "sa_bma"]
NETWORKS = {"ResNet-18": ("resnet18", {}), "WRN-28-10": ("wrn", {"depth": 28, "width": 10}),
            "ResNet-18 (ImageNet stem)": ("resnet18_imagenet", {})}


def torch_sgd_seconds(model: str, arch: dict, batch: int, repeats: int) -> float:
    import torch
    import torchvision

    from pyro_flat.nn import resnet18, wide_resnet

    if model == "resnet18":
        net = resnet18(10)
    elif model == "wrn":
        net = wide_resnet(arch["depth"], arch["width"], 10)
    else:
        net = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def harness_seconds(method: str, root: Path, batch: int, width: int | None = None) -> float:
    """Seconds per step of ``method`` on the harness's CIFAR ResNet-18 (median over epochs 2 and 3 of 2 steps)."""
    from pyro_flat.bench import RunConfig
    from pyro_flat.bench.runner import run_one

    options = {m: {"swa_start": 0} for m in ("f_swag", "hwa")} | {"bsam": {"m_sharpness": 8, "dafactor": 4},
                                                                   "sam_torch": {"m_sharpness": 8}}
    config = RunConfig(model="resnet18", width=width, data_root=str(root), num_epochs=3, batch_size=batch,
                       optimizer="sgd", lr=0.1, lr_schedule="cosine", prior_scale=0.2, num_bma_samples=1,
                       lambda_max_draws=1, lambda_max_points=8, lambda_max_iters=1, options=options)
    record = run_one(method, "cifar10", 0, config)
    per_step = [e["seconds"] / 2 for e in record.entries[1:3]]
    return statistics.median(per_step)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--gpu-images-per-second", type=float, default=10_000.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale_costs.md"))
    args = parser.parse_args(argv)
    import torch

    from pyro_flat.bench.recipes import RECIPES
    from pyro_flat.data import write_synthetic_cifar

    torch.set_num_threads(1)
    sgd = {}
    for name in args.networks:
        model, arch = NETWORKS[name]
        batch = args.batch if model != "wrn" else max(1, args.batch // 4)
        sgd[name] = torch_sgd_seconds(model, arch, batch, args.repeats) / batch  # per image
        print(f"torch SGD {name}: {1000 * sgd[name]:.1f} ms per image", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_cifar(tmp, num_train=2 * args.batch, num_test=8)
        overhead, cost = {}, {}
        for method in args.methods:
            cost[method] = harness_seconds(method, Path(tmp), args.batch)
            print(f"{method}: {cost[method]:.2f} s per step ({cost[method] / (sgd['ResNet-18'] * args.batch):.2f} x "
                  "SGD)", flush=True)
        small = Path(tmp) / "small"
        write_synthetic_cifar(small, num_train=16, num_test=4)
        for method in args.methods:
            overhead[method] = harness_seconds(method, small, 8, width=2)
    ratio = {m: cost[m] / (sgd["ResNet-18"] * args.batch) for m in args.methods}
    t_image = 1 / args.gpu_images_per_second  # s per image of a ResNet-18 SGD step on the GPU (assumed)

    def gpu_step(method: str, network: str, batch: int) -> float:
        scale = sgd.get(network, sgd["ResNet-18"]) / sgd["ResNet-18"]
        base = method if method in ratio else {"ensemble": "map", "f_ensemble": "sam", "swag": "map",
                                               "swa": "map", "swag_diag": "map", "f_swa": "f_swag",
                                               "f_swag_diag": "f_swag", "f_mc_dropout": "sam", "csgld": "sgld",
                                               "vi_cyclical": "hwa", "hwa_total": "hwa", "vi_low_rank": "vi",
                                               "sa_bma_score": "sa_bma"}.get(method, "map")
        base = base if base in ratio else next(iter(ratio))  # (a run measuring only some methods)
        return ratio[base] * scale * t_image * batch + overhead[base]

    lines = [
        "# CPU step costs at paper scale and the recipes' estimated GPU hours",
        "",
        f"Plain torch SGD step (momentum), one thread, float32, batch {args.batch} (WRN-28-10: "
        f"{max(1, args.batch // 4)}), median of {args.repeats}:",
        "",
        "| network | ms per image | relative to ResNet-18 |",
        "|---|---:|---:|",
    ]
    for name, seconds in sgd.items():
        lines.append(f"| {name} | {1000 * seconds:.1f} | {seconds / sgd['ResNet-18']:.2f} |")
    lines += [
        "",
        f"Harness step of each method on the CIFAR ResNet-18 (every weight latent, batch {args.batch}; "
        "bSAM and SAM-SGD with 8 sub-batches) and the harness's per-step overhead (width-2 ResNet-18, 8 images):",
        "",
        "| method | s per step | x torch SGD step | overhead (ms per step) |",
        "|---|---:|---:|---:|",
    ]
    for method in args.methods:
        lines.append(f"| {method} | {cost[method]:.2f} | {ratio[method]:.2f} | {1000 * overhead[method]:.0f} |")
    lines += [
        "",
        f"**Estimated GPU hours** (assumption: {args.gpu_images_per_second:,.0f} images/s for a ResNet-18 SGD step "
        "on one A100-class GPU with bf16 autocast and channels-last; a method's step = its CPU ratio x that + its "
        "measured overhead; +10 % for evaluation; one seed):",
        "",
        "| recipe | stage | steps | GPU hours (estimate) |",
        "|---|---|---:|---:|",
    ]
    for recipe in RECIPES.values():
        total = 0.0
        for stage in recipe.stages:
            config = stage.config
            n = 50_000 if config.get("shots") is None else 10 * config["shots"]
            batch = min(config.get("batch_size", 128), n)
            steps_per_job = config["num_epochs"] * math.ceil(n / batch)
            network = {"resnet18": "ResNet-18", "wrn": "WRN-28-10", "resnet18_imagenet": "ResNet-18 (ImageNet stem)"}[
                config["model"]]
            hours, steps = 0.0, 0
            for _ in stage.datasets:
                for method in stage.methods:
                    members = config.get("ensemble_size", 5) if method.endswith("ensemble") else 1
                    steps += steps_per_job * members
                    hours += steps_per_job * members * gpu_step(method, network, batch) * 1.1 / 3600
            total += hours
            lines.append(f"| {recipe.name} | {stage.name} | {steps:,} | {hours:.1f} |")
        lines.append(f"| **{recipe.name}** | all | | **{total:.1f}** |")
    lines += ["", "Transfer stages (resnet18_imagenet on 100 images) use the ResNet-18 ratios: the frozen "
              "convolutions still run forward and backward to the BatchNorm layers."]
    return write_markdown(lines, Path(args.out), __file__, argv)


if __name__ == "__main__":
    main()
