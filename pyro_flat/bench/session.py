"""A harness session: the process group under ``torchrun`` and a run's outputs, shared by the ``bench`` and ``recipe``
commands.

* :func:`init_distributed` / :func:`shutdown_distributed`: under ``torchrun`` (``WORLD_SIZE`` set, even to 1) one
  process per device (``cuda:LOCAL_RANK`` with NCCL for a CUDA device, gloo on CPU), each on its shard of every
  minibatch; rank 0 writes the outputs;
* :func:`run_and_report`: run the jobs (datasets x methods x seeds) and write the table, ``results.json``, the
  per-epoch log and the figures.

Everything here takes plain arguments: the command line parses its flags into them, a recipe computes them for each
stage.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from .batches import is_distributed, world
from .config import RunConfig
from .files import atomic_write_text
from .report import markdown_table, plot_curves, plot_flat_vs_base, plot_reliability, record_dict, write_json
from .runner import RunRecord, run_benchmark

__all__ = ["init_distributed", "run_and_report", "shutdown_distributed"]


def init_distributed(config: RunConfig) -> RunConfig:
    """Under ``torchrun``: initialise the process group once (NCCL on GPUs, gloo on CPU) and give each rank its
    device (``cuda:LOCAL_RANK``); elsewhere ``config`` unchanged."""
    if "WORLD_SIZE" not in os.environ:  # not launched by torchrun
        return config
    cuda = config.device.startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if not cuda:
        return config
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return config.replace(device=f"cuda:{local_rank}")


def shutdown_distributed() -> None:
    """End the process group, if any, once every rank is done."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


def run_and_report(
    datasets: Sequence[str],
    methods: Sequence[str],
    seeds: int,
    config: RunConfig,
    out: Path,
    *,
    command: str,
    checkpoint_every: int | None = None,
    resume: bool = False,
    progress: bool = True,
    figures: bool = True,
) -> list[RunRecord]:
    """Run every method on every dataset for the seeds ``0`` to ``seeds - 1`` and write the table, JSON, per-epoch
    log and the figures there are data for to ``out`` (rank 0), saying which files were written.

    :param command: the command line that started the run, written with the results.
    :param checkpoint_every: steps between checkpoints (in ``out/checkpoints``; 0: only at the end of each phase;
        ``None``, the default: no checkpoints unless ``resume``).
        Checkpoints are written when it is set or with ``resume``.
    :param resume: continue a killed run from ``out/checkpoints``, exactly where it stopped.
    :param progress: show progress bars.
    :param figures: draw the figures (``False``: the table, JSON and log only; drawing takes seconds per dataset
        when many methods run). Either way no figure of an earlier run in ``out`` stays behind.
    :returns: every job's record (on every rank).
    """
    rank = world()[0]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    checkpoints = out / "checkpoints" if (checkpoint_every is not None or resume) else None
    records = run_benchmark(datasets, methods, list(range(seeds)), config, progress=progress,
                            checkpoint_dir=checkpoints, checkpoint_every=checkpoint_every or 0, resume=resume,
                            metrics_log=out / "metrics.jsonl")
    if is_distributed():
        dist.barrier()
    if rank != 0:
        return records
    table = markdown_table(records)
    print(table)
    atomic_write_text(out / "table.md", f"`{command}`\n\n{table}\n")
    write_json(out / "results.json", records, config, command)
    written = ["table.md", "results.json", "metrics.jsonl"]
    for dataset in datasets:
        chosen = [r for r in records if r.dataset == dataset]
        names = (f"reliability_{dataset}.png", f"curves_{dataset}.png", f"flat_vs_base_{dataset}.png")
        drawn = (False, False, False)
        if figures:
            drawn = (plot_reliability(out / names[0], chosen), plot_curves(out / names[1], chosen),
                     plot_flat_vs_base(out / names[2], [record_dict(r) for r in chosen], dataset))
        for name, was_drawn in zip(names, drawn, strict=True):
            if was_drawn:
                written.append(name)
            else:  # nothing drawn in this run: no figure of an earlier run in the same folder stays behind
                (out / name).unlink(missing_ok=True)
    print(f"wrote {out}/: {', '.join(written)}")
    return records
