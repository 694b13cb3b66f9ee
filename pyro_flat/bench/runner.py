"""Run registered methods over datasets and seeds, and evaluate each fitted posterior the same way."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import pyro
import torch
from tqdm.auto import tqdm

from ..data import ClassificationData
from ..infer.predict import bma_predict
from ..metrics import evaluate, hessian_eigenvalues, model_loss_fn
from ..nn import has_batchnorm, refresh_batchnorm
from . import methods as _methods  # noqa: F401  (registers every method)
from .config import RunConfig
from .problem import Posterior, Problem, to_device
from .registry import DATASETS, METHODS, lookup


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
    also returns the BMA test probabilities."""
    inputs = {"test": data.x_test} if data.x_ood is None else {"test": data.x_test, "ood": data.x_ood}
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


def run_one(method: str, dataset: str, seed: int, config: RunConfig) -> RunRecord:
    """Fit ``method`` on ``dataset`` with ``seed`` and evaluate it."""
    spec = lookup(METHODS, "method", method)
    load = lookup(DATASETS, "dataset", dataset)
    data = to_device(load(flatten=config.model != "cnn"), config)
    problem = Problem(data, config)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    posterior = spec.fit(problem)
    fit_seconds = time.perf_counter() - start
    pyro.set_rng_seed(10_000 + seed)
    metrics, probs = evaluate_posterior(posterior, data, config)
    return RunRecord(dataset, method, seed, metrics, fit_seconds, posterior.info, probs.cpu())


def run_benchmark(
    datasets: Sequence[str],
    methods: Sequence[str],
    seeds: Sequence[int],
    config: RunConfig,
    *,
    progress: bool = True,
    on_record: Callable[[RunRecord], None] | None = None,
) -> list[RunRecord]:
    """Run every method on every dataset for every seed; unknown names fail before any training starts."""
    for name in datasets:
        lookup(DATASETS, "dataset", name)
    for name in methods:
        lookup(METHODS, "method", name)
    if not seeds:
        raise ValueError("`seeds` is empty")
    jobs = [(d, m, s) for d in datasets for m in methods for s in seeds]
    records = []
    bar = tqdm(jobs, disable=not progress, desc="pyro_flat bench")
    for dataset, method, seed in bar:
        bar.set_postfix_str(f"{dataset}/{method}/seed {seed}")
        record = run_one(method, dataset, seed, config)
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records
