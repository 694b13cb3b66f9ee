"""A harness session: the process group under ``torchrun`` and a run's outputs, shared by the ``bench`` and ``recipe``
commands.

* :func:`init_distributed` / :func:`shutdown_distributed`: under ``torchrun`` (``WORLD_SIZE`` set, even to 1) one
  process per device (``cuda:LOCAL_RANK`` with NCCL for a CUDA device, gloo on CPU), each on its shard of every
  minibatch; rank 0 writes the outputs. Every collective operation times out (``timeout``: minutes, not torch's 30);
  :func:`unresponsive_ranks` then names the ranks that stopped answering;
* :func:`run_and_report`: run the jobs (datasets x methods x seeds) and write the table, ``results.json``, the
  per-epoch log, the run's log and the figures — rebuilt from the records after every job, so that a run stopped at
  any point leaves the results of the jobs that finished.

Everything here takes plain arguments: the command line parses its flags into them, a recipe computes them for each
stage.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .batches import is_distributed, world
from .config import RunConfig
from .files import append_log, atomic_write_text
from .report import markdown_table, plot_curves, plot_flat_vs_base, plot_reliability, record_dict, write_json
from .runner import RunRecord, run_benchmark

__all__ = ["DEFAULT_TIMEOUT", "init_distributed", "run_and_report", "shutdown_distributed", "unresponsive_ranks"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""How long a collective operation waits for the other ranks (``--dist-timeout``): long enough for a slow step or an
evaluation on one rank, short enough that a stalled rank does not hold the others for torch's default 30 minutes."""

_watch: dict[str, object] = {}  # a side gloo group on which unresponsive_ranks asks every rank, and its timeout


def init_distributed(config: RunConfig, timeout: timedelta = DEFAULT_TIMEOUT) -> RunConfig:
    """Under ``torchrun``: initialise the process group once (NCCL on GPUs, gloo on CPU), with ``timeout`` for every
    collective operation, and give each rank its device (``cuda:LOCAL_RANK``); elsewhere ``config`` unchanged.

    :raises ValueError: if this rank's GPU does not exist.
    """
    if "WORLD_SIZE" not in os.environ:  # not launched by torchrun
        return config
    cuda = config.device.startswith("cuda")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(f"--device {config.device} under torchrun: rank {local_rank} of this machine has no GPU of "
                         f"its own ({torch.cuda.device_count()} GPUs); start at most that many processes per node")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        _watch.update(group=dist.new_group(backend="gloo", timeout=timeout), timeout=timeout)
    if not cuda:
        return config
    torch.cuda.set_device(local_rank)
    return config.replace(device=f"cuda:{local_rank}")


def unresponsive_ranks() -> list[int] | None:
    """After a collective operation failed: the ranks that do not answer a barrier within the process group's timeout
    (at most a minute), asked on a side gloo group (the failed group's connections are broken). Rank 0 names them
    (``[]`` if every rank answered); the other ranks, and any rank when the question itself fails, get ``None``."""
    group = _watch.get("group")
    if group is None:
        return None
    wait = min(_watch["timeout"], timedelta(minutes=1))
    try:
        dist.monitored_barrier(group=group, timeout=wait, wait_all_ranks=True)
    except RuntimeError as error:
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(error))
        return [int(rank) for rank in found.group(1).split(",")] if found else None
    return [] if dist.get_rank() == 0 else None


def shutdown_distributed() -> None:
    """End the process group, if any, once every rank is done."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()
        _watch.clear()


class _Outputs:
    """The outputs of a run in ``out``, rewritten from the records after every job (rank 0): ``table.md``,
    ``results.json`` and the figures of the dataset the job ran on (drawn after the jobs that ran, not after each
    record a resume read back)."""

    def __init__(self, out: Path, datasets: Sequence[str], config: RunConfig, command: str, figures: bool) -> None:
        self.out, self.datasets, self.config, self.command, self.figures = out, datasets, config, command, figures
        self.records: list[RunRecord] = []
        self.drawn: dict[str, list[str]] = {}  # dataset -> the figures drawn for it
        self.stale: set[str] = set()  # datasets whose figures lag behind their records

    def add(self, record: RunRecord, resumed: bool) -> None:
        self.records.append(record)
        label = f"{record.dataset}/{record.method}/seed {record.seed}"
        if record.error is not None:
            tqdm.write(f"pyro_flat: {record.error}", file=sys.stderr)
        else:
            append_log(self.out / "run.log", f"{label}: {'read back' if resumed else 'done'} "
                                              f"(fit {record.fit_seconds:.1f} s)")
        self.write_tables()
        self.stale.add(record.dataset)
        if not resumed:
            self.draw(record.dataset)

    def write_tables(self) -> None:
        atomic_write_text(self.out / "table.md", f"`{self.command}`\n\n{markdown_table(self.records)}\n")
        write_json(self.out / "results.json", self.records, self.config, self.command)

    def draw(self, dataset: str) -> None:
        """Draw ``dataset``'s figures from its finished records; remove those with nothing to show (a figure of an
        earlier run in the same folder does not stay behind)."""
        chosen = [r for r in self.records if r.dataset == dataset and r.error is None]
        names = (f"reliability_{dataset}.png", f"curves_{dataset}.png", f"flat_vs_base_{dataset}.png")
        drawn = (False, False, False)
        if self.figures:
            drawn = (plot_reliability(self.out / names[0], chosen), plot_curves(self.out / names[1], chosen),
                     plot_flat_vs_base(self.out / names[2], [record_dict(r) for r in chosen], dataset))
        for name, was_drawn in zip(names, drawn, strict=True):
            if not was_drawn:
                (self.out / name).unlink(missing_ok=True)
        self.drawn[dataset] = [name for name, was_drawn in zip(names, drawn, strict=True) if was_drawn]
        self.stale.discard(dataset)

    def finish(self) -> None:
        """Bring every figure up to date, print the table, what was written and which jobs failed."""
        for dataset in self.datasets:
            if dataset in self.stale or dataset not in self.drawn:
                self.draw(dataset)
        print(markdown_table(self.records))
        figures = [name for dataset in self.datasets for name in self.drawn[dataset]]
        print(f"wrote {self.out}/: {', '.join(['table.md', 'results.json', 'metrics.jsonl', 'run.log', *figures])}")
        failed = [r for r in self.records if r.error is not None]
        if failed:
            print(f"pyro_flat: {len(failed)} of {len(self.records)} jobs failed (marked in table.md; tracebacks in "
                  f"{self.out / 'run.log'}): {', '.join(f'{r.dataset}/{r.method}/seed {r.seed}' for r in failed)}",
                  file=sys.stderr)


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
    fail_fast: bool = False,
) -> list[RunRecord]:
    """Run every method on every dataset for the seeds ``0`` to ``seeds - 1`` and write to ``out`` (rank 0), after
    every job: each finished job's record (``out/records/<job>/record.pt``), the table, ``results.json`` and the
    figures there are data for; as it goes: the per-epoch log (``metrics.jsonl``) and the run's log (``run.log``: the
    tracebacks of failed jobs). A job that raises or diverges is recorded as failed (one line on stderr, marked in
    the table) and the others run; at the end it says which files were written and which jobs failed.

    :param command: the command line that started the run, written with the results.
    :param checkpoint_every: steps between checkpoints (in ``out/checkpoints``; 0: only at the end of each phase;
        ``None``, the default: no checkpoints unless ``resume``).
    :param resume: continue a stopped run: the finished jobs' records are read back (with or without checkpoints),
        an interrupted job continues from its last checkpoint, exactly (or starts again without one).
    :param progress: show progress bars.
    :param figures: draw the figures (``False``: the table, JSON and logs only; drawing takes seconds per dataset
        when many methods run). Either way no figure of an earlier run in ``out`` stays behind.
    :param fail_fast: stop at the first failed job (:class:`~pyro_flat.bench.runner.JobFailed`).
    :returns: every job's record (on every rank); failed jobs have :attr:`~pyro_flat.bench.runner.RunRecord.error`.
    """
    rank = world()[0]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    checkpoints = out / "checkpoints" if (checkpoint_every is not None or resume) else None
    outputs = _Outputs(out, datasets, config, command, figures)
    if rank == 0:
        append_log(out / "run.log", f"start: {command}")
    records = run_benchmark(datasets, methods, list(range(seeds)), config, progress=progress,
                            on_record=outputs.add if rank == 0 else None, checkpoint_dir=checkpoints,
                            checkpoint_every=checkpoint_every or 0, resume=resume,
                            metrics_log=out / "metrics.jsonl", record_dir=out / "records", run_log=out / "run.log",
                            on_failure="stop" if fail_fast else "continue")
    if is_distributed():
        dist.barrier()
    if rank == 0:
        outputs.finish()
    return records
