"""Run registered methods over datasets and seeds, and evaluate each fitted posterior the same way.

A run never loses finished work: each job's record is written (atomically) the moment it ends, a job that raises or
diverges is recorded as failed with a one-line reason while the others run (or, with ``on_failure="stop"``, the run
stops there), and what every job is bound to fail on is refused before the first starts (:func:`check_jobs`). Faults
of the whole run — a full disk, a rank of a data-parallel run that stopped answering, a signal — end it, with the
finished jobs' records on disk for ``resume``.
"""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Literal

import pyro
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..data import ClassificationData
from ..distributed import local_batchnorm
from ..infer.predict import bma_predict
from ..metrics import evaluate, hessian_eigenvalues, model_loss_fn
from ..nn import has_batchnorm, refresh_batchnorm
from . import methods as _methods  # noqa: F401  (registers every method)
from .batches import is_distributed, world
from .config import RunConfig
from .context import RunContext, check_fingerprint
from .files import (
    CheckpointError,
    OutputFolderError,
    append_log,
    atomic_save,
    disk_full,
    load_checkpoint,
    metrics_log_writer,
    output_lock,
)
from .models import MODELS
from .options import check_option_values
from .problem import Posterior, Problem, to_device
from .registry import METHODS, check_method_options, dataset_names, load_data, lookup
from .signals import Interrupted, should_stop


@dataclass
class RunRecord:
    """One (dataset, method, seed) run: its metrics and what produced them."""

    dataset: str
    method: str
    seed: int
    metrics: dict[str, float]
    fit_seconds: float
    info: dict[str, Any] = field(default_factory=dict)
    test_probs: torch.Tensor | None = field(default=None, repr=False)
    test_labels: torch.Tensor | None = field(default=None, repr=False)
    entries: list[dict] = field(default_factory=list, repr=False)
    error: str | None = None
    """Why the job failed (its metrics are then empty), or ``None``."""


def posterior_lambda_max(posterior: Posterior, data: ClassificationData, config: RunConfig) -> float:
    r"""Mean over ``config.lambda_max_draws`` posterior draws of the top eigenvalue of the Hessian of the training loss
    :math:`L(\theta)=-\frac1n\sum_{i\le n}\log p(y_i\mid x_i,\theta)` on the first ``lambda_max_points`` training
    points (dropout off, BatchNorm in eval mode with the statistics of the last refresh)."""
    model = posterior.model
    n = min(config.lambda_max_points, data.num_data)
    x, y = data.x_train[:n], data.y_train[:n]
    was_training = model.training
    model.eval()
    try:
        loss_fn = model_loss_fn(model, x, y)
        values = []
        for draw in islice(posterior.draw(config.lambda_max_draws), config.lambda_max_draws):
            if has_batchnorm(model):
                refresh_batchnorm(model, draw, data.x_train)
                model.eval()
            eig = hessian_eigenvalues(loss_fn, dict(draw), k=1, num_iters=config.lambda_max_iters)
            values.append(eig[0])
        return float(torch.stack(values).mean())
    finally:
        model.train(was_training)


def evaluate_posterior(
    posterior: Posterior, data: ClassificationData, config: RunConfig
) -> tuple[dict[str, float], torch.Tensor]:
    """Accuracy, BMA NLL, ECE, Brier, OOD AUROC/AUPR (feature-shuffled test inputs) and :math:`\\lambda_{\\max}`;
    also returns the BMA test probabilities. Data-parallel, every rank evaluates on the same inputs, so BatchNorm
    refreshes use each rank's own statistics (:func:`~pyro_flat.distributed.local_batchnorm`)."""
    inputs = {"test": data.x_test} if data.x_ood is None else {"test": data.x_test, "ood": data.x_ood}
    with local_batchnorm(posterior.model):
        bma = bma_predict(
            posterior.model,
            posterior.draw(posterior.num_samples),
            inputs,
            mc_dropout=posterior.mc_dropout,
            batchnorm_inputs=data.x_train if has_batchnorm(posterior.model) else None,
            batch_size=1024,
        )
        report = evaluate(bma["test"], data.y_test, ood_predictions=bma.get("ood"))
        report["lambda_max"] = posterior_lambda_max(posterior, data, config)
    return report, bma["test"].probs


FINGERPRINT_IGNORES = ("data_root", "num_workers")
"""The ``RunConfig`` fields that do not change a job's results: where the data folder is, and how many workers build
the same batches."""


def job_fingerprint(dataset: str, method: str, seed: int, config: RunConfig) -> dict[str, Any]:
    """What determines a job's results, as a flat dict that a resume compares key by key: the dataset, method, seed,
    every ``RunConfig`` field but :data:`FINGERPRINT_IGNORES`, and the method's own options (``options.<key>``; other
    methods' options do not change this job)."""
    fields = {k: v for k, v in config.to_dict().items() if k not in FINGERPRINT_IGNORES and k != "options"}
    options = {f"options.{k}": v for k, v in sorted(config.options.get(method, {}).items())}
    return {"dataset": dataset, "method": method, "seed": seed, **fields, **options}


def job_name(dataset: str, method: str, seed: int) -> str:
    """The folder name of a job's checkpoints."""
    return f"{dataset}__{method}__seed{seed}"


def run_one(
    method: str, dataset: str, seed: int, config: RunConfig, *, context: RunContext | None = None
) -> RunRecord:
    """Fit ``method`` on ``dataset`` with ``seed`` and evaluate it; ``context`` sets checkpoints, resume, progress
    and the per-epoch log (default: none of them)."""
    spec = lookup(METHODS, "method", method)
    data = to_device(load_data(dataset, config), config)
    context = RunContext(label=f"{dataset}/{method}/seed {seed}") if context is None else context
    problem = Problem(data, config, seed, context)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    try:
        posterior = spec.fit(problem)
    except FloatingPointError as error:
        message = str(error) if str(error).startswith(context.label) else f"{context.label}: {error}"
        raise FloatingPointError(f"{message} ({context.last_good()})") from error
    except ValueError as error:  # e.g. Pyro's validation of non-finite logits
        where = context.diverged(error)
        if where is None:
            raise
        found = re.match(r"Expected parameter (\w+)", str(error))  # Pyro's validation: a page on the distribution
        first = f"invalid values of {found.group(1)}" if found else str(error).splitlines()[0]
        raise FloatingPointError(f"{context.label} diverged: {where}; training stopped on {first} "
                                 f"({context.last_good()})") from error
    fit_seconds = time.perf_counter() - start
    context.evaluating = True
    pyro.set_rng_seed(10_000 + seed)
    metrics, probs = evaluate_posterior(posterior, data, config)
    return RunRecord(dataset, method, seed, metrics, fit_seconds, posterior.info, probs.cpu(), data.y_test.cpu(),
                     list(context.entries))


def check_device(device: str) -> None:
    """Refuse a ``--device`` this machine does not have: not a torch device, or an accelerator (CUDA, MPS, ...) that
    is not available, or an index past the devices it has.

    :raises ValueError: naming the flag and what is there.
    """
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device}: not a torch device (e.g. cpu, cuda, cuda:1, mps)") from None
    backend = getattr(torch, parsed.type, None) if parsed.type != "cpu" else None
    if backend is None or not hasattr(backend, "is_available"):
        return
    if not backend.is_available():
        raise ValueError(f"--device {device}: no {parsed.type} device is available on this machine "
                         f"(torch.{parsed.type}.is_available() is False); use --device cpu")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"--device {device}: this machine has {count} {parsed.type} device(s), numbered from 0")


def check_jobs(datasets: Sequence[str], methods: Sequence[str], config: RunConfig, *, files: bool = True) -> None:
    """Refuse, before any training, what the jobs are bound to fail on: unknown names, the device, option values a
    method would refuse, a batch the ranks cannot share equally, options that do not run data-parallel, and each
    method's own check (:class:`~pyro_flat.bench.registry.MethodSpec`: e.g. a SWAG schedule collecting fewer
    snapshots than its guide needs, an SG-MCMC method under ``torchrun``) on every dataset, read once.

    :param files: check that every file an option reads exists or is written by one of ``methods`` (a recipe's
        stage reads files its earlier stages write: it checks them itself).
    :raises ValueError: naming the flag, method or option at fault (``FileNotFoundError`` for a missing data file).
    """
    names = dataset_names()
    for name in datasets:
        if name not in names:
            raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(names)}")
    specs = [lookup(METHODS, "method", name) for name in methods]
    if config.model not in MODELS:
        raise ValueError(f"--model {config.model}: unknown model; known models: {', '.join(sorted(MODELS))}")
    check_device(config.device)
    check_method_options(config.options)
    check_option_values(config, methods if files else None)
    for dataset in datasets:
        problem = Problem(load_data(dataset, config), config)
        shard = problem.shard_size  # raises if the ranks cannot share the batch equally
        for spec in specs:
            options = config.options.get(spec.name, {})
            if options.get("m_sharpness", 1) > shard:
                raise ValueError(f"{spec.name}.m_sharpness must be at most each rank's share of the batch ({shard}), "
                                 f"got {options['m_sharpness']}")
            if problem.distributed and options.get("esam_gamma", 1) < 1:
                raise ValueError(f"{spec.name}.esam_gamma: ESAM's data selection runs in one process (its "
                                 "per-example closure is not data-parallel); run it without torchrun")
            if spec.check is not None:
                spec.check(problem, spec.name)


def collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective operation of a data-parallel run (a timeout, a rank that closed its
    connection): the process group is then unusable, and the run must end."""
    if not is_distributed():
        return False
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, dist.DistError) or (isinstance(seen, RuntimeError) and any(
                sign in str(seen) for sign in ("Timed out", "timed out", "Connection closed", "NCCL", "gloo"))):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def ends_the_run(error: BaseException) -> bool:
    """Whether ``error`` is a fault of the whole run rather than of one job: a full disk, a failed collective
    operation, or an output folder whose files belong to another configuration."""
    return disk_full(error) is not None or collective_failure(error) or isinstance(error, OutputFolderError)


def run_benchmark(
    datasets: Sequence[str],
    methods: Sequence[str],
    seeds: Sequence[int],
    config: RunConfig,
    *,
    progress: bool = True,
    on_record: Callable[[RunRecord, bool], None] | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    metrics_log: Path | None = None,
    record_dir: Path | None = None,
    run_log: Path | None = None,
    on_failure: Literal["raise", "continue", "stop"] = "raise",
) -> list[RunRecord]:
    """Run every method on every dataset for every seed; what the jobs are bound to fail on is refused before any
    training starts (:func:`check_jobs`).

    :param on_record: called after every job as ``on_record(record, resumed)`` (``resumed``: read back by a resume).
    :param checkpoint_dir: a folder of per-job checkpoints (``<dataset>__<method>__seed<s>/``: the rolling checkpoint,
        each training phase's final state, collected draws). One run at a time writes there
        (:func:`~pyro_flat.bench.files.output_lock`; stale temporary files are removed), and a run without ``resume``
        refuses to start over checkpoints of an earlier one.
    :param checkpoint_every: steps between checkpoints (0: only at the end of every training phase).
    :param resume: continue a killed run: finished jobs are read back from ``record_dir`` after checking that their
        configuration is this run's, the interrupted one continues from its last checkpoint, exactly.
    :param metrics_log: a JSON-lines file receiving one entry per training epoch (rebuilt on resume).
    :param record_dir: where each finished job's record goes the moment it ends (``<job>/record.pt``; default
        ``checkpoint_dir``); without ``resume`` the records of this run's jobs there are removed first.
    :param run_log: a text file receiving the traceback of every failed job.
    :param on_failure: what a job that raises or diverges does: ``"raise"`` (the default) the error propagates;
        ``"continue"`` the job is recorded as failed (:attr:`RunRecord.error`: the job, where, the cause and the log)
        and the others run; ``"stop"`` the same, then :class:`JobFailed`. Faults of the whole run
        (:func:`ends_the_run`) propagate whatever this is.
    :raises OutputFolderError: if another run holds ``checkpoint_dir``, it holds checkpoints and ``resume`` is off, or
        a resume finds files of another configuration.
    """
    check_jobs(datasets, methods, config)
    if not seeds:
        raise ValueError("`seeds` is empty")
    jobs = [(d, m, s) for d in datasets for m in methods for s in seeds]
    writer = world()[0] == 0
    record_dir = checkpoint_dir if record_dir is None else record_dir
    with output_lock(checkpoint_dir) if checkpoint_dir is not None else nullcontext():
        if checkpoint_dir is not None and not resume:
            _refuse_earlier_checkpoints(Path(checkpoint_dir), jobs)
        if record_dir is not None and not resume and writer:  # an earlier run's records of these jobs are superseded
            for job in jobs:
                (Path(record_dir) / job_name(*job) / "record.pt").unlink(missing_ok=True)
        return _run_jobs(jobs, config, progress=progress, on_record=on_record, checkpoint_dir=checkpoint_dir,
                         checkpoint_every=checkpoint_every, resume=resume, metrics_log=metrics_log, writer=writer,
                         record_dir=record_dir, run_log=run_log, on_failure=on_failure)


class JobFailed(Exception):
    """A run stopped at its first failed job (``on_failure="stop"``, ``--fail-fast``); the message is the job's
    one-line reason."""


def _refuse_earlier_checkpoints(checkpoint_dir: Path, jobs: Sequence[tuple[str, str, int]]) -> None:
    for job in jobs:
        directory = checkpoint_dir / job_name(*job)
        if directory.is_dir() and any(directory.iterdir()):
            raise OutputFolderError(
                f"{directory} holds the checkpoints of an earlier run, and this run would overwrite them: continue "
                "it with --resume (resume=True), or delete the folder, or choose another output folder"
            )


def failure_reason(context: RunContext, error: BaseException, run_log: Path | None,
                   directory: Path | None) -> str:
    """One line: the job, where it was (step or stage), the cause, and where the traceback is; for a damaged
    checkpoint, what to do."""
    cause = str(error).strip().splitlines()[0] if str(error).strip() else ""
    cause = cause.removeprefix(f"{context.label}: ").removeprefix(f"{context.label} ")
    if not isinstance(error, (ValueError, FloatingPointError)) or not cause:
        cause = f"{type(error).__name__}: {cause}".rstrip(": ")
    where = "" if isinstance(error, FloatingPointError) else f" {context.position()}"  # a divergence names its step
    if isinstance(error, CheckpointError):
        folder = directory if error.path is None else error.path.parent
        cause += f"; to redo this job from its start, delete {folder} and run again with --resume"
    log = f" (traceback in {run_log})" if run_log is not None else ""
    return f"{context.label} failed{where}: {cause}{log}"


def _run_jobs(
    jobs: Sequence[tuple[str, str, int]],
    config: RunConfig,
    *,
    progress: bool,
    on_record: Callable[[RunRecord, bool], None] | None,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    resume: bool,
    metrics_log: Path | None,
    writer: bool,
    record_dir: Path | None,
    run_log: Path | None,
    on_failure: str,
) -> list[RunRecord]:
    log = None
    if metrics_log is not None:
        log = metrics_log_writer(metrics_log)
        if writer:
            metrics_log.parent.mkdir(parents=True, exist_ok=True)
            metrics_log.write_text("")
    records: list[RunRecord] = []
    bar = tqdm(jobs, disable=not (progress and writer), desc="pyro_flat bench")
    for dataset, method, seed in bar:
        label, fingerprint = f"{dataset}/{method}/seed {seed}", job_fingerprint(dataset, method, seed, config)
        signum = should_stop()
        if signum is not None:
            raise Interrupted(signum, f"before {label}")
        bar.set_postfix_str(label)
        directory = None if checkpoint_dir is None else Path(checkpoint_dir) / job_name(dataset, method, seed)
        done = None if record_dir is None else Path(record_dir) / job_name(dataset, method, seed) / "record.pt"
        resumed = resume and done is not None and done.exists()
        context = RunContext(label=label)
        try:
            if resumed:  # finished before: read back
                saved = load_checkpoint(done)
                check_fingerprint(label, done, saved.pop("fingerprint", None), fingerprint)
                record = RunRecord(**saved)
                entries = record.entries
            else:
                context = RunContext(label=label, directory=directory, every=checkpoint_every, resume=resume,
                                     progress=progress, log=log, is_writer=writer, fingerprint=fingerprint)
                entries = context.restored_entries  # logged before the job logs its next epochs
            for entry in entries if (log is not None and writer) else []:
                log(entry)
            if not resumed:
                record = run_one(method, dataset, seed, config, context=context)
                if done is not None and writer:
                    done.parent.mkdir(parents=True, exist_ok=True)
                    atomic_save(vars(record) | {"fingerprint": fingerprint}, done)
        except Exception as error:
            # data-parallel, a job that fails on one rank (a NaN in its shard) must not go on alone: the others are
            # still in the job's collectives, so the run ends (torchrun stops every rank; finished jobs are on disk)
            if on_failure == "raise" or ends_the_run(error) or is_distributed():
                raise
            reason = failure_reason(context, error, run_log if writer else None, directory)
            if writer:
                append_log(run_log, f"{reason}\n{''.join(traceback.format_exception(error))}")
            record = RunRecord(dataset, method, seed, {}, 0.0, entries=list(context.entries), error=reason)
        records.append(record)
        if on_record is not None:
            on_record(record, resumed)
        if record.error is not None and on_failure == "stop":
            raise JobFailed(record.error)
    return records
