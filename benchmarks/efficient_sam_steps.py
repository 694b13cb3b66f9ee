"""Step time of the cheaper sharpness-aware steps (LookSAM, RST, ESAM) against their base and full SAM, in one run.

Two networks, both float32, one thread, eager, Pyro's validation and torch.distributions' argument checks off for
every variant: the MLP 64-256-256-10 on digits (minibatch 128) and ResNet-18 with the CIFAR stem and BatchNorm at a
chosen first-stage width (``--width``; 64 is the standard network) on CIFAR-shaped synthetic data (``_svi_steps.py``'s
:class:`Network`). Per network, two groups of variants, all interleaved in one run (``_timing.py``: every variant in
every repeat, the order reversed every other repeat, median over repeats):

* **SVI** (``AutoNormal``, init scale 1e-3, ``pyro.optim.Adam`` 1e-3, one ``SVI.step``): the base
  ``TensorTrace_ELBO``; ``SharpnessAwareELBO`` (rho 0.05, the ascent at every step); the same with LookSAM
  (``looksam_k=5``: the ascent every 5th step, the reused direction in between) and with RST (``rst_p=0.5``: each step
  sharpness-aware with probability 0.5).
* **Closure optimizers** on the torch network, closure = mean cross-entropy of a fresh minibatch: ``torch.optim.SGD``
  (momentum 0.9, the base); ``pyro_flat.optim.SAM`` around it (rho 0.05) at the defaults, with ``looksam_k=5``, with
  ``rst_p=0.5`` and with ESAM's data selection ``esam_gamma=0.5`` (the per-example closure: the second gradient on the
  half of the minibatch whose loss rises most, found by one extra forward pass).

Times are the **CPU time of the process** (``time.process_time``, one torch thread): the machine is shared, and its
wall time measured the other jobs more than these steps (``--clock wall`` times the wall clock). A timed block is
``--steps`` consecutive steps (a multiple of 5, so that every LookSAM block holds the same number of
ascent steps); RST's choices are random, so the fraction of sharpness-aware steps it actually took in the timed blocks
is counted and reported beside its ratio (its expected cost is ``1 + p`` passes against SAM's 2). Before timing, the
full ``SharpnessAwareELBO`` step and the base step are checked against the hand-written Bayes-by-backprop steps
(``_svi_steps.py``, ``sharpness_aware_elbo.py``: same loss and gradients from the same seed), in float64 on a copy of
the network (in float32 the ascent amplifies rounding: at ResNet-18 width 16 the two SAM steps differ by 1e-3 to 1e-2,
and by 1e-14 in float64); the cheaper steps
themselves are tested against plain-torch re-implementations in ``tests/ops/test_efficient_sam.py``,
``tests/optim/test_sam.py`` and ``tests/infer/elbo/test_sharpness_aware.py``.

Run: ``python benchmarks/efficient_sam_steps.py [--width 16] [--repeats 7] [--steps 10]``; writes
``benchmarks/results/efficient_sam_steps.md``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pyro
import torch
import torch.nn.functional as F
from _report import write_markdown
from _svi_steps import INIT_SCALE, Network, TorchBBB, check_same_step
from _timing import environment, interleaved_times, medians_ms, timing_rows
from sharpness_aware_elbo import RHO, TorchBBBSAM

from pyro_flat.infer import SharpnessAwareELBO, TensorTrace_ELBO
from pyro_flat.ops.efficient_sam import SAM_STEP
from pyro_flat.optim import SAM

SGD = {"lr": 0.01, "momentum": 0.9}
LOOKSAM_K = 5
RST_P = 0.5
ESAM_GAMMA = 0.5
CHEAPER = {f"looksam_k={LOOKSAM_K}": {"looksam_k": LOOKSAM_K}, f"rst_p={RST_P}": {"rst_p": RST_P}}


class CountedSchedule:
    """Counts the steps of a :class:`~pyro_flat.ops.efficient_sam.SharpnessSchedule` and the sharpness-aware ones
    among them (wraps its ``next_step``)."""

    def __init__(self, schedule) -> None:
        self.steps = self.ascents = 0
        self._next_step = schedule.next_step
        schedule.next_step = self.next_step

    def next_step(self) -> str:
        kind = self._next_step()
        self.steps += 1
        self.ascents += kind == SAM_STEP
        return kind

    def reset(self) -> None:
        self.steps = self.ascents = 0


class OptimizerStep:
    """One step of an optimizer on its own copy of the torch network, the loss the mean cross-entropy of a fresh
    minibatch: ``"sgd"`` (zero_grad, backward, step), ``"closure"`` (``optimizer.step(closure)``) or
    ``"per_example"`` (ESAM's closure: the per-example losses of the minibatch or of a subset of it)."""

    def __init__(self, network: Network, make_optimizer, kind: str) -> None:
        self.network, self.kind = network, kind
        self.net = network.make_net()
        self.optimizer = make_optimizer(self.net)

    def step(self) -> None:
        idx = torch.randperm(len(self.network.x), device=self.network.x.device)[: self.network.batch]
        x, y = self.network.x[idx], self.network.y[idx]

        def closure():
            loss = F.cross_entropy(self.net(x), y)
            loss.backward()
            return loss

        def per_example(subset):
            xs, ys = (x, y) if subset is None else (x[subset], y[subset])
            return F.cross_entropy(self.net(xs), ys, reduction="none")

        if self.kind == "sgd":
            self.optimizer.zero_grad()
            F.cross_entropy(self.net(x), y).backward()
            self.optimizer.step()
        else:
            self.optimizer.step(closure if self.kind == "closure" else per_example)


def variants(network: Network) -> tuple[dict[str, object], dict[str, CountedSchedule]]:
    """The timed variants, and a counter on the schedule of every cheaper one."""
    timed = {
        "TensorTrace_ELBO": network.svi(TensorTrace_ELBO()),
        "SharpnessAwareELBO": network.svi(SharpnessAwareELBO(RHO)),
        **{f"SharpnessAwareELBO {name}": network.svi(SharpnessAwareELBO(RHO, **options))
           for name, options in CHEAPER.items()},
        "torch SGD": OptimizerStep(network, lambda net: torch.optim.SGD(net.parameters(), **SGD), "sgd"),
        "SAM(SGD)": OptimizerStep(network, lambda net: SAM(net.parameters(), torch.optim.SGD, rho=RHO, **SGD),
                                  "closure"),
        **{f"SAM(SGD) {name}": OptimizerStep(
            network, lambda net, options=options: SAM(net.parameters(), torch.optim.SGD, rho=RHO, **options, **SGD),
            "closure") for name, options in CHEAPER.items()},
        f"SAM(SGD) esam_gamma={ESAM_GAMMA}": OptimizerStep(
            network, lambda net: SAM(net.parameters(), torch.optim.SGD, rho=RHO, esam_gamma=ESAM_GAMMA, **SGD),
            "per_example"),
    }
    counters = {}
    for name, variant in timed.items():
        owner = variant.loss if hasattr(variant, "loss") else variant.optimizer
        schedule = getattr(owner, "schedule", None)
        if schedule is not None and schedule.active:
            counters[name] = CountedSchedule(schedule)
    return timed, counters


def ratio_rows() -> list[tuple[str, str, str]]:
    """``(variant, its base, full SAM of its group)`` of every row of the ratio table."""
    rows = [(f"SharpnessAwareELBO{suffix}", "TensorTrace_ELBO", "SharpnessAwareELBO")
            for suffix in ["", *(f" {name}" for name in CHEAPER)]]
    rows += [(f"SAM(SGD){suffix}", "torch SGD", "SAM(SGD)")
             for suffix in ["", *(f" {name}" for name in CHEAPER), f" esam_gamma={ESAM_GAMMA}"]]
    return rows


def same_arithmetic(make_network: Callable[[], Network]) -> dict[str, float]:
    """The largest relative difference of the loss and the gradients of the base and the full SharpnessAwareELBO
    step against their hand-written steps, one step from the same seed, on a float64 copy of the network."""
    torch.set_default_dtype(torch.float64)
    try:
        network = make_network()
        network.x = network.x.to(torch.float64)  # digits are loaded in float32 whatever the default
        return {f"{name} vs {torch_name}": check_same_step(network.svi(loss), network.torch_step(cls))
                for name, loss, torch_name, cls in (("TensorTrace_ELBO", TensorTrace_ELBO(), "torch BBB", TorchBBB),
                                                    ("SharpnessAwareELBO", SharpnessAwareELBO(RHO), "torch BBB-SAM",
                                                     TorchBBBSAM))}
    finally:
        torch.set_default_dtype(torch.float32)


def measure(make_network: Callable[[], Network], repeats: int, steps: int, warmup: int,
            clock: Callable[[], float]) -> list[str]:
    """The section of one network: the ratio table, the checks and the raw timings."""
    start = time.perf_counter()
    checks = same_arithmetic(make_network)
    network = make_network()
    timed, counters = variants(network)
    for variant in timed.values():  # warm-up outside the counted steps
        for _ in range(warmup):
            getattr(variant, "enter", lambda: None)()
            variant.step()
            getattr(variant, "exit", lambda: None)()
    for counter in counters.values():
        counter.reset()
    times = interleaved_times(timed, repeats, steps, clock=clock)
    med = medians_ms(times)
    lines = [
        f"## {network.describe}",
        "",
        f"{steps} steps per timed block; {'CPU time of the process' if clock is time.process_time else 'wall time'}.",
        "",
        "| variant | / base | / full SAM | sharpness-aware steps taken (timed) |",
        "|---|---|---|---|",
    ]
    for name, base, full in ratio_rows():
        counter = counters.get(name)
        taken = (f"{counter.ascents}/{counter.steps} ({counter.ascents / counter.steps:.2f})" if counter else
                 "all" if name == full else "all (on half the minibatch)" if "esam" in name else "–")
        lines.append(f"| {name} | {med[name] / med[base]:.2f} (× {base}) | {med[name] / med[full]:.2f} | {taken} |")
    lines += ["", "Same arithmetic, checked before timing (largest relative difference of the loss and the gradients, "
              "one step from the same seed, float64): "
              + "; ".join(f"{pair} {value:.1e}" for pair, value in checks.items()) + ".",
              "", *timing_rows(times), "", f"Wall time of this section: {time.perf_counter() - start:.0f} s."]
    return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", nargs="+", default=["mlp", "resnet18"], choices=["mlp", "resnet18"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block on the MLP (a multiple of 5)")
    parser.add_argument("--resnet-steps", type=int, default=10, help="steps per timed block on ResNet-18")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of every variant first")
    parser.add_argument("--width", type=int, default=16, help="ResNet-18's first-stage width (64: the network)")
    parser.add_argument("--num-data", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="ResNet-18's minibatch")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="time the CPU time of the process (default) or the wall clock")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "efficient_sam_steps.md")
    args = parser.parse_args(argv)
    if args.steps % LOOKSAM_K or args.resnet_steps % LOOKSAM_K:
        parser.error(f"--steps and --resnet-steps must be multiples of LookSAM's period {LOOKSAM_K}")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)  # Pyro's checks and torch.distributions' argument checks, for every variant
    pyro.set_rng_seed(0)
    lines = [
        "# Cheaper sharpness-aware steps: LookSAM, RST and ESAM against their base and full SAM",
        "",
        f"float32, eager, Pyro's validation and torch.distributions' argument checks off for every variant; "
        f"{args.repeats} repeats per variant after {args.warmup} untimed warm-up steps, "
        f"{'the CPU time of the process' if args.clock == 'cpu' else 'wall time'}, the variants of a network "
        "interleaved in one run (every variant in every repeat, the order reversed every other repeat, so that the "
        "drift of the shared 2-core machine, where other jobs ran, hits all alike), median over repeats. "
        f"{environment()}",
        "",
        f"SVI: AutoNormal (init scale {INIT_SCALE}), `pyro.optim.Adam` 1e-3, rho {RHO}. Optimizers on the torch "
        f"network, closure = mean cross-entropy of one fresh minibatch: SGD (lr {SGD['lr']}, momentum "
        f"{SGD['momentum']}), SAM(SGD) rho {RHO}. Cheaper steps: LookSAM k = {LOOKSAM_K} (alpha 0.7, the ascent every "
        f"{LOOKSAM_K}th step), RST p = {RST_P} (a sharpness-aware step with probability {RST_P}; expected cost 1.5 "
        f"passes), ESAM gamma = {ESAM_GAMMA} (optimizers only: the second gradient on half the minibatch, after one "
        "extra forward pass to select it). The goal of issue 22: a cheaper step at ≤ 1.25 × its base.",
    ]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for name in args.networks:
        if name == "mlp":
            make_network, steps = partial(Network, "mlp"), args.steps
        else:
            make_network = partial(Network, "resnet18", width=args.width, num_data=args.num_data, batch=args.batch)
            steps = args.resnet_steps
        lines += ["", *measure(make_network, args.repeats, steps, args.warmup, clock)]
    return write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    main()
