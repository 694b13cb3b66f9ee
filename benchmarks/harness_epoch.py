"""The harness's epoch time against its steps alone: what building the augmented minibatches (and the loop's
bookkeeping) adds to training, for each way of building them.

A method of the harness (default ``map``, ``vi``) trains on a generated CIFAR-10 folder (``write_synthetic_cifar``;
nothing downloads) with augmentation through the harness's own loop (``Problem.loop``, checkpoints off), so the step
is whatever the harness runs. The loop is instrumented: the time spent inside the loop (building the next batch,
bookkeeping) and the time the method's step takes (from handing over a batch to asking for the next) are summed per
epoch. Variants:

* ``device``: the batches built on the run's device by ``DeviceBatches`` (the default, ``--num-workers 0``);
* ``loader, main process``: the ``DataLoader`` path building the same batches on the CPU in the main process;
* ``loader, 2 workers``: the same in 2 worker processes (``--num-workers 2``);
* ``one fixed batch``: every step gets the same batch, built once: the steps alone.

Reported, medians over repeats (every variant in every repeat, the order alternating) of the epochs after the first:
the epoch time, the time of its steps, and the ratio **epoch time / (steps x the step time alone)** (issue 19's goal:
at most 1.15), the step time alone being both the epoch's own steps and the median step of ``one fixed batch``. On a
CPU the step and the batch building share the cores; on a GPU the device batches are a few kernels queued behind the
step (this script times CPU runs: a step's time on a GPU needs a synchronisation that the harness does not make).

Run: ``python benchmarks/harness_epoch.py`` (3 repeats, about 10 minutes on one core; writes
``benchmarks/results/harness_epoch.md``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pyro
import torch
from _report import write_markdown
from _timing import environment

from pyro_flat.bench import METHODS, RunConfig
from pyro_flat.bench import loop as harness_loop
from pyro_flat.bench import methods as _registered  # noqa: F401  (fills METHODS)
from pyro_flat.bench.problem import Problem, to_device
from pyro_flat.bench.registry import load_data
from pyro_flat.data import write_synthetic_cifar

VARIANTS = ("device", "loader, main process", "loader, 2 workers", "one fixed batch")


class _FixedStream:
    """A stream giving one batch of the real stream at every step."""

    def __init__(self, stream: harness_loop.LoaderStream) -> None:
        self.stream, self.batch = stream, next(stream)

    def __next__(self) -> object:
        return self.batch

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (checkpoints are off)."""


class _MainProcessLoader(harness_loop.LoaderStream):
    """The ``DataLoader`` path without workers (the harness takes it only with workers)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._on_device = None


def _timed_epochs(problem: Problem, method: str, variant: str) -> list[tuple[float, float, int]]:
    """``(epoch seconds, seconds of steps, steps)`` of every epoch of one fit of ``method``."""
    epochs: list[tuple[float, float, int]] = []
    original_iter, original_stream = harness_loop.TrainingLoop.__iter__, problem.stream
    spe = problem.steps_per_epoch

    def stream(phase: int, *, explicit: bool = False) -> object:
        if variant == "loader, main process":
            config = problem.config
            return _MainProcessLoader(problem.data, problem.batch_size, harness_loop.stream_seed(problem.seed, phase),
                                      channels_last=config.channels_last)
        made = original_stream(phase, explicit=explicit)
        return _FixedStream(made) if variant == "one fixed batch" else made

    def instrumented(self: harness_loop.TrainingLoop) -> object:
        epoch_start, steps_seconds, count = time.perf_counter(), 0.0, 0
        for item in original_iter(self):
            handed = time.perf_counter()
            yield item
            steps_seconds += time.perf_counter() - handed
            count += 1
            if count == spe:
                epochs.append((time.perf_counter() - epoch_start, steps_seconds, count))
                epoch_start, steps_seconds, count = time.perf_counter(), 0.0, 0

    harness_loop.TrainingLoop.__iter__ = instrumented
    problem.stream = stream
    try:
        pyro.clear_param_store()
        pyro.set_rng_seed(problem.seed)
        METHODS[method].fit(problem)
    finally:
        harness_loop.TrainingLoop.__iter__ = original_iter
    return epochs


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["map", "vi"])
    parser.add_argument("--model", default="preresnet")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--num-data", type=int, default=1280, help="training images (generated)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per fit (the first is not reported)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "harness_epoch.md")
    args = parser.parse_args(argv)
    variants = list(dict.fromkeys([*args.variants, "one fixed batch"]))
    root = Path(tempfile.mkdtemp(prefix="cifar-"))
    write_synthetic_cifar(root, "cifar10", num_train=args.num_data, num_test=16)
    results: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for repeat in range(args.repeats):
        order = variants if repeat % 2 == 0 else variants[::-1]
        for method in args.methods:
            for variant in order:
                config = RunConfig(model=args.model, depth=args.depth, width=args.width, data_root=str(root),
                                   num_epochs=args.epochs, batch_size=args.batch, device=args.device,
                                   num_workers=2 if variant == "loader, 2 workers" else 0)
                problem = Problem(to_device(load_data("cifar10", config), config), config, seed=0)
                epochs = _timed_epochs(problem, method, variant)
                results.setdefault((method, variant), []).extend(epochs[1:])  # the first epoch warms up
    steps = problem.steps_per_epoch
    lines = [
        f"# Harness epoch time against the steps alone ({args.model} depth {args.depth} width {args.width}, "
        f"{args.num_data} generated CIFAR images, batch {args.batch}, {steps} steps per epoch, {args.device})", "",
        f"{environment()} Medians over {args.repeats} repeats x {args.epochs - 1} epochs (the first epoch of each "
        "fit is not counted).", "",
        "| method | batches built by | epoch (s) | its steps (s) | epoch / its steps | step alone (ms) | "
        "epoch / (steps x step alone) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in args.methods:
        alone = statistics.median(s / n for _, s, n in results[(method, "one fixed batch")])
        for variant in variants:
            rows = results[(method, variant)]
            epoch, inside = statistics.median(e for e, _, _ in rows), statistics.median(s for _, s, _ in rows)
            within = statistics.median(e / s for e, s, _ in rows)
            lines.append(f"| {method} | {variant} | {epoch:.3f} | {inside:.3f} | {within:.3f} | {alone * 1e3:.1f} | "
                         f"{epoch / (steps * alone):.3f} |")
    lines += ["", "*epoch / its steps*: the epoch's time over the time its own steps took (what building the batches "
              "and the loop's bookkeeping add; robust to the machine's load, which slows both alike). *epoch / (steps "
              "x step alone)*: over the median step of `one fixed batch`, measured in other fits (it also shows steps "
              "slowed by the data, and the load's drift between fits)."]
    return write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
