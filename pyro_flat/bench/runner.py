"""Run registered methods over datasets and seeds, and evaluate each fitted posterior the same way."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import pyro
import torch
from tqdm.auto import tqdm

from ..data import ClassificationData
from ..distributed import local_batchnorm
from ..infer.predict import bma_predict
from ..metrics import evaluate, hessian_eigenvalues, model_loss_fn
from ..nn import has_batchnorm, refresh_batchnorm
from . import methods as _methods  # noqa: F401  (registers every method)
from .batches import world
from .config import RunConfig
from .context import RunContext, check_fingerprint
from .files import OutputFolderError, atomic_save, load_checkpoint, metrics_log_writer, output_lock
from .options import check_option_values
from .problem import Posterior, Problem, to_device
from .registry import METHODS, check_method_options, dataset_names, load_data, lookup


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
        first = str(error).splitlines()[0]
        raise FloatingPointError(f"{context.label} diverged: {where}; training stopped on: {first} "
                                 f"({context.last_good()})") from error
    fit_seconds = time.perf_counter() - start
    pyro.set_rng_seed(10_000 + seed)
    metrics, probs = evaluate_posterior(posterior, data, config)
    return RunRecord(dataset, method, seed, metrics, fit_seconds, posterior.info, probs.cpu(), data.y_test.cpu(),
                     list(context.entries))


def run_benchmark(
    datasets: Sequence[str],
    methods: Sequence[str],
    seeds: Sequence[int],
    config: RunConfig,
    *,
    progress: bool = True,
    on_record: Callable[[RunRecord], None] | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    metrics_log: Path | None = None,
) -> list[RunRecord]:
    """Run every method on every dataset for every seed; unknown names and option values that a method would refuse
    fail before any training starts.

    :param checkpoint_dir: a folder of per-job checkpoints (``<dataset>__<method>__seed<s>/``: the rolling checkpoint,
        each training phase's final state, collected draws, and the job's record once it is done). One run at a time
        writes there (:func:`~pyro_flat.bench.files.output_lock`; stale temporary files are removed), and a run
        without ``resume`` refuses to start over checkpoints of an earlier one.
    :param checkpoint_every: steps between checkpoints (0: only at the end of every training phase).
    :param resume: continue a killed run from ``checkpoint_dir``: finished jobs are read back after checking that
        their configuration is this run's, the interrupted one continues from its last checkpoint, exactly.
    :param metrics_log: a JSON-lines file receiving one entry per training epoch (rebuilt on resume).
    :raises OutputFolderError: if another run holds ``checkpoint_dir``, or it holds checkpoints and ``resume`` is off.
    """
    names = dataset_names()
    for name in datasets:
        if name not in names:
            raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(names)}")
    for name in methods:
        lookup(METHODS, "method", name)
    check_method_options(config.options)
    check_option_values(config, methods)
    if not seeds:
        raise ValueError("`seeds` is empty")
    jobs = [(d, m, s) for d in datasets for m in methods for s in seeds]
    writer = world()[0] == 0
    with output_lock(checkpoint_dir) if checkpoint_dir is not None else nullcontext():
        if checkpoint_dir is not None and not resume:
            _refuse_earlier_checkpoints(Path(checkpoint_dir), jobs)
        return _run_jobs(jobs, config, progress=progress, on_record=on_record, checkpoint_dir=checkpoint_dir,
                         checkpoint_every=checkpoint_every, resume=resume, metrics_log=metrics_log, writer=writer)


def _refuse_earlier_checkpoints(checkpoint_dir: Path, jobs: Sequence[tuple[str, str, int]]) -> None:
    for job in jobs:
        directory = checkpoint_dir / job_name(*job)
        if directory.is_dir() and any(directory.iterdir()):
            raise OutputFolderError(
                f"{directory} holds the checkpoints of an earlier run, and this run would overwrite them: continue "
                "it with --resume (resume=True), or delete the folder, or choose another output folder"
            )


def _run_jobs(
    jobs: Sequence[tuple[str, str, int]],
    config: RunConfig,
    *,
    progress: bool,
    on_record: Callable[[RunRecord], None] | None,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    resume: bool,
    metrics_log: Path | None,
    writer: bool,
) -> list[RunRecord]:
    log = None
    if metrics_log is not None:
        log = metrics_log_writer(metrics_log)
        if writer:
            metrics_log.parent.mkdir(parents=True, exist_ok=True)
            metrics_log.write_text("")
    records = []
    bar = tqdm(jobs, disable=not (progress and writer), desc="pyro_flat bench")
    for dataset, method, seed in bar:
        bar.set_postfix_str(f"{dataset}/{method}/seed {seed}")
        directory = None if checkpoint_dir is None else Path(checkpoint_dir) / job_name(dataset, method, seed)
        done = None if directory is None else directory / "record.pt"
        label, fingerprint = f"{dataset}/{method}/seed {seed}", job_fingerprint(dataset, method, seed, config)
        if resume and done is not None and done.exists():
            saved = load_checkpoint(done)
            check_fingerprint(label, done, saved.pop("fingerprint", None), fingerprint)
            record = RunRecord(**saved)
            for entry in record.entries if (log is not None and writer) else []:
                log(entry)
        else:
            context = RunContext(label=label, directory=directory, every=checkpoint_every, resume=resume,
                                 progress=progress, log=log, is_writer=writer, fingerprint=fingerprint)
            for entry in context.restored_entries if (log is not None and writer) else []:
                log(entry)
            record = run_one(method, dataset, seed, config, context=context)
            if done is not None and writer:
                atomic_save(vars(record) | {"fingerprint": fingerprint}, done)
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records
